"""forget.cap: every step under a memory cap, with no plan; differential against plain steps."""

from __future__ import annotations

import copy
import functools
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import forget
from _cap_steps import _equal
from forget._runtime import EVICTIONS
from forget._runtime._cap import _cap_with


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.norm = nn.BatchNorm1d(4 * width)
        self.drop = nn.Dropout(0.2)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.relu(self.norm(self.up(x)))))


class Net(nn.Module):
    """Candidates by default: stem, body, body.0 .. body.3, head (body nests the blocks)."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, width))
        self.body = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().train()


def _x(batch: int) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))


def _step(net: nn.Module, x: torch.Tensor, seed: int = 5) -> None:
    net.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    net(x).square().mean().backward()


def _state(net: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in net.named_buffers()}


def _plain_peak(batch: int) -> int:
    net = _net()
    return forget.measure(_step, net, _x(batch)).peak_bytes


BATCHES = (16, 64, 32)


@pytest.mark.parametrize("share", [10.0, 0.9, 0.8], ids=["never-reached", "0.9", "0.8"])
def test_grads_buffers_and_reruns_match_plain_on_varying_shapes(share: float) -> None:
    plain, capped = _net(), _net()
    budget = int(share * _plain_peak(max(BATCHES)))
    handle = forget.cap(capped, budget)
    calls: dict[str, int] = {}
    for name, module in capped.named_modules():
        if name.startswith("body.") and name.count(".") == 1:
            module.up.register_forward_hook(
                lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1)
            )
    evicted = 0
    for batch in BATCHES:
        calls.clear()
        _step(plain, _x(batch))
        _step(capped, _x(batch))
        assert _equal(_state(plain)[0], _state(capped)[0])  # bitwise, dropout replayed
        assert _equal(_state(plain)[1], _state(capped)[1])  # BatchNorm statistics once
        report = handle.last_step
        assert report is not None and len(report.regions) == 7
        assert "body" not in report.evicted  # it holds the blocks' inputs: never worth it
        # Counted re-runs: each evicted block runs once more, in backward; no other does.
        assert calls == {f"body.{i}": 1 + (f"body.{i}" in report.evicted) for i in range(4)}
        evicted += len(report.evicted)
    assert (evicted == 0) == (share > 1)


@pytest.mark.parametrize("share", [0.8], ids=["0.8"])
def test_every_step_within_the_cap_by_the_ledger(share: float) -> None:
    net = _net()
    budget = int(share * _plain_peak(max(BATCHES)))
    handle = forget.cap(net, budget)
    for batch in BATCHES:  # the first step too: nothing learned before it
        peak = forget.measure(_step, net, _x(batch)).peak_bytes
        assert peak <= budget, (batch, peak, budget, handle.last_step)
    assert any(report.evicted for report in handle.steps)


@pytest.mark.parametrize("eviction", list(EVICTIONS))
def test_every_eviction_order_keeps_the_cap_and_the_plain_gradients(eviction: str) -> None:
    plain, capped = _net(), _net()
    budget = int(0.8 * _plain_peak(64))
    handle = _cap_with(capped, budget, eviction=eviction)
    _step(plain, _x(64))
    assert forget.measure(_step, capped, _x(64)).peak_bytes <= budget
    assert _equal(_state(plain)[0], _state(capped)[0])
    assert _equal(_state(plain)[1], _state(capped)[1])
    report = handle.last_step
    assert report is not None and report.evicted and report.evicted_forward_s > 0
    if eviction == "first_run":  # the regions go in the order the forward ran them
        where = [report.regions.index(name) for name in report.evicted]
        assert where == sorted(where), report


def test_an_unknown_eviction_order_names_the_known_ones() -> None:
    net = _net()
    expected = r"no eviction order named 'lru'; expected one of 'largest', 'dtr', "
    with pytest.raises(ValueError, match=expected):
        _cap_with(net, 10**6, eviction="lru")
    assert not any("forward" in m.__dict__ for m in net.modules())


def test_a_large_last_region_is_within_the_cap_by_the_ledger() -> None:
    # Backward starts in the head, at its peak, re-running it if it was evicted: its
    # working memory (two gradients of its 1024-wide activation) must be in the estimate.
    def make() -> Net:
        torch.manual_seed(0)
        net = Net(depth=6)
        net.head = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 4))
        return net.train()

    plain, net = make(), make()
    budget = int(0.8 * forget.measure(_step, make(), _x(64)).peak_bytes)
    handle = forget.cap(net, budget)
    for _ in range(3):  # whole regions, then (the shapes read) the head's kept output too
        assert forget.measure(_step, net, _x(64)).peak_bytes <= budget
        _step(plain, _x(64))
        assert handle.last_step is not None
        assert handle.last_step.evicted or handle.last_step.partial
        assert _equal(_state(plain)[0], _state(net)[0])


class Wide(nn.Module):
    """A head of one module, no children: under the selective policy it keeps each
    matmul's output of its first layer (``parts`` slices of one parameter, their
    outputs summed) beside ReLU's."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.ups = nn.Parameter(torch.randn(parts, 1024, 16) / 4)
        self.down = nn.Parameter(torch.randn(4, 1024) / 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.ups[0])
        for up in self.ups[1:]:
            h = h + F.linear(x, up)
        return F.linear(torch.relu(h), self.down)


