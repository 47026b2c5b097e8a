"""`StepReport`: what a cap did in one step."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepReport"]


@dataclass(frozen=True)
class StepReport:
    """What a cap did in one step.

    Attributes:
        regions: the candidate regions the step ran, in forward order.
        evicted: those evicted whole (re-run in backward), in eviction order.
        estimated_peak_bytes: the largest estimate of the step's peak at a region
            boundary, after evictions (NOTE [the cap's count]).
        budget_bytes: the cap in force.
        evicted_forward_s: the forward time of the evicted regions as the step
            measured it (a region's includes the regions inside it): about what
            their re-runs in backward cost.
        repeated: the decision of a step of its shapes repeated (NOTE [steps of known shapes]).
        allocator_peak_bytes: on CPU, the allocator's own peak of the step, from its
            forward's start to its backward's end, where the step read it (NOTE [what
            the count misses]); else ``None``.
        partial: those evicted in part: what the cap's ``partial`` policy keeps stays,
            the rest is re-run in backward (NOTE [partial evictions]).
    """

    regions: tuple[str, ...]
    evicted: tuple[str, ...]
    estimated_peak_bytes: int
    budget_bytes: int
    evicted_forward_s: float = 0.0
    repeated: bool = False
    allocator_peak_bytes: int | None = None
    partial: tuple[str, ...] = ()
