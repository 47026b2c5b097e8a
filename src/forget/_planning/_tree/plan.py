"""A `Plan`: forgotten regions over a model's module tree, with its measured figures."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ... import schedules as P
from ..._regions import ROOT, first_difference
from ...policies import DEFAULT_OPTIONS, Policy
from ...schedules import format_bytes
from .._json import SavedAsJson
from .._targets import _check_options
from .apply import is_wrapped, policy_of, unwrap_all, wrap_all
from .segments import is_segment
from .step import LargerInputs, signature_of

_FORMAT = "forget.tree_plan/1"

# Where an applied plan notes what it changed, on the model's instance dict (no state).
_APPLIED = "_forget_tree_plan"


@dataclass(frozen=True)
class _Applied:
    names: tuple[str, ...]
    hook_id: int


@dataclass(frozen=True)
class Plan(SavedAsJson):
    """Forgotten regions over a model's module tree that fit a memory budget, measured.

    `forget.plan` returns one for every model. ``choices``
    names the modules that do not run plainly: ``"forget"`` (a forgotten region
    around the module's forward, re-run in backward) or an option of
    ``options=`` (a policy region, or regenerate); regions nest. Apply it with
    `apply`, undo it with `remove`.

    Attributes:
        choices: module path to choice, in the order the step runs them.
        tree: the candidate modules and the figures the solver planned on
            (`forget.schedules.Tree`).
        budget_bytes: the budget, in bytes.
        measured_peak_bytes: the planned step's peak by the allocator (``probe``),
            as measured while planning: the first run of that assignment in the
            process, so it holds what a first use allocates for good (kernel
            and lookup-table caches, a few KiB); later steps read it or less.
        ledger_peak_bytes: the same step's peak by the tensor-storage ledger.
        plain_peak_bytes: the plain step's peak by the allocator, predicted (the
            planner never runs the plain step: NOTE [planning within the budget]
            in `forget._planning`); a percentage budget is a share of it.
        plain_ledger_peak_bytes: the plain step's peak by the ledger, from its
            run on fake tensors.
        min_feasible_bytes: the least allocator peak of any assignment measured:
            where ``least_searched``, the smallest budget `forget.plan` accepts
            for this model and input; else a budget known to fit, at or above
            that (NOTE [least on demand] in `forget._planning`).
        predicted_peak_bytes: the cost model's peak of ``choices``.
        predicted_extra_s: the cost model's seconds added to a step.
        probe: the allocator probe (``"profiler"``: the CPU allocator's events,
            ``"cuda"``: ``torch.cuda.max_memory_allocated``).
        structure: ``(path, type)`` of every module of the model planned.
        input_sizes: per sample planned for, the shape of each tensor input by
            the name of its argument of the model's forward (``"input_ids"``);
            the plan was measured on the largest.
        option_names: the leaf options the planner could choose from.
        least_searched: whether the planner measured the assignments of least
            memory, so that ``min_feasible_bytes`` is the least feasible budget.
    """

    choices: Mapping[str, str]
    tree: P.Tree
    budget_bytes: int
    measured_peak_bytes: int
    ledger_peak_bytes: int
    plain_peak_bytes: int
    plain_ledger_peak_bytes: int
    min_feasible_bytes: int
    predicted_peak_bytes: int
    predicted_extra_s: float
    probe: str
    structure: tuple[tuple[str, str], ...]
    input_sizes: tuple[Mapping[str, tuple[int, ...]], ...] = ()
    option_names: tuple[str, ...] = ()
    least_searched: bool = True
    policies: Mapping[str, Policy] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------ applying

    def apply(self, model: nn.Module) -> nn.Module:
        """Run ``model``'s chosen modules as forgotten regions, in place; return ``model``.

        Each chosen module's forward is wrapped on the instance (NOTE [instance
        forward]): ``state_dict`` keys, parameters and buffers are unchanged,
        and gradients are those of the plain step. A step with an input larger
        than any the plan was made for warns once (NOTE [larger inputs]).

        Raises:
            ValueError: ``model``'s structure differs from the planned model's
                (the message names the first module path that differs and both
                types); a plan is applied already; an option has no policy (a
                loaded plan: pass ``options=``).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"forget: Plan.apply takes the nn.Module it was planned on, got "
                f"{type(model).__name__}"
            )
        self.check(model)
        if _APPLIED in model.__dict__ or any(is_wrapped(m) for m in model.modules()):
            raise ValueError(
                f"forget: {type(model).__name__} runs under a forget plan already; call "
                "plan.remove(model) before applying another"
            )
        for choice in set(self.choices.values()):
            policy_of(choice, self.policies)  # a missing policy raises before any change
        wrap_all(model, self.choices, self.policies)
        hook = LargerInputs(self.input_sizes, self.budget_bytes, signature_of(model))
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        model.__dict__[_APPLIED] = _Applied(tuple(self.choices), handle.id)
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo `apply` exactly: every forward as it was, the input-size hook gone.

        Raises:
            ValueError: no plan is applied to ``model``.
        """
        applied = model.__dict__.pop(_APPLIED, None)
        if not isinstance(applied, _Applied):
            raise ValueError(f"forget: no plan is applied to {type(model).__name__}")
        unwrap_all(model, list(applied.names))
        model._forward_pre_hooks.pop(applied.hook_id, None)
        model._forward_pre_hooks_with_kwargs.pop(applied.hook_id, None)
        return model

    def check(self, model: nn.Module) -> None:
        """Raise `ValueError` naming the first module where ``model`` differs from the planned."""
        difference = first_difference(self.structure, model)
        if difference is not None:
            path, planned, found = difference
            raise ValueError(
                f"forget: this plan was made for another model: at module "
                f"{path or '(the model itself)'!r} the plan has {planned}, "
                f"{type(model).__name__} has {found}; plan this model with forget.plan"
            )

    # ------------------------------------------------------------ reading

    def rows(self) -> list[dict[str, Any]]:
        """Per candidate module, in the order the step runs them (pre-order).

        Each row: ``module`` (path; ``"<model>"`` for the model), ``type``,
        ``depth`` in the candidate tree, ``choice``, ``region_depth`` (how many
        forgotten regions hold it, itself included), ``held_bytes`` (what it
        holds from forward to backward under its choice, children kept: nothing
        inside a forgotten region, whose forward keeps only its inputs),
        ``rerun_bytes`` (inside a forgotten region: what it holds while the
        region re-runs in backward, until its own backward has run; else 0) and
        ``recompute_s`` (what its choice adds: the forward re-run of a
        forgotten module, an option's measured extra time).
        """
        types = dict(self.structure)
        rows: list[dict[str, Any]] = []

        def visit(node: P.TreeNode, depth: int, regions: int) -> None:
            choice = self.choices.get(node.name, "keep")
            option = next((o for o in node.options if o.name == choice), None)
            regions += choice == "forget"
            if choice == "forget":
                held, recompute = node.input_bytes, node.forward_s
            elif option is not None:
                held, recompute = option.held_bytes, option.extra_s
            else:
                held, recompute = node.own_bytes, 0.0
            inside = regions > (choice == "forget")  # under a forgotten ancestor
            path = "" if node.name == ROOT else node.name
            rows.append(
                {
                    "module": node.name,
                    "type": "segment" if is_segment(node.name) else _short(types.get(path, "?")),
                    "depth": depth,
                    "choice": choice,
                    "region_depth": regions,
                    "held_bytes": 0 if inside else held,
                    "rerun_bytes": held if inside else 0,
                    "recompute_s": recompute,
                }
            )
            for child in node.children:
                visit(child, depth + 1, regions)

        visit(self.tree.root, 0, 0)
        return rows

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len("  " * r["depth"] + r["module"]) + len(r["type"]) + 3 for r in rows)
        width = max(width, len("module"))
        forgotten = sum(r["choice"] != "keep" for r in rows)
        lines = [
            f"forget plan: {forgotten} of {len(rows) - 1} candidate modules not kept, "
            f"budget {format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B)",
            f"  {'module':<{width}} {'choice':<12} {'held bytes':>12} {'recompute':>11}",
        ]
        for r in rows:
            name = "  " * r["depth"] + f"{r['module']} ({r['type']})"
            recompute = f"{r['recompute_s'] * 1e3:9.3f}ms" if r["recompute_s"] else f"{'-':>11}"
            held = f"({r['rerun_bytes']:,})" if r["rerun_bytes"] else f"{r['held_bytes']:,}"
            lines.append(f"  {name:<{width}} {r['choice']:<12} {held:>12} {recompute}")
        ratio = self.measured_peak_bytes / max(self.plain_peak_bytes, 1)
        lines.append(
            "  (held bytes: kept from forward to backward, the module's own ops; a forgotten "
            "module holds its inputs)"
        )
        if any(r["rerun_bytes"] for r in rows):
            lines.append(
                "  (in brackets: a module inside a forgotten region holds nothing from forward "
                "to backward; it holds that only while its region re-runs in backward)"
            )
        lines += [
            f"  peak: measured {self.measured_peak_bytes:,} B by the allocator ({self.probe}), "
            f"{ratio:.2f}x the plain {self.plain_peak_bytes:,} B predicted; ledger "
            f"{self.ledger_peak_bytes:,} B (plain {self.plain_ledger_peak_bytes:,} B); "
            f"predicted {self.predicted_peak_bytes:,} B",
        ]
        if self.predicted_peak_bytes > self.budget_bytes >= self.measured_peak_bytes:
            lines.append(
                "  the measured peak decides, and it fits the budget; the predicted one, the "
                "cost model's, only chose which plans to measure"
            )
        least = (
            f"least feasible budget: {self.min_feasible_bytes:,} B"
            if self.least_searched
            else f"least budget measured to fit: {self.min_feasible_bytes:,} B (the least "
            "feasible was not searched for: plan with a budget below it, and the "
            "BudgetInfeasibleError's min_feasible_bytes names it)"
        )
        lines.append(
            f"  {least}; predicted extra time +{self.predicted_extra_s * 1e3:.3f} ms a step"
        )
        return "\n".join(lines)

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (policies are saved by name only)."""
        return {
            "format": _FORMAT,
            "choices": dict(self.choices),
            "tree": {
                "base_bytes": self.tree.base_bytes,
                "floor_bytes": self.tree.floor_bytes,
                "root": _node_dict(self.tree.root),
            },
            "budget_bytes": self.budget_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "ledger_peak_bytes": self.ledger_peak_bytes,
            "plain_peak_bytes": self.plain_peak_bytes,
            "plain_ledger_peak_bytes": self.plain_ledger_peak_bytes,
            "min_feasible_bytes": self.min_feasible_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_extra_s": self.predicted_extra_s,
            "probe": self.probe,
            "structure": [list(pair) for pair in self.structure],
            "input_sizes": [{k: list(v) for k, v in s.items()} for s in self.input_sizes],
            "option_names": list(self.option_names),
            "least_searched": self.least_searched,
            "default_options": dict(self.policies) == dict(DEFAULT_OPTIONS),
        }

    @classmethod
    def from_dict(
        cls, obj: Mapping[str, Any], *, options: Mapping[str, Policy | bool] | None = None
    ) -> Plan:
        """Rebuild a plan from `to_dict`'s output; ``options`` gives the policies by name.

        A plan made with the default options (`DEFAULT_OPTIONS`) gets them back
        when ``options`` is not given.
        """
        if not isinstance(obj, Mapping) or obj.get("format") != _FORMAT:
            raise ValueError(f"forget: not a saved forget plan (format {_FORMAT!r} expected)")
        tree = obj["tree"]
        return cls(
            choices={str(k): str(v) for k, v in obj["choices"].items()},
            tree=P.Tree(
                _node(tree["root"]),
                base_bytes=int(tree["base_bytes"]),
                floor_bytes=int(tree.get("floor_bytes", 0)),  # none in older files
            ),
            budget_bytes=int(obj["budget_bytes"]),
            measured_peak_bytes=int(obj["measured_peak_bytes"]),
            ledger_peak_bytes=int(obj["ledger_peak_bytes"]),
            plain_peak_bytes=int(obj["plain_peak_bytes"]),
            plain_ledger_peak_bytes=int(obj["plain_ledger_peak_bytes"]),
            min_feasible_bytes=int(obj["min_feasible_bytes"]),
            predicted_peak_bytes=int(obj["predicted_peak_bytes"]),
            predicted_extra_s=float(obj["predicted_extra_s"]),
            probe=str(obj["probe"]),
            structure=tuple((str(p), str(t)) for p, t in obj["structure"]),
            input_sizes=tuple(
                {str(k): tuple(int(d) for d in v) for k, v in s.items()}
                for s in obj.get("input_sizes", ())
            ),
            option_names=tuple(obj.get("option_names", ())),
            least_searched=bool(obj.get("least_searched", True)),  # searched in older files
            policies=_check_options(
                DEFAULT_OPTIONS if options is None and obj.get("default_options") else options
            ),
        )


def _short(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def _node_dict(node: P.TreeNode) -> dict[str, Any]:
    return {
        "name": node.name,
        "own_bytes": node.own_bytes,
        "input_bytes": node.input_bytes,
        "work_bytes": node.work_bytes,
        "tail_bytes": node.tail_bytes,
        "forward_s": node.forward_s,
        "can_forget": node.can_forget,
        "options": [dataclasses.asdict(o) for o in node.options],
        "children": [_node_dict(c) for c in node.children],
    }


def _node(obj: Mapping[str, Any]) -> P.TreeNode:
    return P.TreeNode(
        str(obj["name"]),
        tuple(_node(c) for c in obj.get("children", ())),
        own_bytes=int(obj["own_bytes"]),
        input_bytes=int(obj["input_bytes"]),
        forward_s=float(obj["forward_s"]),
        options=tuple(P.TreeOption(**o) for o in obj.get("options", ())),
        can_forget=bool(obj.get("can_forget", True)),
        work_bytes=int(obj.get("work_bytes", 0)),  # NOTE [backward work]: none in older files
        tail_bytes=int(obj.get("tail_bytes", 0)),
    )
