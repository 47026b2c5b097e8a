"""A `Plan`: a schedule over a chain of blocks, with its measured bytes and times."""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from ... import schedules as P
from ..._engine import InTurn, run_region
from ...policies import Policy
from ...schedules import format_bytes
from .._json import SavedAsJson
from .._targets import Block, _check_options, _group, is_chain_model, sub_stages
from .profile import _policy_region

# ---------------------------------------------------------------- applying


def run_items(
    items: Sequence[P.Keep | P.Region], blocks: Sequence[Block], policies: Mapping[str, Policy]
) -> InTurn:
    """A callable running schedule ``items`` over ``blocks`` (the body of one forget region).

    A kept stage runs as itself or under its option's policy; a region runs its
    own items as one forgotten region.
    """
    parts: list[Block] = []
    for item in items:
        if isinstance(item, P.Keep):
            block = blocks[item.stage_index]
            if item.option is None:
                parts.append(block)
            else:
                parts.append(_policy_region(block, policies[item.option]))
        else:
            body = run_items(item.items, blocks, policies)
            parts.append(functools.partial(_run_region_on, body))
    return InTurn(parts, f"plan_region[{items[0].start}:{items[-1].stop}]")


def _run_region_on(body: Block, h: Tensor) -> Tensor:
    out: Tensor = run_region(body, (h,), {})
    return out


class PlannedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose layers run as a `Plan` says (same names, same state_dict keys)."""

    def __init__(self, sequential: nn.Sequential, runner: Block) -> None:
        super().__init__(OrderedDict(sequential.named_children()))
        self._runner = runner

    def forward(self, x: Tensor) -> Tensor:
        """Run the layers under the plan's schedule."""
        return self._runner(x)