@pytest.mark.parametrize("parts", [1, 6])
@pytest.mark.parametrize("share", [0.95, 0.9, 0.85])
def test_a_region_that_keeps_too_much_under_the_policy_holds_the_cap(share, parts):
    # The second step, of shapes the first read, runs the head under the policy for
    # the first time: its keep is bounded to a quarter of what it held then, and the
    # head, whose policy keeps more, lets what it kept go as it returns.
    def make() -> Net:
        torch.manual_seed(0)
        net = Net(depth=6)
        net.head = Wide(parts)
        return net.train()

    plain, net = make(), make()
    budget = int(share * forget.measure(_step, make(), _x(64)).peak_bytes)
    handle = forget.cap(net, budget)
    peaks = []
    for _ in range(4):
        peaks.append(forget.measure(_step, net, _x(64)).peak_bytes)
        _step(plain, _x(64))
        assert _equal(_state(plain)[0], _state(net)[0])
    # With six slices the first step passes the cap in backward: each slice's gradient
    # is a zero tensor of the whole parameter's size, which the first step's model of
    # backward does not foresee; its read teaches the next.
    assert max(peaks[parts > 1 :]) <= budget, [p / budget for p in peaks]
    assert not any(s.partial for s in handle.steps)


class Stem(nn.Module):
    """One of a kind, with children: finer regions inside it (NOTE [finer regions])."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(x))


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Conv2d(8, 48, 3, padding=1)
        self.norm = nn.BatchNorm2d(48)
        self.down = nn.Conv2d(48, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class CNN(nn.Module):
    """Candidates by default: stem (one of a kind) with stem.conv and stem.pool inside,
    body, body.0 .. body.2, head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = Stem()
        self.body = nn.Sequential(*[ConvBlock() for _ in range(3)])
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).flatten(1))


def _cnn() -> CNN:
    torch.manual_seed(0)
    return CNN().train()


def _image(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))


@functools.cache
def _cnn_plain_peak() -> int:
    return forget.measure(_step, _cnn(), _image(8)).peak_bytes


def test_finer_regions_only_inside_a_one_of_a_kind_region() -> None:
    # NOTE [finer regions]: the CNN's stem is the only Stem; the Net's stem is a
    # Sequential, as its body is, so it stays whole; candidates= is taken as given.
    assert forget.cap(_cnn(), 10**9).names == (
        "stem", "stem.conv", "stem.pool", "body", "body.0", "body.1", "body.2", "head",
    )  # fmt: skip
    assert forget.cap(_net(), 10**9).names == (
        "stem", "body", "body.0", "body.1", "body.2", "body.3", "head",
    )  # fmt: skip
    assert forget.cap(_cnn(), 10**9, candidates=["stem", "body.*"]).names[:2] == (
        "stem",
        "body.0",
    )


