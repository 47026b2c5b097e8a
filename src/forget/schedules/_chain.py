"""The input of the planner: a chain of stages described by plain numbers."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["Chain", "Stage", "StageOption"]

_INT_FIELDS = (
    "input_bytes",
    "output_bytes",
    "saved_bytes",
    "forward_overhead_bytes",
    "backward_overhead_bytes",
    "param_grad_bytes",
)
_TIME_FIELDS = ("forward_s", "forward_nograd_s", "backward_s")


def _check_bytes(owner: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"forget: {owner}.{field} must be an int number of bytes, got "
            f"{type(value).__name__} {value!r}; byte counts are exact integers"
        )
    if value < 0:
        raise ValueError(
            f"forget: {owner}.{field} must be >= 0 bytes, got {value}; "
            "a memory size cannot be negative"
        )
    return int(value)


def _check_seconds(owner: str, field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"forget: {owner}.{field} must be a real number of seconds, got "
            f"{type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(
            f"forget: {owner}.{field} must be a finite time >= 0 seconds, got {value!r}"
        )
    return seconds


@dataclass(frozen=True)
class StageOption:
    """Describe a partial keep of a stage: save part of its history, rebuild the rest.

    An option sits between keeping a stage's whole history and forgetting the
    stage: the forward runs with grad but saves only ``saved_bytes`` (for
    example only the matmul outputs), and the backward first re-runs the cheap
    part it dropped. All that the option adds to the step's time (the re-run,
    and any bookkeeping its forward does) is ``recompute_s``; it also needs a
    temporary ``backward_overhead_bytes`` on top of the stage's own backward
    overhead.

    NOTE [options in regions]: an option whose forward keeps nothing that a
    plain forward would not (``regenerate``: it only drops saved tensors, and
    rebuilds them in backward) may also run for a stage kept inside a
    forgotten region. There the region's first forward keeps nothing anyway,
    and its re-run keeps ``saved_bytes`` for the stage instead of
    `Stage.saved_bytes`, at the same extra time. Such an option says so with
    ``in_regions``; the planners place the others at the top level only.

    Attributes:
        name: a label, unique within its stage (not ``"kept"`` or ``"forgotten"``).
        saved_bytes: history kept for backward, in place of `Stage.saved_bytes`.
        recompute_s: extra step time of the option over keeping the stage whole.
        backward_overhead_bytes: extra temporary bytes while rebuilding in backward.
        in_regions: the option may run for a stage kept inside a forgotten
            region, in the region's re-run; ``False`` by default.
    """

    name: str
    saved_bytes: int
    recompute_s: float
    backward_overhead_bytes: int = 0
    in_regions: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"forget: StageOption.name must be a non-empty str, got {self.name!r}")
        if self.name in ("kept", "forgotten"):
            raise ValueError(
                f"forget: StageOption.name {self.name!r} is reserved for stage decisions; "
                "pick another name"
            )
        owner = f"StageOption {self.name!r}"
        saved = _check_bytes(owner, "saved_bytes", self.saved_bytes)
        object.__setattr__(self, "saved_bytes", saved)
        object.__setattr__(
            self,
            "backward_overhead_bytes",
            _check_bytes(owner, "backward_overhead_bytes", self.backward_overhead_bytes),
        )
        object.__setattr__(
            self, "recompute_s", _check_seconds(owner, "recompute_s", self.recompute_s)
        )
        if not isinstance(self.in_regions, bool):
            raise TypeError(
                f"forget: {owner}.in_regions must be a bool, got "
                f"{type(self.in_regions).__name__} {self.in_regions!r}"
            )


@dataclass(frozen=True)
class Stage:
    """Describe one stage of a chain: its times and the sizes it holds.

    Stage ``i`` reads activation ``x_i`` (``input_bytes``) and writes ``x_{i+1}``
    (``output_bytes``). Run with grad it also keeps ``saved_bytes`` of history
    for backward, not counting its input and output (the memory model keeps
    those alive anyway until the stage's backward). The overheads are
    temporary peaks while the forward (with or without grad) or the backward
    of the stage runs.

    Attributes:
        name: a label for reports.
        forward_s: forward time with grad (history recorded).
        forward_nograd_s: forward time without grad (inside a forget region).
        backward_s: backward time.
        input_bytes: size of the input activation ``x_i`` (and of its gradient).
        output_bytes: size of the output activation ``x_{i+1}`` (and of its gradient).
        saved_bytes: history kept for backward when run with grad.
        forward_overhead_bytes: temporary bytes during forward.
        backward_overhead_bytes: temporary bytes during backward.
        options: partial keeps the optimal planner may choose instead of a full keep.
        param_grad_bytes: gradients of the stage's parameters, written by its
            backward and alive to the end of the step (NOTE [parameter
            gradients] in `forget.schedules._schedule`); 0 by default.
    """

    name: str
    forward_s: float
    forward_nograd_s: float
    backward_s: float
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    forward_overhead_bytes: int = 0
    backward_overhead_bytes: int = 0
    options: tuple[StageOption, ...] = ()
    param_grad_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"forget: Stage.name must be a str, got {type(self.name).__name__}")
        owner = f"Stage {self.name!r}"
        for field in _INT_FIELDS:
            object.__setattr__(self, field, _check_bytes(owner, field, getattr(self, field)))
        for field in _TIME_FIELDS:
            object.__setattr__(self, field, _check_seconds(owner, field, getattr(self, field)))
        options = tuple(self.options)
        names: set[str] = set()
        for option in options:
            if not isinstance(option, StageOption):
                raise TypeError(
                    f"forget: {owner}.options must hold StageOption values, got "
                    f"{type(option).__name__}"
                )
            if option.name in names:
                raise ValueError(
                    f"forget: {owner} has two options named {option.name!r}; "
                    "option names must be unique within a stage"
                )
            names.add(option.name)
        object.__setattr__(self, "options", options)

    def option(self, name: str | None) -> StageOption | None:
        """Return the option called ``name`` (``None`` means the full keep).

        Raises:
            ValueError: the stage has no option of that name.
        """
        if name is None:
            return None
        for option in self.options:
            if option.name == name:
                return option
        valid = ", ".join(repr(o.name) for o in self.options) or "none"
        raise ValueError(
            f"forget: stage {self.name!r} has no option {name!r}; its options are: {valid}"
        )


@dataclass(frozen=True)
class Chain:
    """Hold a sequence of stages where each stage feeds the next.

    Stage ``i``'s ``output_bytes`` must equal stage ``i+1``'s ``input_bytes``:
    both describe the same tensor ``x_{i+1}``, so a mismatch is a profiling
    error and raises instead of being silently resolved.

    Attributes:
        stages: the stages, in forward order (at least one).
        region_overhead_s: fixed time every region costs besides its stages'
            forward times (setting up the region, its recomputation, its
            bookkeeping), added once per region; 0 by default.

    Raises:
        ValueError: empty chain, or mismatched sizes between neighbours.
    """

    stages: tuple[Stage, ...]
    region_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "region_overhead_s",
            _check_seconds("Chain", "region_overhead_s", self.region_overhead_s),
        )
        stages = tuple(self.stages)
        if not stages:
            raise ValueError("forget: a Chain needs at least one stage, got none")
        for stage in stages:
            if not isinstance(stage, Stage):
                raise TypeError(
                    f"forget: Chain.stages must hold Stage values, got {type(stage).__name__}"
                )
        for i in range(len(stages) - 1):
            out, nxt = stages[i].output_bytes, stages[i + 1].input_bytes
            if out != nxt:
                raise ValueError(
                    f"forget: stage {i} ({stages[i].name!r}) writes output_bytes={out} but "
                    f"stage {i + 1} ({stages[i + 1].name!r}) reads input_bytes={nxt}; "
                    "both describe the same activation, so they must be equal"
                )
        object.__setattr__(self, "stages", stages)

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def activation_bytes(self) -> tuple[int, ...]:
        """Sizes of ``x_0 .. x_L`` (the chain input, the stage outputs), in bytes."""
        return (self.stages[0].input_bytes, *(s.output_bytes for s in self.stages))

    @property
    def param_grad_prefix(self) -> tuple[int, ...]:
        """``P[i]``: bytes of parameter gradients of stages ``0 .. i-1`` (``P[0] = 0``)."""
        out = [0]
        for stage in self.stages:
            out.append(out[-1] + stage.param_grad_bytes)
        return tuple(out)

    @property
    def store_all_time_s(self) -> float:
        """Time of a plain step (every stage forward with grad, then backward)."""
        return sum(s.forward_s + s.backward_s for s in self.stages)
