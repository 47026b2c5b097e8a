"""A region's saved-tensor hooks, which torch's selective checkpoint sees as a checkpoint's own.

NOTE [checkpoint-internal hooks]: torch's selective checkpoint (SAC: the contexts of
``create_selective_checkpoint_contexts`` passed as ``context_fn``) keeps the outputs
its policy saves in a cache of its own, outside autograd's saved tensors. Since
torch 2.14 it asks, at each op it caches, which ``saved_tensors_hooks`` the user has
around the region: with ``respect_saved_tensors_hooks=True`` it packs the cached
outputs through them (``save_on_cpu`` then holds them on the host), with ``None``
it keeps them outside the hooks and warns (``FutureWarning``: a future torch will
route them), with ``False`` it keeps them outside, silently. The hooks it asks for
are the innermost ones, skipping the hooks of checkpoints themselves: a pack hook
marked ``_checkpoint_internal`` stands for the hooks that were innermost when it
was pushed (its ``_user_hooks``). A forget region's hooks are the innermost while
its function runs, so unmarked they would be taken for the user's: torch would
warn around every selective checkpoint run by forget (or inside a forget region),
hooks or none, and with ``True`` would pack its cache through forget's own pack
(slots that re-run the region). Marked, they are seen through, as torch's own
checkpoint hooks are, and forget behaves as torch's checkpoint: the warning and
the routing concern the user's hooks around the call, and only those.

The mark is torch's private protocol (``_current_user_saved_tensors_hooks`` in
``torch.utils.checkpoint``), so it is used only where torch has it (found by
looking the function up, not by version); older torches ask nobody, and the
hooks go on unwrapped. ``_user_hooks`` lives only while the hooks are pushed, as
in torch: the graph holds a pack hook where the garbage collector cannot see it,
so a lasting reference to the user's hooks could leak them with the graph.
``forget.regenerating`` is not marked: it is a user's context, as ``save_on_cpu``
is, and like it is seen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["region_hooks"]

# NOTE [checkpoint-internal hooks]: None where torch's SAC asks no hooks (torch < 2.14).
_user_hooks_now: Callable[[], Any] | None = getattr(
    torch_checkpoint, "_current_user_saved_tensors_hooks", None
)


def region_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], Any]
) -> torch.autograd.graph.saved_tensors_hooks:
    """The saved-tensor hooks of a region's forward or re-run, as a context manager.

    NOTE [checkpoint-internal hooks]: marked as a checkpoint's own where torch looks
    for the mark; the plain hooks elsewhere.
    """
    if _user_hooks_now is None:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    return _MarkedHooks(pack, unpack)


class _MarkedHooks(torch.autograd.graph.saved_tensors_hooks):
    """Hooks whose pack torch's SAC sees through to the hooks that were there before."""

    def __init__(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], Any]):
        # A partial: a bound method takes no attributes of its own, and the mark is
        # per push. Calling it costs a C call more per saved tensor, nothing in Python.
        marked: Any = functools.partial(pack)
        marked._checkpoint_internal = True
        super().__init__(marked, unpack)

    def __enter__(self) -> None:
        assert _user_hooks_now is not None
        self.pack_hook._user_hooks = _user_hooks_now()  # type: ignore[attr-defined]
        super().__enter__()

    def __exit__(self, *exc: object) -> None:
        del self.pack_hook._user_hooks  # type: ignore[attr-defined]
        super().__exit__(*exc)