@pytest.fixture
def counted_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Region costs from a counter, not the wall clock: the eviction order (DTR's
    cost / (bytes x staleness)) is then the same on any machine."""
    from forget._runtime import _cap

    ticks = iter(range(10**9))
    monkeypatch.setattr(_cap, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


@pytest.mark.usefixtures("counted_costs")
@pytest.mark.parametrize("share", [0.65, 0.5], ids=["0.65", "0.5"])
@pytest.mark.parametrize("batch", [8, 6], ids=["8", "6"])
def test_a_first_step_is_within_the_cap_by_the_ledger(share: float, batch: int) -> None:
    # Nothing learned: the forward's reserve guesses the next region from the last one,
    # and the activation between them, held by no region yet, must be counted.
    budget = int(share * _cnn_plain_peak())
    net = _cnn()
    forget.cap(net, budget)
    assert forget.measure(_step, net, _image(batch)).peak_bytes <= budget


@pytest.mark.usefixtures("counted_costs")
def test_an_outer_region_evicted_after_its_inner_ones_matches_plain() -> None:
    plain, capped = _cnn(), _cnn()
    budget = int(0.5 * _cnn_plain_peak())
    handle = forget.cap(capped, budget)
    calls = [0]
    capped.stem.conv[0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    for batch in (4, 8):  # the first step teaches the sizes the second one's forward expects
        calls[0] = 0
        _step(plain, _image(batch))
        assert forget.measure(_step, capped, _image(batch)).peak_bytes <= budget
        assert _equal(_state(plain)[0], _state(capped)[0])  # bitwise
        assert _equal(_state(plain)[1], _state(capped)[1])  # BatchNorm statistics once
        report = handle.last_step
        assert report is not None
        evicted = report.evicted
        # Counted re-runs of the stem's conv: the forward, the stem's re-run (its inner
        # regions run plainly there) and stem.conv's own re-run, once each if evicted.
        assert calls == [1 + ("stem.conv" in evicted) + ("stem" in evicted)]
    # The stem, holding its inner regions' inputs, goes at batch 8, after them.
    assert "stem" in evicted
    assert evicted.index("stem") > max(evicted.index("stem.conv"), evicted.index("stem.pool"))
    assert calls == [3]


def test_a_cap_that_cannot_hold_raises_and_leaves_the_model_as_it_was() -> None:
    plain, net = _net(), _net()
    before = copy.deepcopy(net.state_dict())
    handle = forget.cap(net, 20_000)
    with pytest.raises(
        forget.ForgetError, match=r"cap of 20,000 B cannot hold .* at least"
    ) as error:
        _step(net, _x(64))
    least = int(str(error.value).split("at least ")[1].split(" B")[0].replace(",", ""))
    assert least > 20_000
    assert _equal(before, net.state_dict())  # BatchNorm statistics put back
    assert all(p.grad is None for p in net.parameters())
    handle.set_budget(10**9)  # a later step with a higher cap works
    _step(plain, _x(64))
    _step(net, _x(64))
    assert _equal(_state(plain)[0], _state(net)[0])
    assert _equal(_state(plain)[1], _state(net)[1])


class WithLoss(nn.Module):
    """`Net` that computes its loss, as a Hugging Face model given labels does."""

    def __init__(self, loss_grad: bool) -> None:
        super().__init__()
        self.net, self.loss_grad = _net(), loss_grad

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # A wide output: backward's term, where the output counts, is the step's peak.
        out = self.net(x).repeat(1, 256)
        loss = out.square().mean()  # saves ``out``: the hook on the model's forward counts it
        return (loss if self.loss_grad else loss.detach()), out


def test_a_loss_the_model_returns_is_not_counted_again_after_its_forward() -> None:
    estimates = {}
    for loss_grad in (True, False):
        net = WithLoss(loss_grad)
        handle = forget.cap(net, 10**12)
        torch.manual_seed(5)
        net(_x(64))
        estimates[loss_grad] = handle.steps[-1].estimated_peak_bytes
    # Without a loss in it, the output is counted once more (a loss outside saves it).
    assert estimates[False] - estimates[True] == 64 * 4 * 256 * 4 + 4


def test_remove_puts_every_forward_back() -> None:
    net = _net()
    own = net.head.forward
    net.head.forward = own  # an instance forward set before the cap is kept
    handle = forget.cap(net, "1MiB")
    assert all("forward" in m.__dict__ for m in (net, net.stem, net.body, net.body[0]))
    assert handle.remove() is net
    assert net.head.__dict__["forward"] is own
    assert not any("forward" in m.__dict__ for m in net.modules() if m is not net.head)
    forget.cap(net, "1MiB").remove()  # capping again after a remove works


def test_a_parameter_replaced_or_added_between_steps_is_seen() -> None:
    # NOTE [cached walks]: the step's walk of the model is kept from step to step.
    plain, capped = _net(), _net()
    budget = int(0.8 * _plain_peak(64))
    forget.cap(capped, budget)
    for step in range(3):
        if step == 2:  # the same new weight in both
            torch.manual_seed(3)
            new = torch.randn(256, 8)
            plain.stem[0].weight = nn.Parameter(new.clone())
            capped.stem[0].weight = nn.Parameter(new.clone())
        _step(plain, _x(64))
        assert forget.measure(_step, capped, _x(64)).peak_bytes <= budget
        assert _equal(_state(plain)[0], _state(capped)[0])
        assert _equal(_state(plain)[1], _state(capped)[1])
    # A parameter no op uses keeps no gradient, which the cap counts as one to come:
    # 4 MiB, far over this cap, so the step stops (a stale walk would not see it).
    capped.head.register_parameter("spare", nn.Parameter(torch.zeros(2**20)))
    with pytest.raises(forget.ForgetError, match="cannot hold this step"):
        _step(capped, _x(64))


def test_regions_under_no_grad_just_run() -> None:
    net = _net().eval()
    handle = forget.cap(net, 1_000)  # far too little for a step, nothing for inference
    with torch.no_grad():
        assert torch.equal(net(_x(4)), _net().eval()(_x(4)))
    assert handle.last_step is None


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        ("lots", ValueError, "cannot read the budget"),
        ("150%", ValueError, r"must lie in \(0, 1\]"),
        ("free", ValueError, "the CUDA device has free, and this step runs on"),
        (1.5, ValueError, r"must lie in \(0, 1\]"),
        (-3, ValueError, "must be positive"),
        (True, TypeError, "not a bool"),
    ],
    ids=["no-size", "percent-past-1", "free-on-cpu", "fraction-past-1", "negative", "bool"],
)
def test_bad_budgets(budget: Any, error: type[Exception], match: str) -> None:
    net = _net()
    with pytest.raises(error, match=match):
        forget.cap(net, budget)
    assert not any("forward" in m.__dict__ for m in net.modules())


def _sum_step_peak(batch: int) -> int:
    """The plain step's ledger peak as the cap predicts it: the sum of the output."""
    net, x = _net(), _x(batch)
    torch.manual_seed(5)
    return forget.measure(lambda: net(x).sum().backward()).peak_bytes


