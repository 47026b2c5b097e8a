"""Schedules as trees of `Keep` and `Region`, their op sequences, and the memory model.

A schedule for a chain of ``L`` stages is a sequence of items covering stages
``0 .. L-1`` in order. `Keep(i)` runs stage ``i`` with grad and stores its
history; `Region(items)` is a forget region over a contiguous range ``[s, t)``:
the forward runs it without grad and keeps only its input ``x_s``; when the
backward reaches it, the region re-runs once from ``x_s`` with its own items
applied (so nested regions give multi-level schedules), then back-propagates
through them. This is how the persistent schedules of Beaumont,
Eyraud-Dubois, Herrmann, Joly and Shilova (2019), "Optimal checkpointing for
heterogeneous chains: how to train deep neural networks with limited memory",
map onto nested ``forget`` calls in eager PyTorch.

Op sequence (Rotor's notation): ``F_all(i)`` forward with grad, history kept;
``F_ck(i)`` forward without grad, input kept (a region's first stage);
``F_n(i)`` forward without grad, input freed (the rest of a region);
``Loss`` the turn from forward to backward; ``B(i)`` backward of stage ``i``.

Memory model (every figure a sum of exact byte counts). Activations
``x_0 .. x_L`` have ``a_i`` bytes (``a_i`` = stage ``i``'s ``input_bytes``,
``a_L`` = the last ``output_bytes``); the gradient ``δ_i`` of ``x_i`` has
``a_i`` bytes too; ``h_i`` is stage ``i``'s history (``saved_bytes``, or the
chosen option's). Buffers are alive from the op that writes them to the op
that frees them:

* ``x_0`` is alive throughout (the caller's input).
* ``F_all(i)`` needs ``x_i``, writes ``x_{i+1}`` and ``h_i``; its peak is what
  is alive plus ``x_{i+1}`` (unless already alive, as when a region's last
  stage is re-run) plus ``h_i`` plus ``forward_overhead_bytes``.
* ``F_ck(i)`` and ``F_n(i)`` need ``x_i`` and write ``x_{i+1}`` (peak: alive +
  ``x_{i+1}`` + ``forward_overhead_bytes``); ``F_n`` then frees ``x_i``.
* ``Loss`` writes ``δ_L`` (peak: alive + ``a_L``); ``x_L`` stays alive.
* ``B(i)`` needs ``δ_{i+1}``, ``x_i``, ``x_{i+1}`` and ``h_i``, writes ``δ_i``
  (peak: alive + ``a_i`` + ``backward_overhead_bytes`` + the option's
  ``backward_overhead_bytes``), then frees ``δ_{i+1}``, ``h_i`` and
  ``x_{i+1}``. So a stage's output is alive until its own backward, as in
  Rotor where the stored ``x̄_i`` includes the output: a stage that saves its
  output for backward is then modelled exactly, and one that does not is
  modelled conservatively.
* NOTE [parameter gradients]: ``B(i)`` also writes the gradients of stage
  ``i``'s parameters, ``g_i`` bytes (``param_grad_bytes``; peak: + ``g_i``),
  which stay alive to the end of the step. So memory grows as backward
  proceeds, and a region re-run late in backward (near the chain's start)
  runs beside the parameter gradients of every stage after it. Left out, a
  re-run's peak read megabytes low on the reference models (4.0 MB of a
  9.6 MB peak on the GPT), the more the earlier its region.
* Peak = the maximum over all ops; the step ends with ``x_0``, ``δ_0`` and
  every ``g_i`` alive.

Time = the sum of op times: ``forward_s`` per ``F_all``, ``forward_nograd_s`` per
``F_ck``/``F_n``, ``backward_s`` (+ the option's ``recompute_s``) per ``B``, and
the chain's ``region_overhead_s`` once per region (per ``F_ck``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._chain import Chain

__all__ = [
    "Item",
    "Keep",
    "Op",
    "Region",
    "Schedule",
    "StageDecision",
    "evaluate",
    "simulate",
]


@dataclass(frozen=True)
class Keep:
    """Run one stage with grad and store its history (or the named option's part).

    Attributes:
        stage_index: the stage, counted from 0.
        option: a `StageOption` name of that stage, or ``None`` for the full keep.
    """

    stage_index: int
    option: str | None = None

    @property
    def start(self) -> int:
        """First stage covered."""
        return self.stage_index

    @property
    def stop(self) -> int:
        """One past the last stage covered."""
        return self.stage_index + 1


@dataclass(frozen=True)
class Region:
    """Forget a contiguous range of stages in forward; re-run it once in backward.

    Attributes:
        items: what applies inside the re-run (``Keep`` and nested ``Region``
            items covering the range in order).
    """

    items: tuple[Item, ...]

    def __post_init__(self) -> None:
        items = tuple(self.items)
        if not items:
            raise ValueError("forget: a Region needs at least one item, got none")
        _check_contiguous(items, items[0].start)
        object.__setattr__(self, "items", items)

    @property
    def start(self) -> int:
        """First stage covered."""
        return self.items[0].start

    @property
    def stop(self) -> int:
        """One past the last stage covered."""
        return self.items[-1].stop


Item: TypeAlias = Keep | Region


def _check_contiguous(items: Sequence[Item], start: int) -> None:
    position = start
    for item in items:
        if not isinstance(item, Keep | Region):
            raise TypeError(
                f"forget: schedule items must be Keep or Region, got {type(item).__name__}"
            )
        if isinstance(item, Keep) and (
            isinstance(item.stage_index, bool) or not isinstance(item.stage_index, int)
        ):
            raise TypeError(
                f"forget: Keep.stage_index must be an int, got {type(item.stage_index).__name__}"
            )
        if item.start != position:
            raise ValueError(
                f"forget: schedule items must cover consecutive stages; expected an item "
                f"starting at stage {position}, got one starting at stage {item.start}"
            )
        position = item.stop


@dataclass(frozen=True)
class Op:
    """One operation of the op sequence, in Rotor's notation.

    Attributes:
        kind: ``"F_all"``, ``"F_ck"``, ``"F_n"``, ``"Loss"`` or ``"B"``.
        stage_index: the stage (for ``Loss``, the number of stages ``L``).
        option: the option used by ``F_all``/``B``, else ``None``.
    """

    kind: str
    stage_index: int
    option: str | None = None

    def __str__(self) -> str:
        if self.kind == "Loss":
            return "Loss"
        suffix = f", {self.option}" if self.option is not None else ""
        return f"{self.kind}({self.stage_index}{suffix})"


@dataclass(frozen=True)
class StageDecision:
    """What a schedule does with one stage.

    Attributes:
        stage_index: the stage.
        depth: how many forget regions enclose the stage (0: never forgotten).
        option: the option used where the stage is finally run with grad.
        decision: ``"forgotten"`` when ``depth > 0``, else the option's name,
            else ``"kept"``.
    """

    stage_index: int
    depth: int
    option: str | None
    decision: str


def _forward_ops(items: Sequence[Item]) -> Iterator[Op]:
    for item in items:
        if isinstance(item, Keep):
            yield Op("F_all", item.stage_index, item.option)
        else:
            yield Op("F_ck", item.start)
            for i in range(item.start + 1, item.stop):
                yield Op("F_n", i)


def _backward_ops(items: Sequence[Item]) -> Iterator[Op]:
    for item in reversed(items):
        if isinstance(item, Keep):
            yield Op("B", item.stage_index, item.option)
        else:
            yield from _forward_ops(item.items)
            yield from _backward_ops(item.items)


def _walk(items: Sequence[Item], depth: int) -> Iterator[tuple[Keep, int]]:
    for item in items:
        if isinstance(item, Keep):
            yield item, depth
        else:
            yield from _walk(item.items, depth + 1)


def _item_to_obj(item: Item) -> dict[str, Any]:
    if isinstance(item, Keep):
        return {"keep": item.stage_index, "option": item.option}
    return {"region": [_item_to_obj(i) for i in item.items]}


def _item_from_obj(obj: object) -> Item:
    if isinstance(obj, Mapping):
        if "keep" in obj:
            index, option = obj["keep"], obj.get("option")
            index_ok = isinstance(index, int) and not isinstance(index, bool)
            if index_ok and (option is None or isinstance(option, str)):
                return Keep(index, option)
        elif "region" in obj and isinstance(obj["region"], list):
            return Region(tuple(_item_from_obj(i) for i in obj["region"]))
    raise ValueError(
        "forget: a schedule item must be {'keep': int, 'option': str | None} or "
        f"{{'region': [items]}}, got {obj!r}"
    )


@dataclass(frozen=True)
class Schedule:
    """Hold a schedule for a chain and what the memory model predicts for it.

    Attributes:
        items: top-level items covering every stage in order.
        num_stages: the chain's number of stages ``L``.
        predicted_peak_bytes: peak memory of one step (see the module docstring).
        predicted_time_s: forward + recomputation + backward time of one step.
        predicted_overhead_s: ``predicted_time_s`` minus the store-all time.
        algorithm: the name of the algorithm that produced it.
        budget_bytes: the budget it was planned for, if any.
    """

    items: tuple[Item, ...]
    num_stages: int
    predicted_peak_bytes: int
    predicted_time_s: float
    predicted_overhead_s: float
    algorithm: str = "custom"
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        items = tuple(self.items)
        _check_contiguous(items, 0)
        if not items or items[-1].stop != self.num_stages:
            raise ValueError(
                f"forget: a schedule must cover stages 0..{self.num_stages - 1}, got items "
                f"ending at stage {items[-1].stop - 1 if items else -1}"
            )
        object.__setattr__(self, "items", items)

    @classmethod
    def from_items(
        cls,
        chain: Chain,
        items: Sequence[Item],
        *,
        algorithm: str = "custom",
        budget_bytes: int | None = None,
    ) -> Schedule:
        """Build a schedule for ``chain`` and fill in its predictions from the model.

        Args:
            chain: the chain the items refer to.
            items: top-level `Keep` / `Region` items covering every stage.
            algorithm: a label for reports.
            budget_bytes: the budget it was planned for, if any.

        Returns:
            The schedule, with peak and time from `evaluate`.
        """
        items = tuple(items)
        _check_contiguous(items, 0)
        peak_bytes, time_s = evaluate(chain, items)
        return cls(
            items=items,
            num_stages=len(chain),
            predicted_peak_bytes=peak_bytes,
            predicted_time_s=time_s,
            predicted_overhead_s=time_s - chain.store_all_time_s,
            algorithm=algorithm,
            budget_bytes=budget_bytes,
        )

    def stage_decisions(self) -> tuple[StageDecision, ...]:
        """Return, per stage, whether it is kept, forgotten or partly kept, and its depth."""
        out = []
        for keep, depth in _walk(self.items, 0):
            if depth > 0:
                decision = "forgotten"
            else:
                decision = keep.option if keep.option is not None else "kept"
            out.append(StageDecision(keep.stage_index, depth, keep.option, decision))
        return tuple(out)

    def ops(self) -> tuple[Op, ...]:
        """Return the op sequence of one training step (forward, ``Loss``, backward)."""
        return (
            *_forward_ops(self.items),
            Op("Loss", self.num_stages),
            *_backward_ops(self.items),
        )

    def __str__(self) -> str:
        def show(items: Sequence[Item]) -> str:
            parts = []
            for item in items:
                if isinstance(item, Keep):
                    opt = f"[{item.option}]" if item.option is not None else ""
                    parts.append(f"{item.stage_index}{opt}")
                else:
                    parts.append(f"({show(item.items)})")
            return " ".join(parts)

        return (
            f"Schedule[{self.algorithm}] {show(self.items)}: peak {self.predicted_peak_bytes} B, "
            f"time {self.predicted_time_s:.6g} s (+{self.predicted_overhead_s:.6g} s)"
        )

    def to_dict(self) -> dict[str, Any]:
        """Return a plain-dict form (JSON-ready) that `from_dict` reads back."""
        return {
            "version": 1,
            "algorithm": self.algorithm,
            "num_stages": self.num_stages,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time_s": self.predicted_time_s,
            "predicted_overhead_s": self.predicted_overhead_s,
            "items": [_item_to_obj(i) for i in self.items],
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Schedule:
        """Rebuild a schedule from `to_dict`'s output.

        Raises:
            ValueError: a missing field or a malformed item.
        """
        try:
            version = obj["version"]
            if version != 1:
                raise ValueError(f"forget: unknown schedule format version {version!r}")
            budget = obj["budget_bytes"]
            return cls(
                items=tuple(_item_from_obj(i) for i in obj["items"]),
                num_stages=int(obj["num_stages"]),
                predicted_peak_bytes=int(obj["predicted_peak_bytes"]),
                predicted_time_s=float(obj["predicted_time_s"]),
                predicted_overhead_s=float(obj["predicted_overhead_s"]),
                algorithm=str(obj["algorithm"]),
                budget_bytes=None if budget is None else int(budget),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"forget: not a schedule dict ({exc!r}); use Schedule.to_dict"
            ) from exc

    def to_json(self) -> str:
        """Return `to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Rebuild a schedule from `to_json`'s output."""
        return cls.from_dict(json.loads(text))


def _option_figures(chain: Chain, keep: Keep) -> tuple[int, float, int]:
    """Return (history bytes, extra backward s, extra backward overhead bytes)."""
    stage = chain.stages[keep.stage_index]
    option = stage.option(keep.option)
    if option is None:
        return stage.saved_bytes, 0.0, 0
    return option.saved_bytes, option.recompute_s, option.backward_overhead_bytes


def simulate(chain: Chain, schedule: Schedule | Sequence[Item]) -> tuple[int, float]:
    """Execute a schedule's op sequence in the memory model and measure it.

    This is the reference the planners are tested against: it tracks every
    buffer (``x_i``, ``h_i``, ``δ_i``) op by op, as the module docstring says.

    Args:
        chain: the chain.
        schedule: a `Schedule`, or top-level items.

    Returns:
        ``(peak_bytes, time_s)`` of one training step.

    Raises:
        ValueError: the schedule does not match the chain, or an op needs a
            buffer that is not alive.
    """
    if isinstance(schedule, Schedule):
        ops = schedule.ops()
        if schedule.num_stages != len(chain):
            raise ValueError(
                f"forget: the schedule has {schedule.num_stages} stages but the chain has "
                f"{len(chain)}"
            )
    else:
        items = tuple(schedule)
        ops = Schedule(items, len(chain), 0, 0.0, 0.0).ops()
    a = chain.activation_bytes
    live: dict[tuple[str, int], int] = {("x", 0): a[0]}
    used = a[0]
    peak = used
    time_s = 0.0

    def need(*keys: tuple[str, int]) -> None:
        for key in keys:
            if key not in live:
                raise ValueError(f"forget: {op} needs {key[0]}_{key[1]}, which is not alive")

    for op in ops:
        i = op.stage_index
        if op.kind == "Loss":
            need(("x", i))
            live[("d", i)] = a[i]
            used += a[i]
            peak = max(peak, used)
            continue
        stage = chain.stages[i]
        if op.kind in ("F_all", "F_ck", "F_n"):
            need(("x", i))
            new = 0 if ("x", i + 1) in live else a[i + 1]
            live[("x", i + 1)] = a[i + 1]
            if op.kind == "F_all":
                saved, _, _ = _option_figures(chain, Keep(i, op.option))
                peak = max(peak, used + new + saved + stage.forward_overhead_bytes)
                live[("h", i)] = saved
                used += new + saved
                time_s += stage.forward_s
            else:
                peak = max(peak, used + new + stage.forward_overhead_bytes)
                used += new
                time_s += stage.forward_nograd_s
                if op.kind == "F_ck":  # a region starts: its fixed cost, once
                    time_s += chain.region_overhead_s
                if op.kind == "F_n":
                    used -= live.pop(("x", i))
        elif op.kind == "B":
            need(("d", i + 1), ("x", i), ("x", i + 1), ("h", i))
            _, extra_s, extra_bytes = _option_figures(chain, Keep(i, op.option))
            g = stage.param_grad_bytes  # NOTE [parameter gradients]
            peak = max(peak, used + a[i] + g + stage.backward_overhead_bytes + extra_bytes)
            live[("d", i)] = a[i]
            live[("g", i)] = g
            used += a[i] + g
            for key in (("d", i + 1), ("h", i), ("x", i + 1)):
                used -= live.pop(key)
            time_s += stage.backward_s + extra_s
        else:  # pragma: no cover - Op kinds come from this module
            raise ValueError(f"forget: unknown op {op}")
    if set(live) != {("x", 0), ("d", 0), *(("g", i) for i in range(len(chain)))}:
        raise ValueError(f"forget: buffers left alive after the step: {sorted(live)}")
    return peak, time_s


def _fwd_region_peak(a: Sequence[int], fo: Sequence[int], s: int, k: int, live_k: bool) -> int:
    """Peak (above the context) of the no-grad pass over [s, k); x_k alive already if live_k."""
    peak = 0
    for j in range(s, k):
        current = a[j] if j > s else 0
        new = 0 if (live_k and j + 1 == k) else a[j + 1]
        peak = max(peak, a[s] + current + new + fo[j])
    return peak


def evaluate(chain: Chain, items: Sequence[Item]) -> tuple[int, float]:
    """Compute a schedule's peak and time with the recurrences the optimal DP uses.

    Independent of `simulate` (which runs the op sequence); the two agree by
    construction of the memory model, and the tests check that they do.

    Args:
        chain: the chain.
        items: top-level items.

    Returns:
        ``(peak_bytes, time_s)``.
    """
    a = chain.activation_bytes
    fo = [s.forward_overhead_bytes for s in chain.stages]
    n = len(chain)
    pg = chain.param_grad_prefix  # NOTE [parameter gradients]
    g = [s.param_grad_bytes for s in chain.stages]

    def keep_figures(keep: Keep) -> tuple[int, float, int]:
        stage = chain.stages[keep.stage_index]
        saved, extra_s, extra_bytes = _option_figures(chain, keep)
        return (
            saved,
            stage.forward_s + stage.backward_s + extra_s,
            (stage.backward_overhead_bytes + extra_bytes),
        )

    def inner(items: Sequence[Item], t: int) -> tuple[int, float]:
        # Context: x_s, x_t and δ_t alive (the re-run of a region ending at t).
        head, rest = items[0], items[1:]
        s = head.start
        if isinstance(head, Keep):
            saved, time_s, bo = keep_figures(head)
            if not rest:
                return a[s] + 2 * a[t] + saved + max(fo[s], a[s] + bo + g[s]), time_s
            rest_peak, rest_s = inner(rest, t)
            peak = max(
                a[s] + a[s + 1] + saved + fo[s] + 2 * a[t],
                a[s] + saved + rest_peak,
                2 * a[s] + 2 * a[s + 1] + saved + bo + pg[t] - pg[s],
            )
            return peak, time_s + rest_s
        k = head.stop
        nograd_s = chain.region_overhead_s + sum(
            chain.stages[j].forward_nograd_s for j in range(s, k)
        )
        sub_peak, sub_s = inner(head.items, k)
        if not rest:
            return max(_fwd_region_peak(a, fo, s, k, True) + 2 * a[t], sub_peak), nograd_s + sub_s
        rest_peak, rest_s = inner(rest, t)
        peak = max(
            _fwd_region_peak(a, fo, s, k, False) + 2 * a[t],
            a[s] + rest_peak,
            sub_peak + pg[t] - pg[k],
        )
        return peak, nograd_s + rest_s + sub_s

    def top(items: Sequence[Item]) -> tuple[int, float]:
        # Context: x_s alive; x_L and δ_L not yet written.
        head, rest = items[0], items[1:]
        s = head.start
        if isinstance(head, Keep):
            saved, time_s, bo = keep_figures(head)
            if not rest:
                return a[s] + a[n] + saved + max(fo[s], a[n] + a[s] + bo + g[s]), time_s
            rest_peak, rest_s = top(rest)
            peak = max(
                a[s] + a[s + 1] + saved + fo[s],
                a[s] + saved + rest_peak,
                2 * a[s] + 2 * a[s + 1] + saved + bo + pg[n] - pg[s],
            )
            return peak, time_s + rest_s
        k = head.stop
        nograd_s = chain.region_overhead_s + sum(
            chain.stages[j].forward_nograd_s for j in range(s, k)
        )
        sub_peak, sub_s = inner(head.items, k)
        fwd = _fwd_region_peak(a, fo, s, k, False)
        if not rest:
            # The Loss peak a_s + 2 a_L is below the re-run's, whose context holds it.
            return max(fwd, sub_peak), nograd_s + sub_s
        rest_peak, rest_s = top(rest)
        return max(fwd, a[s] + rest_peak, sub_peak + pg[n] - pg[k]), nograd_s + rest_s + sub_s

    items = tuple(items)
    if not items or items[-1].stop != n:
        raise ValueError(f"forget: a schedule must cover stages 0..{n - 1}")
    for keep, depth in _walk(items, 0):
        if keep.stage_index >= n:
            raise ValueError(f"forget: stage {keep.stage_index} is outside the {n}-stage chain")
        if keep.option is not None and depth:
            option = chain.stages[keep.stage_index].option(keep.option)
            if option is not None and not option.in_regions:
                raise ValueError(
                    f"forget: stage {keep.stage_index} runs option {keep.option!r} inside a "
                    "region; this option applies to stages kept at the top level only "
                    "(NOTE [options at the top level]; an option with in_regions=True may "
                    "run inside one)"
                )
    return top(items)
