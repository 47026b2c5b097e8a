"""Run submodules as forgotten regions by wrapping their forward on the instance.

NOTE [instance forward]: a tree plan changes no module's class and adds no
submodule: each chosen module gets an instance attribute ``forward``, a
`RegionForward` that runs the forward found there before as a forgotten region
(`forget.engine.run_region`, the engine of `forget.checkpoint`), or under an
option's policy. ``nn.Module.__call__`` calls ``self.forward``, so hooks, keyword
arguments and any output structure (a tuple, a Hugging Face ``ModelOutput``)
pass as before; ``state_dict`` keys, parameters and buffers are untouched, and
`unwrap` restores exactly what was there (the class's method, or an instance
forward someone else had set). The wrapper holds the previous forward as a
bound method, so ``copy.deepcopy`` of a planned model gives regions running
the copy's modules, not the original's; ``__wrapped__`` keeps
``inspect.signature`` of the module's forward what it was.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from ...engine import regenerating, run_region
from ...policies import Policy


def run_option(
    forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any], policy: Policy | None
) -> Any:
    """Run ``forward`` forgotten (``policy`` None), in a policy region, or regenerating."""
    if policy is not None and policy.regenerate:
        with regenerating(policy):  # NOTE [regenerate]: plain autograd keeping less
            return forward(*args, **kwargs)
    return run_region(forward, args, kwargs, policy=policy)


class RegionForward:
    """A module's forward run as a forgotten region or under an option (NOTE [instance forward])."""

    def __init__(self, module: nn.Module, choice: str, policy: Policy | None) -> None:
        original = module.forward
        functools.update_wrapper(self, original)
        self.original = original
        # An instance forward set before (None: the class's method); a copy keeps None.
        self.own = module.__dict__.get("forward")
        self.choice = choice
        self.policy = policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run_option(self.original, args, kwargs, self.policy)

    def __repr__(self) -> str:
        return f"<forget region ({self.choice}) around {self.original!r}>"


def wrap(module: nn.Module, choice: str, policy: Policy | None) -> None:
    """Make ``module`` run as ``choice`` says: ``"forget"``, or a leaf option's ``policy``."""
    if isinstance(module.__dict__.get("forward"), RegionForward):
        raise ValueError(
            f"forget: {type(module).__name__} runs as a forget region already; remove the "
            "plan applied before (plan.remove(model)) before applying another"
        )
    module.__dict__["forward"] = RegionForward(module, choice, policy)


def unwrap(module: nn.Module) -> bool:
    """Restore ``module``'s forward as it was before `wrap`; False if it was not wrapped."""
    wrapper = module.__dict__.get("forward")
    if not isinstance(wrapper, RegionForward):
        return False
    if wrapper.own is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = wrapper.own
    return True


def is_wrapped(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), RegionForward)


def policy_of(choice: str, policies: Mapping[str, Policy]) -> Policy | None:
    """The policy a choice runs under: ``None`` for ``"forget"``."""
    if choice == "forget":
        return None
    try:
        return policies[choice]
    except KeyError:
        raise ValueError(
            f"forget: the plan uses the option {choice!r} but has no policy for it; load it "
            "with TreePlan.load(path, options={name: policy, ...})"
        ) from None


def wrap_all(model: nn.Module, choices: Mapping[str, str], policies: Mapping[str, Policy]) -> None:
    """Wrap every module ``choices`` names; on an error, unwrap what was wrapped."""
    done: list[nn.Module] = []
    try:
        for name, choice in choices.items():
            module = model.get_submodule(name)
            wrap(module, choice, policy_of(choice, policies))
            done.append(module)
    except BaseException:
        for module in done:
            unwrap(module)
        raise


def unwrap_all(model: nn.Module, names: Iterator[str] | list[str]) -> None:
    for name in names:
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