@pytest.mark.parametrize("share", ["80%", 0.8], ids=["percent", "fraction"])
def test_a_share_is_of_each_shapes_plain_peak_and_holds_with_the_plain_gradients(share):
    # NOTE [a share of the cap]: the plain step's peak of each shape, on fake tensors,
    # what the same step measures on real ones; every step within it, the gradients plain.
    plain, capped = _net(), _net()
    batches = (256, 128, 512, 256)
    handle = forget.cap(capped, share)
    by_bytes = forget.cap(_net(), int(0.8 * _sum_step_peak(batches[0])))
    for batch in batches:
        _step(plain, _x(batch))
        peak = forget.measure(_step, capped, _x(batch)).peak_bytes
        assert handle.budget_bytes == int(0.8 * _sum_step_peak(batch))
        assert peak <= handle.budget_bytes, (batch, peak, handle.last_step)
        assert _equal(_state(plain)[0], _state(capped)[0])
        assert _equal(_state(plain)[1], _state(capped)[1])
    assert all(report.budget_bytes == handle.budget_bytes for report in handle.steps[-1:])
    assert any(report.evicted for report in handle.steps)
    # The same bytes given as bytes: the same regions evicted at that shape.
    _step(by_bytes.model, _x(batches[0]))
    first = handle.steps[0]
    assert by_bytes.last_step is not None and by_bytes.last_step.evicted == first.evicted
    handle.set_budget("100%")  # of the latest shape's plain peak, at once
    assert handle.budget_bytes == _sum_step_peak(batches[-1])


