"""apply_forget under DDP and FSDP2: two CPU processes on gloo, one process group.

The workers run every case in one process group (spawning is the slow part)
and write what they measured to files; the tests below, in the parent, assert
on those files, so a failure reads as a plain assertion and a worker's crash
as its traceback.

Two comparisons per case:

* forget against the same distributed run without it, per rank, with
  ``torch.equal``: same seeds, same data, same collectives, so forget must
  change nothing, BatchNorm buffers and dropout masks included.
* the distributed gradients (averaged over ranks) against one process on the
  concatenated batch, with ``assert_close``: the math is the same, but not
  bit for bit. Each rank sums over its half of the batch and the all-reduce
  adds the two halves afterwards, a different order of float additions than
  one matmul over the whole batch. And BatchNorm would differ for real (each
  rank normalizes with its own half's statistics), dropout too (each rank
  draws its own masks), so this comparison uses a model with neither.
"""

from __future__ import annotations

import datetime
import socket
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import forget

WORLD_SIZE = 2
WIDTH = 8
BATCH = 6  # per rank
STEPS = 2

DDP_CASES = {
    "ddp-default": {},
    "ddp-find-unused": {"find_unused_parameters": True},
    "ddp-static-graph": {"static_graph": True},
}
CASES = [*DDP_CASES, "fsdp2"]


