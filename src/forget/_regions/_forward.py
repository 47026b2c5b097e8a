"""Run a module through a call of one's own by setting its forward on the instance.

NOTE [instance forward]: a plan or a cap changes no module's class and adds no
submodule: each module it runs gets an instance attribute ``forward``, a
`RegionForward` that hands the forward found there before, with the call's
arguments, to the owner's call (a plan's: a forgotten region or an option's
policy; a cap's: a droppable region). ``nn.Module.__call__`` calls
``self.forward``, so hooks, keyword arguments and any output structure (a
tuple, a Hugging Face ``ModelOutput``) pass as before; ``state_dict`` keys,
parameters and buffers are untouched, and `unwrap_forward` restores exactly what
was there (the class's method, or an instance forward someone else had set).
The wrapper holds the previous forward as a bound method, so ``copy.deepcopy``
of a wrapped model gives regions running the copy's modules, not the
original's; ``__wrapped__`` keeps ``inspect.signature`` of the module's forward
what it was. One wrapper serves a plan, a cap and `chunk_loss` alike; ``owner``
says whose it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["RegionForward", "owner_of", "unwrap_forward", "wrap_forward"]

#: What a wrapper runs: ``call(forward, args, kwargs)``, the module's forward before it.
Call = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


class RegionForward:
    """A module's forward run through ``call`` (NOTE [instance forward]).

    Attributes:
        original: the forward found on the module before, bound to it.
        own: the instance forward set before (None: the class's method).
        owner: whose wrapper it is (``"plan"``, ``"cap"``, ``"chunk_loss"``).
        label: what it runs, for its ``repr``.
    """

    def __init__(self, module: nn.Module, call: Call, owner: str, label: str) -> None:
        original = module.forward
        functools.update_wrapper(self, original)
        self.original = original
        # An instance forward set before (None: the class's method); a copy keeps None.
        self.own = module.__dict__.get("forward")
        self.call = call
        self.owner = owner
        self.label = label

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.original, args, kwargs)

    def __repr__(self) -> str:
        return f"<forget {self.label} around {self.original!r}>"


def wrap_forward(module: nn.Module, call: Call, owner: str, label: str) -> None:
    """Run ``module``'s forward through ``call`` until `unwrap_forward`."""
    module.__dict__["forward"] = RegionForward(module, call, owner, label)


def unwrap_forward(module: nn.Module, owner: str) -> bool:
    """Restore ``module``'s forward as it was before ``owner``'s `wrap_forward`; False
    where ``owner`` did not wrap it (another's wrapper stays)."""
    wrapper = module.__dict__.get("forward")
    if not isinstance(wrapper, RegionForward) or wrapper.owner != owner:
        return False
    if wrapper.own is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = wrapper.own
    return True


def owner_of(module: nn.Module) -> str | None:
    """Whose `RegionForward` runs ``module``'s forward (``"plan"``, ``"cap"``,
    ``"chunk_loss"``), or None."""
    wrapper = module.__dict__.get("forward")
    return wrapper.owner if isinstance(wrapper, RegionForward) else None