def test_a_share_of_a_step_that_does_not_run_on_fake_tensors_asks_for_bytes() -> None:
    class Picky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x[x.sum(dim=1) > 0])  # a shape that depends on the data

    net = Picky()
    forget.cap(net, "50%", candidates=["layers.0", "layers.1"])
    with pytest.raises(forget.ForgetError, match="does not run on them"):
        net(_x(16)).sum().backward()


def test_bad_models() -> None:
    with pytest.raises(TypeError, match=r"takes an nn.Module"):
        forget.cap(lambda x: x, 1000)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="candidates="):
        forget.cap(nn.Linear(2, 2), 1000)
    with pytest.raises(ValueError, match="matches no submodule"):
        forget.cap(_net(), 1000, candidates="*.nothing")


def test_plan_and_cap_run_modules_through_one_wrapper() -> None:
    # NOTE [instance forward] in forget._regions: one wrapper, its owner named.
    from forget._planning._tree.apply import unwrap, wrap
    from forget._regions import RegionForward, owner_of

    net = _net()
    handle = forget.cap(net, "1MiB")
    wrappers = [m.__dict__["forward"] for m in net.modules() if "forward" in m.__dict__]
    assert len(wrappers) > 1  # the model and its regions
    assert all(type(w) is RegionForward and w.owner == "cap" for w in wrappers)
    assert not unwrap(net) and owner_of(net) == "cap"  # a plan's unwrap leaves the cap's
    handle.remove()
    assert not any("forward" in m.__dict__ for m in net.modules())
    wrap(net.body[1], "forget", None)
    assert type(net.body[1].forward) is RegionForward and owner_of(net.body[1]) == "plan"
    assert unwrap(net.body[1]) and "forward" not in net.body[1].__dict__


def test_one_cap_per_model_and_none_over_a_plan() -> None:
    from forget._planning._tree.apply import wrap

    net = _net()
    handle = forget.cap(net, "1MiB")
    with pytest.raises(forget.ForgetError, match="runs under a cap already"):
        forget.cap(net, "2MiB")
    assert handle.budget_bytes == 1024**2
    handle.remove()
    wrap(net.body[1], "forget", None)  # as a tree plan's apply leaves it
    with pytest.raises(forget.ForgetError, match="runs under a forget plan"):
        forget.cap(net, "1MiB")
    assert not any("forward" in m.__dict__ for m in net.modules() if m is not net.body[1])


def test_candidates_choose_the_regions() -> None:
    net = _net()
    handle = forget.cap(net, 10**9, candidates=Block)
    _step(net, _x(16))
    assert handle.last_step is not None
    assert handle.last_step.regions == ("body.0", "body.1", "body.2", "body.3")