class Block(nn.Module):
    """A residual MLP block; ``noisy`` adds BatchNorm and dropout, ``unused`` a dead branch."""

    def __init__(self, *, noisy: bool, unused: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(WIDTH, 2 * WIDTH)]
        if noisy:
            layers.append(nn.BatchNorm1d(2 * WIDTH))
        layers.append(nn.ReLU())
        if noisy:
            layers.append(nn.Dropout(0.25))
        layers.append(nn.Linear(2 * WIDTH, WIDTH))
        self.body = nn.Sequential(*layers)
        # Inside the forgotten region: DDP must find it unused through forget's graph.
        self.unused = nn.Linear(WIDTH, WIDTH) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Net(nn.Module):
    def __init__(self, *, noisy: bool, unused: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(4, WIDTH)
        self.layers = nn.ModuleList([Block(noisy=noisy, unused=unused) for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model(*, noisy: bool, unused: bool = False, with_forget: bool = False) -> Net:
    torch.manual_seed(0)
    net = Net(noisy=noisy, unused=unused)
    return forget.apply_forget(net, Block) if with_forget else net


def _batch() -> torch.Tensor:
    """The whole batch, ``WORLD_SIZE * BATCH`` rows; rank ``r`` takes rows ``r*BATCH:``."""
    return torch.randn(WORLD_SIZE * BATCH, 4, generator=torch.Generator().manual_seed(1))


def _plain_name(name: str) -> str:
    # DDP adds "module." in front, Forget in the middle of parameter names.
    return name.replace("module.", "")


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of a (sharded) DTensor, gathered; a plain tensor as it is."""
    if t is None:
        return None
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _train(model: nn.Module, x: torch.Tensor, rank: int) -> dict[str, Any]:
    """``STEPS`` SGD steps; losses, the last step's gradients, parameters and buffers."""
    # Runs of the first block's forward, counted as they start: a recomputation stops
    # after its last saved tensor, before the block's output (NOTE [early stop]).
    block = next(m for m in model.modules() if isinstance(m, Block))
    calls = [0]
    block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 * rank + step)  # dropout masks differ per rank, not per run
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads = {_plain_name(n): _full(p.grad) for n, p in model.named_parameters()}
        grad_types = {type(p.grad).__name__ for p in model.parameters() if p.grad is not None}
        opt.step()
    return {
        "block_forward_calls": calls[0],
        "grad_types": sorted(grad_types),
        "losses": losses,
        "grads": grads,
        "params": {_plain_name(n): _full(p) for n, p in model.named_parameters()},
        "buffers": {_plain_name(n): _full(b) for n, b in model.named_buffers()},
    }


def _ddp_case(flags: dict[str, Any], x: torch.Tensor, rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    unused = bool(flags.get("find_unused_parameters"))
    runs = {}
    for run, noisy, with_forget in [
        ("plain", True, False),
        ("forget", True, True),
        ("forget-clean", False, True),  # for the single-process comparison
    ]:
        model = _model(noisy=noisy, unused=unused, with_forget=with_forget)
        runs[run] = _train(DDP(model, **flags), x, rank)
    return runs


def _fsdp2_case(x: torch.Tensor, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    runs = {}
    for run, noisy, with_forget in [
        ("plain", True, False),
        ("forget", True, True),
        ("forget-clean", False, True),
    ]:
        model = _model(noisy=noisy, with_forget=with_forget)
        # Shard each block (the Forget wrapper when there is one), then the root.
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runs[run] = _train(model, x, rank)
    return runs


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    x = _batch()[rank * BATCH : (rank + 1) * BATCH]
    results: dict[str, Any] = {}
    try:
        for case in CASES:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if case == "fsdp2":
                        runs = _fsdp2_case(x, rank)
                    else:
                        runs = _ddp_case(DDP_CASES[case], x, rank)
                    results[case] = {"runs": runs}
                except Exception:
                    results[case] = {"error": traceback.format_exc()}
            results[case]["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
            dist.barrier()
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("distributed")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        mp.start_processes(
            _worker,
            args=(WORLD_SIZE, _free_port(), str(out)),
            nprocs=WORLD_SIZE,
            join=True,
            start_method="spawn",
        )
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def _runs(results: list[dict[str, Any]], case: str, rank: int) -> dict[str, Any]:
    got = results[rank][case]
    assert "error" not in got, f"rank {rank}, {case}:\n{got['error']}"
    assert got["warnings"] == [], f"rank {rank}, {case}"
    return got["runs"]


def _assert_equal(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert list(a) == list(b), what
    for name in a:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, f"{what} {name}"
        else:
            assert torch.equal(a[name], b[name]), f"{what} {name}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rank", range(WORLD_SIZE), ids=lambda r: f"rank{r}")
def test_forget_equals_the_same_distributed_run_without_it(results, case, rank):
    runs = _runs(results, case, rank)
    plain, forgot = runs["plain"], runs["forget"]
    assert plain["block_forward_calls"] == STEPS
    assert forgot["block_forward_calls"] == 2 * STEPS  # forward, and again in backward
    assert plain["grad_types"] == forgot["grad_types"]
    assert forgot["grad_types"] == (["DTensor"] if case == "fsdp2" else ["Tensor"])
    for step, (a, b) in enumerate(zip(plain["losses"], forgot["losses"], strict=True)):
        assert torch.equal(a, b), f"rank {rank}, {case}, loss of step {step}: {a} != {b}"
    for part in ("grads", "params", "buffers"):
        _assert_equal(plain[part], forgot[part], f"rank {rank}, {case}, {part}")
    if case == "ddp-find-unused":
        assert forgot["grads"]["layers.0.unused.weight"] is None
    assert int(forgot["buffers"]["layers.0.body.1.num_batches_tracked"]) == STEPS


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # Measured on CPU: at most 3e-8 apart (a few ulps of values near 0.1-0.5).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _single_process(unused: bool) -> dict[str, Any]:
    return _train(_model(noisy=False, unused=unused), _batch(), rank=0)


@pytest.mark.parametrize("case", CASES)
def test_distributed_gradients_match_one_process_on_the_whole_batch(results, case):
    reference = _single_process(unused=case == "ddp-find-unused")
    ranks = [_runs(results, case, rank)["forget-clean"] for rank in range(WORLD_SIZE)]
    # Gradients are averaged over ranks: every rank holds the same ones.
    _assert_equal(ranks[0]["grads"], ranks[1]["grads"], f"{case}, grads across ranks")
    for rank, got in enumerate(ranks):
        for name, want in reference["grads"].items():
            if want is None:
                assert got["grads"][name] is None, name
            else:
                _assert_close(got["grads"][name], want, f"{case}, rank {rank}, grad {name}")
        for name, want in reference["params"].items():
            _assert_close(got["params"][name], want, f"{case}, rank {rank}, param {name}")
    # Each rank's loss is the mean over its half; the mean of the halves is the whole mean.
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in ranks) / WORLD_SIZE
        torch.testing.assert_close(mean, reference["losses"][step], rtol=1e-6, atol=0.0)
