"""A region's saved-tensor hooks, which torch's selective checkpoint sees as a checkpoint's own.

NOTE [checkpoint-internal hooks]: torch's selective checkpoint (SAC) keeps what
its policy saves in a cache of its own and, where torch has the protocol, asks
which user ``saved_tensors_hooks`` surround the region, to pack that cache
through them (``respect_saved_tensors_hooks``) or warn. It skips hooks marked
``_checkpoint_internal``. A forget region's hooks are innermost while its
function runs, so unmarked they would be taken for the user's: torch would warn
around every SAC inside forget and pack its cache through forget's slots. So
forget marks its hooks and behaves as torch's checkpoint: only the user's hooks
around the call count. The mark is a private torch protocol, used only where the
function exists (looked up, not version-checked); ``_user_hooks`` lives only
while the hooks are pushed, since a lasting reference from a pack hook, which the
garbage collector cannot see, could leak the user's hooks with the graph.
``forget.regenerating`` is a user's context, as ``save_on_cpu`` is: not marked.
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