def _tiny_gpt2(tf: Any, positions: int) -> nn.Module:
    """A two-layer GPT-2 (dropout on) from a config, seeded."""
    config = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=positions,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(config).train()


def _lm_steps(nets: tuple[nn.Module, ...], ids: torch.Tensor) -> None:
    """One language-model step of each net on ``ids``, dropout drawing alike."""
    for net in nets:
        net.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        net(input_ids=ids, labels=ids).loss.backward()


def _llama_lm(tf: Any, use_cache: bool) -> nn.Module:
    """Issue 45's Llama, small: its config's defaults but the sizes; its head's logits
    (a vocabulary 60 times the width) make the step's peak, as they do there."""
    config = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=86,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=2000,
        use_cache=use_cache,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).train()


@pytest.mark.parametrize("use_cache", [False, True], ids=["use_cache=False", "defaults"])
def test_the_cap_and_a_plan_agree_on_the_least(use_cache: bool) -> None:
    # NOTE [regions that hold nothing] (the embedding lets the decoder around it go),
    # NOTE [the output's gradients] (no weight's gradient beside the logits' two) and
    # NOTE [copies in the count] (the cache's copies are counted, and named).
    tf = pytest.importorskip("transformers")
    from forget._planning import FixedClock, TreePlanner

    plain = _llama_lm(tf, use_cache)
    ids = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    least = TreePlanner(plain, (), batch, repeats=1, clock=FixedClock()).least()
    model = copy.deepcopy(plain)
    handle = forget.cap(model, int(0.9 * least))
    with pytest.raises(forget.ForgetError, match="at the end of the model's forward") as info:
        _lm_steps((model,), ids)
    message = str(info.value)
    named = int(message.split("needs at least ")[1].split(" B")[0].replace(",", ""))
    # The layers before the last hold their keys and values in the later layers'
    # copies of the cache: one layer's, here, each (2, 64, 32) in float.
    copies = 2 * (2 * 64 * 32 * 4) if use_cache else 0
    assert (f"Of that, {copies:,} B are tensors that regions keep" in message) == use_cache
    assert "That is the count alone: kernels' workspaces" in message  # nothing read yet
    # Within 1 % of the plan's least (named 10 % above it before these NOTEs).
    assert abs(named - copies - least) <= least // 100, (named, copies, least)
    assert handle.last_step is not None
    assert set(handle.last_step.evicted) == {
        "model",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
    }
    # At the least named, the cap holds its count, with the plain step's gradients.
    handle.set_budget(named)
    _lm_steps((plain, model), ids)
    assert _equal(_state(plain)[0], _state(model)[0])
    assert handle.last_step.estimated_peak_bytes <= named
    handle.remove()


