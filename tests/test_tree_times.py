"""Candidates' forward times from whole forwards (NOTE [forwards timed whole]).

The clock is a counter that moves one tick per read, so a module's span is known
exactly: a hook reads it before and after each call, so a module with ``k``
timed modules inside spans ``2k + 1`` ticks. Only the innermost kinds of module
are captured and run alone (their workspace and options).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from _tree_models import MODELS
from forget._planning import FixedClock, TreePlanner, WallClock, _clock
from forget._planning._tree import alone
from forget._planning._tree.step import TreeStep
from forget._regions import ROOT


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.one = _Pair()
        self.two = _Pair()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.two(self.one(x))).sum()


@pytest.fixture
def ticks(monkeypatch):
    counter = itertools.count()
    monkeypatch.setattr(_clock.time, "perf_counter", lambda: float(next(counter)))
    return WallClock()


def test_each_candidate_spans_what_runs_inside_it(ticks):
    model = _Net()
    step = TreeStep(model, (torch.randn(3, 4),), {}, None)
    names = ["one", "one.a", "one.b", "two", "two.a", "two.b", "head"]
    rep_of = {name: name for name in names}
    times = alone.forward_times(step, names, rep_of, 3, ticks)
    assert times == {
        "one": 5.0,
        "one.a": 1.0,
        "one.b": 1.0,
        "two": 5.0,
        "two.a": 1.0,
        "two.b": 1.0,
        "head": 1.0,
    }
    # Only the modules named are timed: without the inner ones, a pair spans one tick.
    assert alone.forward_times(step, ["one", "two"], {"one": "one", "two": "one"}, 1, ticks) == {
        "one": 1.0,
        "two": 1.0,
    }


def test_alike_modules_share_the_median_of_their_times(monkeypatch):
    # NOTE [alike stages]: "two" is alike to "one"; each forward times them 1 and 3.
    model = _Net()
    step = TreeStep(model, (torch.randn(3, 4),), {}, None)
    rounds = iter([{"one": 1.0, "two": 3.0}, {"one": 2.0, "two": 8.0}, {"one": 1.5, "two": 3.0}])
    clock = FixedClock()
    monkeypatch.setattr(clock, "spans", lambda fn, modules, sync: next(rounds))
    times = alone.forward_times(step, ["one", "two"], {"one": "one", "two": "one"}, 3, clock)
    assert times == {"one": 2.5, "two": 2.5}  # the median of 1, 3, 2, 8, 1.5 and 3


def test_forwards_run_without_grad_and_the_profile_leaves_the_model_as_it_was(ticks):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    seen = []
    model[1].register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    x = torch.randn(5, 4)
    step = TreeStep(model, (x,), {}, lambda out: out.sum())
    names = ["0", "1", "2"]
    times = alone.forward_times(step, names, {n: n for n in names}, 2, ticks)
    assert times == dict.fromkeys(names, 1.0)
    assert seen == [False, False]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    TreePlanner(model, (x,), loss_fn=lambda out: out.sum(), repeats=2, clock=ticks)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_only_the_innermost_kinds_are_captured(monkeypatch):
    captured = []
    original = alone._capture

    def counted(step, names, layouts):
        captured.extend(names)
        return original(step, names, layouts)

    monkeypatch.setattr(alone, "_capture", counted)
    model, inputs = MODELS["resnet"]()
    planner = TreePlanner(model, (), inputs, repeats=1, clock=FixedClock())
    nodes = [n for n in _nodes(planner.tree.root) if n.name != ROOT]
    inner = [n.name for n in nodes if not n.children]
    outer = [n.name for n in nodes if n.children]
    assert captured and outer
    assert set(captured) <= set(inner)
    assert not set(captured) & set(outer)


def _nodes(node):
    yield node
    for child in node.children:
        yield from _nodes(child)