@dataclass(frozen=True)
class Plan(SavedAsJson):
    """A schedule for a chain of blocks that fits a memory budget, measured.

    Attributes:
        schedule: the planner's `forget.schedules.Schedule` (nested forget regions).
        chain: the profiled figures it was solved on.
        budget_bytes: the budget, in bytes.
        measured_peak_bytes: peak of the planned training step (`forget.measure`).
        predicted_peak_bytes: the planner's peak plus what lies outside its
            model (the plain step's measured peak minus its predicted peak).
        plain_peak_bytes: measured peak of the plain step.
        min_feasible_bytes: measured peak of the least-memory schedule: the
            smallest budget `plan` accepts for this model and input.
        option_names: the stage options the planner could choose from.
        block_stages: planned with ``split`` (NOTE [finer stages]): how many
            stages each block gave; ``None``: one stage per block.
        stage_parts: planned with ``split``: how many of the stages a block
            offers each planned stage runs in turn, where stages meeting at a
            cut no backward reads were joined (NOTE [dead cuts]); ``None``:
            one each.
    """

    schedule: P.Schedule
    chain: P.Chain
    budget_bytes: int
    measured_peak_bytes: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    min_feasible_bytes: int
    option_names: tuple[str, ...] = ()
    policies: Mapping[str, Policy] = field(default_factory=dict, compare=False, repr=False)
    block_stages: tuple[int, ...] | None = None
    stage_parts: tuple[int, ...] | None = None

    @property
    def predicted_overhead(self) -> float:
        """Predicted extra time of a step, as a fraction of the plain step's time."""
        return self.schedule.predicted_overhead_s / max(self.chain.store_all_time_s, 1e-12)

    def runner(self, blocks: Sequence[Block]) -> Block:
        """Return a callable running ``blocks`` (tensor -> tensor) under this plan.

        Raises:
            ValueError: not as many blocks as the plan has stages, or an option
                the plan uses has no policy (a loaded plan: pass ``options``);
                for a plan made with ``split``, not as many blocks as it was
                made for, or a block that now gives another number of stages.
        """
        blocks = list(blocks)
        if self.block_stages is not None:
            blocks = self._stages_of(blocks)
        if len(blocks) != self.schedule.num_stages:
            raise ValueError(
                f"forget: this plan is for {self.schedule.num_stages} blocks, got {len(blocks)}"
            )
        used = {d.option for d in self.schedule.stage_decisions() if d.option is not None}
        missing = sorted(used - set(self.policies))
        if missing:
            raise ValueError(
                f"forget: the plan uses the options {missing} but has no policy for them; "
                "load it with Plan.load(path, options={name: policy, ...})"
            )
        return run_items(self.schedule.items, blocks, self.policies)

    def _stages_of(self, blocks: list[Block]) -> list[Block]:
        """The blocks' stages, as the plan was made on them (NOTE [finer stages])."""
        sizes = self.block_stages
        assert sizes is not None
        if len(blocks) != len(sizes):
            raise ValueError(
                f"forget: this plan is for {len(sizes)} blocks split into "
                f"{self.schedule.num_stages} stages, got {len(blocks)} blocks"
            )
        parts = self.stage_parts or (1,) * sum(sizes)
        out: list[Block] = []
        start = 0
        for i, (block, size) in enumerate(zip(blocks, sizes, strict=True)):
            stages = [stage for _, stage in sub_stages(block) or [("", block)]]
            grouping = parts[start : start + size]
            start += size
            if len(stages) != sum(grouping):
                raise ValueError(
                    f"forget: block {i} gives {len(stages)} stages, but the plan was made "
                    f"when it gave {sum(grouping)}"
                )
            out += _group(stages, grouping)  # NOTE [dead cuts]
        return out

    def apply(self, model: Any) -> Any:
        """Make ``model`` run under this plan.

        Args:
            model: an ``nn.Sequential`` (returns a `PlannedSequential` with the
                same layers and state_dict keys), a reference model of
                `forget._cli._models` (sets its ``blocks_runner``; returns it), or a
                list / ``nn.ModuleList`` of blocks (returns a callable).
        """
        if is_chain_model(model):
            model.blocks_runner = self.runner(list(model.blocks))
            return model
        if isinstance(model, nn.Sequential):
            return PlannedSequential(model, self.runner(list(model)))
        if isinstance(model, Sequence | nn.ModuleList):
            return self.runner(list(model))
        raise TypeError(
            "forget: Plan.apply takes an nn.Sequential, a reference model or a list of "
            f"blocks, got {type(model).__name__}"
        )

    @property
    def layout(self) -> str:
        """The schedule over the stages, each forget region in brackets: ``(0 1) (2 (3)) 4``."""
        return _layout(self.schedule.items)

    def rows(self) -> list[dict[str, Any]]:
        """Per stage: name, region, decision, option, depth, kept bytes, expected recompute time.

        ``region`` names the forget regions around the stage, outermost first
        (``"R1"``, ``"R2.1"`` for the first region inside the second), ``None``
        for a stage no region holds; stages with the same region are forgotten,
        and re-run, together.
        """
        regions = _region_names(self.schedule.items)
        rows = []
        for d in self.schedule.stage_decisions():
            stage = self.chain.stages[d.stage_index]
            option = stage.option(d.option)
            saved = stage.saved_bytes if option is None else option.saved_bytes
            recompute = d.depth * stage.forward_nograd_s + (option.recompute_s if option else 0.0)
            rows.append(
                {
                    "stage": stage.name,
                    "region": regions.get(d.stage_index),
                    "decision": d.decision,
                    "option": d.option,
                    "depth": d.depth,
                    # A forgotten stage keeps nothing in the forward, under an option or not.
                    "saved_bytes": 0 if d.depth > 0 else saved,
                    "recompute_s": recompute,
                }
            )
        return rows

    def __str__(self) -> str:
        lines = [
            f"forget plan ({self.schedule.algorithm}): {self.schedule.num_stages} stages, "
            f"budget {format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B)",
            f"  {'stage':<14} {'region':<7} {'decision':<10} {'depth':>5} {'kept bytes':>14} "
            f"{'recompute':>11}",
        ]
        for row in self.rows():
            decision = row["decision"]
            if row["depth"] and row["option"] is not None:
                decision += f"[{row['option']}]"  # NOTE [options in regions]: in its re-run
            lines.append(
                f"  {row['stage']:<14} {row['region'] or '-':<7} {decision:<10} {row['depth']:>5} "
                f"{row['saved_bytes']:>14,} {row['recompute_s'] * 1e3:>9.3f}ms"
            )
        lines += [
            f"  regions: {self.layout}  (stage indices; a bracket is one forget region)",
            f"  peak: measured {self.measured_peak_bytes:,} B "
            f"({self.measured_peak_bytes / max(self.plain_peak_bytes, 1):.2f}x the plain "
            f"{self.plain_peak_bytes:,} B); predicted {self.predicted_peak_bytes:,} B",
            f"  time: predicted overhead +{100 * self.predicted_overhead:.1f} % of a plain step",
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (policies are saved by name only)."""
        return {
            "format": "forget.plan/1",
            "schedule": self.schedule.to_dict(),
            "chain": [dataclasses.asdict(s) for s in self.chain.stages],
            "region_overhead_s": self.chain.region_overhead_s,
            "budget_bytes": self.budget_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "plain_peak_bytes": self.plain_peak_bytes,
            "min_feasible_bytes": self.min_feasible_bytes,
            "option_names": list(self.option_names),
            "block_stages": None if self.block_stages is None else list(self.block_stages),
            "stage_parts": None if self.stage_parts is None else list(self.stage_parts),
        }

    @classmethod
    def from_dict(
        cls, obj: Mapping[str, Any], *, options: Mapping[str, Policy | bool] | None = None
    ) -> Plan:
        """Rebuild a plan from `to_dict`'s output; ``options`` gives the policies by name."""
        if not isinstance(obj, Mapping) or obj.get("format") != "forget.plan/1":
            raise ValueError("forget: not a saved forget plan (format 'forget.plan/1' expected)")
        stages = []
        for s in obj["chain"]:
            fields = dict(s)
            fields["options"] = tuple(P.StageOption(**o) for o in fields.get("options", ()))
            stages.append(P.Stage(**fields))
        sizes = obj.get("block_stages")
        if sizes is not None and sum(int(n) for n in sizes) != len(stages):
            raise ValueError(
                f"forget: the saved plan's block_stages {sizes} do not add up to its "
                f"{len(stages)} stages"
            )
        parts = obj.get("stage_parts")
        if parts is not None and (
            sizes is None or len(parts) != len(stages) or any(int(n) < 1 for n in parts)
        ):
            raise ValueError(
                f"forget: the saved plan's stage_parts {parts} do not give its {len(stages)} "
                "split stages a count >= 1 each"
            )
        return cls(
            schedule=P.Schedule.from_dict(obj["schedule"]),
            chain=P.Chain(
                tuple(stages), region_overhead_s=float(obj.get("region_overhead_s", 0.0))
            ),
            budget_bytes=int(obj["budget_bytes"]),
            measured_peak_bytes=int(obj["measured_peak_bytes"]),
            predicted_peak_bytes=int(obj["predicted_peak_bytes"]),
            plain_peak_bytes=int(obj["plain_peak_bytes"]),
            min_feasible_bytes=int(obj["min_feasible_bytes"]),
            option_names=tuple(obj.get("option_names", ())),
            policies=_check_options(options),
            block_stages=None if sizes is None else tuple(int(n) for n in sizes),
            stage_parts=None if parts is None else tuple(int(n) for n in parts),
        )


def _layout(items: Sequence[P.Keep | P.Region]) -> str:
    parts = []
    for item in items:
        if isinstance(item, P.Keep):
            parts.append(f"{item.stage_index}" + (f"[{item.option}]" if item.option else ""))
        else:
            parts.append(f"({_layout(item.items)})")
    return " ".join(parts)


def _region_names(items: Sequence[P.Keep | P.Region], prefix: str = "R") -> dict[int, str]:
    """Stage index -> the name of the innermost region holding it (``R2.1``)."""
    names: dict[int, str] = {}
    count = 0
    for item in items:
        if isinstance(item, P.Region):
            count += 1
            name = f"{prefix}{count}"
            for keep in item.items:
                if isinstance(keep, P.Keep):
                    names[keep.stage_index] = name
            names.update(_region_names(item.items, f"{name}."))
    return names