def test_transformers_cap_stays_through_trainers_door() -> None:
    tf = pytest.importorskip("transformers")
    from forget.integrations import transformers as forget_hf

    plain = _tiny_gpt2(tf, positions=64)
    model = copy.deepcopy(plain)
    big = torch.zeros(2, 48, dtype=torch.long)
    peak = forget.measure(lambda: plain(input_ids=big, labels=big).loss.backward()).peak_bytes
    assert forget_hf.cap(model, int(0.8 * peak)) is model
    model.activation_checkpointing_enable({"use_reentrant": False})  # as Trainer does
    handle = forget_hf.cap_of(model)
    assert handle is not None and forget_hf.is_enabled(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    for tokens in (16, 48, 32):  # shapes vary; nothing planned
        ids = torch.randint(0, 64, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        _lm_steps((plain, model), ids)
        assert _equal(_state(plain)[0], _state(model)[0])  # dropout replayed
    assert any(report.evicted for report in handle.steps)
    forget_hf.disable(model)
    assert forget_hf.cap_of(model) is None
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_transformers_cap_goes_in_part_as_forget_cap_does() -> None:
    # One meaning per keyword: enable's policy is a layer's keep; the cap takes
    # forget.cap's own default, the selective keep (NOTE [the cap's defaults]).
    tf = pytest.importorskip("transformers")
    from forget.integrations import transformers as forget_hf
    from forget.policies import DEFAULT_OPTIONS

    plain = _tiny_gpt2(tf, positions=128)
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(0))
    peak = forget.measure(lambda: plain(input_ids=ids, labels=ids).loss.backward()).peak_bytes
    # The key/value cache (use_cache on) holds each layer's keys and values past it,
    # which a layer kept in part does not drop: such a step peaks above 0.8 of
    # the plain one.
    forget_hf.cap(model, int(0.85 * peak))
    handle = forget_hf.cap_of(model)
    assert handle is not None and handle.partial is DEFAULT_OPTIONS["selective"]
    for _ in range(3):  # read, then in part, then the decision repeated
        _lm_steps((plain, model), ids)
        assert _equal(_state(plain)[0], _state(model)[0])  # dropout replayed
    assert any(report.partial for report in handle.steps)
    forget_hf.disable(model)
    assert "cap" not in inspect.signature(forget_hf.enable).parameters


def test_transformers_cap_that_fails_puts_the_cap_in_force_back_as_it_was() -> None:
    # NOTE [cap in force]: a cap or a plan that cannot go in leaves the very cap
    # that was in force, with its partial keep, its reads and what it learned.
    tf = pytest.importorskip("transformers")
    from forget.integrations import transformers as forget_hf

    plain = _tiny_gpt2(tf, positions=128)
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(0))
    peak = forget.measure(lambda: plain(input_ids=ids, labels=ids).loss.backward()).peak_bytes
    forget_hf.cap(model, int(0.8 * peak))
    handle = forget_hf.cap_of(model)
    assert handle is not None and handle.partial is not None
    _lm_steps((plain, model), ids)
    with pytest.raises(ValueError, match="no_such_layer"):
        forget_hf.cap(model, "1GB", candidates="no_such_layer")
    assert forget_hf.cap_of(model) is handle

    class Refused(Exception):
        pass

    def refused(output: Any) -> torch.Tensor:
        raise Refused("no loss today")

    with pytest.raises(Refused):
        forget_hf.enable(model, budget="1GB", inputs={"input_ids": ids}, loss_fn=refused)
    assert forget_hf.cap_of(model) is handle and handle.partial is not None
    for _ in range(2):  # the second step of these shapes goes in part, as before
        _lm_steps((plain, model), ids)
        assert _equal(_state(plain)[0], _state(model)[0])
    # remove() dropped the step in flight; the two since are the handle's.
    assert len(handle.steps) == 2 and handle.steps[-1].partial
    forget_hf.disable(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def _wide() -> nn.Sequential:
    """Blocks whose weights' gradients weigh as much as what they save."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(64, 64)).train()


# Between the least caps that hold _wide's step: 0.638 of its plain peak with the
# gradients counted as they come, 0.711 with all of them at once.
SHARE_WITH_GRADIENTS_AS_THEY_COME = 0.675


def test_gradients_are_counted_as_backward_makes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [gradients as they come]: where backward meets the last blocks, the first
    # blocks' gradients do not exist yet. Counted as they come, this cap holds, with
    # the plain step's gradients; counted all at once, the same cap cannot hold.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    budget = int(SHARE_WITH_GRADIENTS_AS_THEY_COME * forget.measure(_step, _wide(), x).peak_bytes)
    plain, net = _wide(), _wide()
    handle = forget.cap(net, budget)
    assert forget.measure(_step, net, x).peak_bytes <= budget
    _step(plain, x)
    assert _equal(_state(plain)[0], _state(net)[0])
    handle.remove()

    from forget._runtime import _steps

    def all_at_once(model, entries, new_grads, holders, outside):
        return sum(nbytes for _, nbytes in new_grads), [0] * len(entries)

    monkeypatch.setattr(_steps, "gradients_by_entry", all_at_once)
    forget.cap(net, budget)
    with pytest.raises(forget.ForgetError, match="cannot hold"):
        _step(net, x)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.a.weight  # tied: owned by a and by head
        self.scale = nn.Parameter(torch.ones(8))  # the model's own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.a(x))
        return self.head(h) * self.scale + h @ self.b.weight  # b's weight saved outside b


def test_gradients_come_with_the_region_that_owns_and_alone_uses_them() -> None:
    from forget._runtime._grads import gradients_by_entry

    net = Tied()
    handle = forget.cap(net, 10**12, candidates=["a", "b", "head"])
    net(torch.randn(4, 8, requires_grad=True)).sum()
    step = handle._step
    assert step is not None and [e.name for e in step.entries] == ["a", "b", "head"]
    always, later = gradients_by_entry(
        net, step.entries, step._new_grads, step._holders, step._outside
    )
    # Tied (no region holds both owners), saved outside every region, the model's own.
    assert always == 4 * (64 + 64 + 8)
    # a's bias comes at a, b's at b: backward has both once it reaches a.
    assert later == [4 * 16, 4 * 8, 0]


def test_the_allocator_peak_is_read_as_the_backward_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [the cap's count]: on CUDA the step's allocator peak teaches the reserve;
    # it is read when backward ends, before an optimizer makes its state. CUDA is
    # stood in for (the model's device and its counters): 1,000 B over the estimate
    # when backward ends, a GB after.
    from forget._runtime import _steps

    real_init = _steps.Step.__init__

    def on_cuda(step: Any, *args: Any, **kwargs: Any) -> None:
        real_init(step, *args, **kwargs)
        step.cuda = torch.device("cuda")

    monkeypatch.setattr(_steps.Step, "__init__", on_cuda)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    net = _net()
    handle = forget.cap(net, 10**12)
    out = net(_x(16))
    step = handle._step
    assert step is not None and step.backward_peak_bytes is None
    readings = iter([step.estimated_peak_bytes + 1000, 10**9])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(readings))
    seen = []
    out.register_hook(lambda grad: seen.append(step.backward_peak_bytes))
    out.square().mean().backward()
    assert seen == [None]  # not yet read while backward runs
    assert step.backward_peak_bytes == step.estimated_peak_bytes + 1000
    net(_x(16))  # the next step learns from the reading at the backward's end
    assert handle._extra_bytes == 1000


class _ChunkedHeadNet(nn.Module):
    """Blocks, then a wide head and its loss run through `forget.chunked` by the model."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)
        )
        self.head = nn.Linear(16, 2000)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)

        def summed(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.head(h), t, reduction="sum")

        return forget.chunked(summed, x, y, chunks=8) / y.numel()


@pytest.mark.parametrize("share", [0.95, 0.85])
def test_a_chunked_head_the_model_runs_itself_is_reserved_and_held(share: float) -> None:
    # NOTE [regions heard]: the head's slices are regions the cap does not run; it
    # hears of them and reserves their backward where backward meets them first.
    model = _ChunkedHeadNet()
    plain = copy.deepcopy(model)

    def step(net: nn.Module, rows: int) -> None:
        g = torch.Generator().manual_seed(rows)
        x, y = torch.randn(rows, 16, generator=g), torch.randint(0, 2000, (rows,), generator=g)
        net.zero_grad(set_to_none=True)
        net(x, y).backward()

    peak = forget.measure(step, plain, 256, probe="profiler").peak_bytes  # slices already
    handle = forget.cap(model, int(share * peak))
    for rows in (256, 128, 256, 192):
        got = forget.measure(step, model, rows, probe="profiler").peak_bytes
        assert got <= handle.budget_bytes, (rows, got, handle.budget_bytes)
        step(plain, rows)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    handle.remove()
