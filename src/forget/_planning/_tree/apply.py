"""Run submodules as forgotten regions: a plan's choices on the instance forward.

Each chosen module's forward is wrapped on the instance (`forget._regions.RegionForward`,
NOTE [instance forward] in `forget._regions`), the wrapper a cap uses too: its call runs
the forward found there before as a forgotten region (`forget._engine.run_region`,
the engine of `forget.checkpoint`), or under an option's policy.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from ..._engine import regenerating, run_region
from ..._regions import owner_of, unwrap_forward, wrap_forward
from ...policies import Policy
from .segments import is_segment, segments_call

#: The owner a plan's wrappers carry (`forget._regions.RegionForward.owner`).
PLAN = "plan"


def run_option(
    forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any], policy: Policy | None
) -> Any:
    """Run ``forward`` forgotten (``policy`` None), in a policy region, or regenerating."""
    if policy is not None and policy.regenerate:
        with regenerating(policy):  # NOTE [regenerate]: plain autograd keeping less
            return forward(*args, **kwargs)
    return run_region(forward, args, kwargs, policy=policy)


def _run_choice(
    policy: Policy | None, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    return run_option(forward, args, kwargs, policy)


def wrap(module: nn.Module, choice: str, policy: Policy | None) -> None:
    """Make ``module`` run as ``choice`` says: ``"forget"``, or a leaf option's ``policy``."""
    if is_wrapped(module):
        raise ValueError(
            f"forget: {type(module).__name__} runs as a forget region already; remove the "
            "plan applied before (plan.remove(model)) before applying another"
        )
    wrap_forward(module, functools.partial(_run_choice, policy), PLAN, f"region ({choice})")


def unwrap(module: nn.Module) -> bool:
    """Restore ``module``'s forward as it was before `wrap`; False if no plan wrapped it."""
    return unwrap_forward(module, PLAN)


def is_wrapped(module: nn.Module) -> bool:
    """Whether a plan's region wraps ``module``'s forward."""
    return owner_of(module) == PLAN


def policy_of(choice: str, policies: Mapping[str, Policy]) -> Policy | None:
    """The policy a choice runs under: ``None`` for ``"forget"``."""
    if choice == "forget":
        return None
    try:
        return policies[choice]
    except KeyError:
        raise ValueError(
            f"forget: the plan uses the option {choice!r} but has no policy for it; load it "
            "with Plan.load(path, options={name: policy, ...})"
        ) from None


def wrap_all(model: nn.Module, choices: Mapping[str, str], policies: Mapping[str, Policy]) -> None:
    """Wrap every module ``choices`` names, and the runs of a chain's children it names
    (NOTE [segments]); on an error, unwrap what was wrapped."""
    done: list[nn.Module] = []
    runs = [name for name in choices if is_segment(name)]
    try:
        for name, choice in choices.items():
            if is_segment(name):
                continue
            module = model.get_submodule(name)
            wrap(module, choice, policy_of(choice, policies))
            done.append(module)
        if runs:
            wrap_forward(model, segments_call(model, runs), PLAN, "segments")
    except BaseException:
        for module in done:
            unwrap(module)
        raise


def unwrap_all(model: nn.Module, names: Iterator[str] | list[str]) -> None:
    for name in names:
        if is_segment(name):
            unwrap_forward(model, PLAN)
        else:
            unwrap(model.get_submodule(name))


@contextlib.contextmanager
def applied(
    model: nn.Module, choices: Mapping[str, str], policies: Mapping[str, Policy]
) -> Iterator[None]:
    """The model runs under ``choices`` inside the block, as itself after it."""
    wrap_all(model, choices, policies)
    try:
        yield
    finally:
        unwrap_all(model, list(choices))
