"""forget.checkpoint: a drop-in for torch.utils.checkpoint.checkpoint (non-reentrant)."""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import forget


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Dropout(0.3), nn.Linear(8, 6))


@pytest.mark.parametrize("use_reentrant", [None, False])
def test_grads_equal_torch_checkpoint_and_plain(use_reentrant):
    net = _mlp()
    x = torch.randn(4, 6, requires_grad=True)
    results = []
    for run in ("plain", "torch", "forget"):
        net.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        if run == "plain":
            y = net(x)
        elif run == "torch":
            y = tc.checkpoint(net, x, use_reentrant=False)
        else:
            y = forget.checkpoint(net, x, use_reentrant=use_reentrant)
        y.square().sum().backward()
        results.append([y.detach(), x.grad, *[p.grad for p in net.parameters()]])
    for a, b, c in zip(*results, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_kwargs_and_nested_non_tensor_outputs():
    x = torch.randn(3, requires_grad=True)

    def f(a, *, scale, extra=None):
        return {"y": (a * scale).exp(), "pair": [a.sin(), "tag"], "n": 3}

    out = forget.checkpoint(f, x, scale=2.0, use_reentrant=False)
    assert out["n"] == 3 and out["pair"][1] == "tag"
    (out["y"].sum() + out["pair"][0].sum()).backward()
    expected = 2 * torch.exp(2 * x.detach()) + x.detach().cos()
    assert torch.equal(x.grad, expected)


def test_tensor_kwargs_reach_the_function_and_get_grads():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    forget.checkpoint(lambda a, w: (a * w).exp().sum(), x, w=w).backward()
    assert torch.equal(w.grad, x.detach() * (x.detach() * w.detach()).exp())


def test_use_reentrant_true_warns_and_runs_our_engine():
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant=True is ignored"):
        y = forget.checkpoint(lambda a: a.exp(), x, use_reentrant=True)
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_no_warning_by_default():
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forget.checkpoint(lambda a: a.exp(), x).sum().backward()


def test_bad_determinism_check_and_not_callable():
    with pytest.raises(ValueError, match="determinism_check must be one of"):
        forget.checkpoint(lambda a: a, torch.ones(1), determinism_check="strict")
    with pytest.raises(TypeError, match="function must be callable"):
        forget.checkpoint(None, torch.ones(1))


def test_determinism_check_none_skips_the_metadata_comparison():
    x = torch.randn(4, requires_grad=True)

    def f(a):
        b = a.float() if not forget.in_recomputing() else a.double()
        return b.exp().float().sum()

    with pytest.raises(forget.RecomputationMismatchError, match="dtype"):
        forget.checkpoint(f, x).backward()
    x.grad = None
    forget.checkpoint(f, x, determinism_check="none").backward()
    assert torch.allclose(x.grad, x.detach().exp())


def test_context_fn_contexts_wrap_forward_and_recomputation():
    entered: list[str] = []

    class Ctx:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            entered.append(self.name + ":" + str(forget.in_recomputing()))

        def __exit__(self, *exc: object) -> None:
            return None

    x = torch.randn(3, requires_grad=True)
    y = forget.checkpoint(lambda a: a.exp(), x, context_fn=lambda: (Ctx("fwd"), Ctx("rec")))
    y.sum().backward()
    assert entered == ["fwd:False", "rec:True"]
    forget.checkpoint(lambda a: a.exp(), x, context_fn=lambda: (nullcontext(), nullcontext()))


def test_batchnorm_updated_once_unlike_torch_checkpoint():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    x = torch.randn(8, 4)
    plain(x).sum().backward()
    forget.checkpoint(ours, x).sum().backward()
    tc.checkpoint(theirs, x, use_reentrant=False).sum().backward()
    assert int(plain[1].num_batches_tracked) == 1
    assert int(ours[1].num_batches_tracked) == 1
    assert int(theirs[1].num_batches_tracked) == 2  # why forget exists (torch 2.13)
    assert torch.equal(plain[1].running_mean, ours[1].running_mean)
    assert not torch.equal(plain[1].running_mean, theirs[1].running_mean)


def test_preserve_rng_state_false_does_not_replay():
    x = torch.ones(1000, requires_grad=True)
    torch.manual_seed(0)
    y = forget.checkpoint(lambda a: torch.nn.functional.dropout(a, 0.5) * a, x)
    y.sum().backward()
    exact = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    y = forget.checkpoint(
        lambda a: torch.nn.functional.dropout(a, 0.5) * a, x, preserve_rng_state=False
    )
    y.sum().backward()
    assert not torch.equal(exact, x.grad)  # a fresh mask in the re-run


def _staged(marks: list[str]):
    """A function whose body notes how far it ran; nothing after ``exp`` is saved for backward."""

    def f(a):
        marks.append("start")
        b = a.sin()  # saves a
        c = b.exp()  # saves its output: the last tensor saved
        marks.append("saved all")
        d = c + 1  # add saves nothing
        for _ in range(3):
            d = d + 1
        marks.append("end")
        return c, d

    return f


_EARLY_STOPS = {
    "default": ({}, nullcontext),
    "early_stop=True": ({"early_stop": True}, nullcontext),
    "early_stop=False": ({"early_stop": False}, nullcontext),
    "set_checkpoint_early_stop(False)": ({}, lambda: tc.set_checkpoint_early_stop(False)),
    "set_checkpoint_early_stop(False) over early_stop=True": (
        {"early_stop": True},
        lambda: tc.set_checkpoint_early_stop(False),
    ),
    "set_checkpoint_early_stop(True) over early_stop=False": (
        {"early_stop": False},
        lambda: tc.set_checkpoint_early_stop(True),
    ),
}


@pytest.mark.parametrize("case", list(_EARLY_STOPS), ids=list(_EARLY_STOPS))
def test_early_stop_reruns_as_much_as_torch_and_grads_stay_plain(case):
    options, context = _EARLY_STOPS[case]
    x = torch.randn(5, requires_grad=True)
    runs = {}
    for run in ("plain", "torch", "forget"):
        marks: list[str] = []
        f = _staged(marks)
        x.grad = None
        with context():  # around the forward only, as torch documents
            if run == "plain":
                c, d = f(x)
            elif run == "torch":
                c, d = tc.checkpoint(f, x, use_reentrant=False, **options)
            else:
                c, d = forget.checkpoint(f, x, **options)
        (c.square().sum() + d.sum()).backward()
        runs[run] = (marks, x.grad)
    whole = case.startswith("set_checkpoint_early_stop(False)") or case == "early_stop=False"
    rerun = ["start", "saved all", "end"] if whole else ["start"]
    assert runs["torch"][0] == runs["forget"][0] == ["start", "saved all", "end", *rerun]
    assert torch.equal(runs["plain"][1], runs["forget"][1])
    assert torch.equal(runs["plain"][1], runs["torch"][1])


def test_early_stop_false_counts_the_ops_of_the_whole_function():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # Only the tail after the last saved tensor adds.
            self.ops += func.overloadpacket.__name__ == "add"
            return func(*args, **(kwargs or {}))

    x = torch.randn(5, requires_grad=True)
    counts = []
    for early_stop in (True, False):
        c, _ = forget.checkpoint(_staged([]), x, early_stop=early_stop)
        loss = c.sum()  # backward through d would add too: leave d out
        with Count() as count:
            loss.backward()
        counts.append(count.ops)
    assert counts == [0, 4]  # early stop: none of the 4 adds run again


def test_early_stop_false_checks_the_count_of_the_whole_rerun():
    def f(a):
        c = a.sin().exp()
        if forget.in_recomputing():
            c.detach().requires_grad_().cos()  # saves one tensor more, after the last one
        return c

    x = torch.randn(3, requires_grad=True)
    forget.checkpoint(f, x).sum().backward()  # early stop: the extra op never runs
    with pytest.raises(forget.RecomputationMismatchError, match=r"saved 3 tensors .* saved 2"):
        forget.checkpoint(f, x, early_stop=False).sum().backward()


def _differs_on_rerun(a):
    b = a.sin()
    c = b.float() if not forget.in_recomputing() else b.double()
    return c.exp().float().sum()


_PLAIN_MISMATCH = (
    "forget: the 2nd tensor saved by the recomputation of '_differs_on_rerun' differs from "
    "the forward's: forward saved shape=[4] dtype=torch.float32 device=cpu, recomputation "
    "saved shape=[4] dtype=torch.float64 device=cpu; the function must compute the same "
    "thing both times."
)


def _mismatch(**options) -> str:
    x = torch.randn(4, requires_grad=True)
    y = forget.checkpoint(_differs_on_rerun, x, **options)
    with pytest.raises(forget.RecomputationMismatchError) as info:
        y.backward()
    return str(info.value)


def test_debug_shows_both_op_sequences_around_the_first_difference():
    message = _mismatch(debug=True)
    head, _, trace = message.partition("\n\n")
    assert head == _PLAIN_MISMATCH
    assert trace.startswith(
        "debug: the first op that differs is op 2: the forward ran aten.exp.default, "
        "the re-run aten._to_copy.default"
    )
    forward, _, rerun = trace.partition("  re-run:\n")
    assert "  forward:\n" in forward
    sin = "1  aten.sin.default -> float32[4]  at test_checkpoint.py:"
    assert sin in forward and sin in rerun
    assert "> " + "   2  aten.exp.default -> float32[4]" in forward
    assert "> " + "   2  aten._to_copy.default -> float64[4]" in rerun
    assert "in _differs_on_rerun: c = b.float() if not forget.in_recomputing()" in rerun
    assert "in _differs_on_rerun: return c.exp().float().sum()" in forward


def test_without_debug_the_mismatch_message_is_unchanged():
    assert _mismatch() == _PLAIN_MISMATCH
    with tc.set_checkpoint_debug_enabled(False):  # overrides debug=True, as in torch
        assert _mismatch(debug=True) == _PLAIN_MISMATCH


def test_set_checkpoint_debug_enabled_turns_debug_on():
    with tc.set_checkpoint_debug_enabled(True):
        x = torch.randn(4, requires_grad=True)
        y = forget.checkpoint(_differs_on_rerun, x)
    with pytest.raises(forget.RecomputationMismatchError, match="the first op that differs"):
        y.backward()  # the flag is read at the forward, as torch reads it


def test_debug_changes_no_gradient_and_works_with_context_fn():
    net = _mlp()
    x = torch.randn(4, 6, requires_grad=True)
    grads = []
    for options in ({}, {"debug": True}, {"debug": True, "context_fn": tc.noop_context_fn}):
        net.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        forget.checkpoint(net, x, **options).square().sum().backward()
        grads.append([p.grad for p in net.parameters()])
    for a, b, c in zip(*grads, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
