"""`forget.checkpoint`: a drop-in for ``torch.utils.checkpoint.checkpoint``.

It has the call signature and the non-reentrant behaviour of torch's
function (keyword arguments reach the function, outputs may be any nested
structure with non-tensors, recomputation stops early unless ``early_stop=False``
or torch's ``set_checkpoint_early_stop(False)`` says otherwise, ``debug`` or
torch's ``set_checkpoint_debug_enabled(True)`` traces ops), and runs on forget's
engine, so module state comes out as after a plain step (see NOTE [state
tracking]) and RNG is replayed for every op that draws.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from ._engine import compiled_region, run_region
from .policies import Policy, as_policy

__all__ = ["checkpoint"]

_DETERMINISM_CHECKS = ("default", "none")


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    debug: bool = False,
    early_stop: bool = True,
    policy: Policy | bool | None = None,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` keeping no activations; recompute them in backward.

    Same contract as ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
    plus forget's guarantees: buffers the function mutates (BatchNorm running
    statistics, counters) end the step as after a plain step, not updated twice.
    Memory: only the inputs stay alive for backward; compute: about one more
    forward of ``function``.

    Args:
        function: what to run; may return any nested structure.
        *args: its positional arguments.
        use_reentrant: ``None`` or ``False``. ``True`` is accepted with a
            ``UserWarning``: forget always uses its own (non-reentrant) engine.
        preserve_rng_state: replay CPU and device RNG in the recomputation.
        determinism_check: ``"default"`` compares shape, dtype and device of every
            rebuilt tensor with the forward's; ``"none"`` skips the comparison.
        context_fn: returns two context managers, entered around the forward and
            the recomputation respectively (as in torch).
        debug: on a recomputation mismatch, also show the ops the forward and
            the re-run ran around their first difference: op, output dtypes and
            shapes, and the line of your code that called it. Costs a dispatch mode
            and a stack walk per op, in the forward and the re-run, so leave it off
            unless chasing a mismatch. ``set_checkpoint_debug_enabled(True or
            False)`` of ``torch.utils.checkpoint``, when active around the forward,
            overrides it (``None`` defers to ``debug``), as in torch.
        early_stop: stop the re-run as soon as every tensor backward still needs
            is rebuilt (ops after the last one do not run again); ``False`` runs
            the whole function again, and then checks that it saved as many
            tensors as the forward. ``set_checkpoint_early_stop(...)`` of
            ``torch.utils.checkpoint``, when active around the forward, overrides
            it, as in torch.
        policy: which op outputs to keep, recompute or offload (`forget.policies`);
            ``None``/``False`` keep nothing, ``True`` keeps everything. A keyword
            ``policy`` therefore never reaches ``function``.
        respect_saved_tensors_hooks: whether the outputs torch's selective
            checkpoint (``context_fn`` from ``create_selective_checkpoint_contexts``)
            keeps go through the ``saved_tensors_hooks`` around the call (such as
            ``save_on_cpu``), as in torch 2.14: ``None`` keeps them outside the
            hooks, and torch warns (``FutureWarning``) when hooks are there;
            ``False`` keeps them outside, silently; ``True`` packs them through the
            hooks. No effect without torch's selective checkpoint (NOTE [respect
            saved-tensor hooks]). Never reaches ``function``.
        **kwargs: keyword arguments of ``function``.

    Returns:
        What ``function`` returns.

    Raises:
        TypeError: ``function`` is not callable.
        ValueError: an unknown ``determinism_check``;
            ``respect_saved_tensors_hooks=True`` with a ``policy`` that keeps
            outputs, or with torch's selective checkpoint on a torch older than
            2.14, which cannot route what it keeps through the hooks.
        ForgetError: see `forget.forget`.

    Example:
        >>> import torch, forget
        >>> layer = torch.nn.Linear(4, 4)
        >>> y = forget.checkpoint(layer, torch.randn(2, 4), use_reentrant=False)
        >>> y.sum().backward()
        >>> layer.weight.grad.shape
        torch.Size([4, 4])
    """
    if not callable(function):
        raise TypeError(f"forget: function must be callable, but got {type(function).__name__}.")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"forget: determinism_check must be one of {_DETERMINISM_CHECKS}, "
            f"got {determinism_check!r}."
        )
    if use_reentrant:
        warnings.warn(
            "forget: use_reentrant=True is ignored; forget.checkpoint always runs forget's "
            "own non-reentrant engine (keyword arguments, torch.autograd.grad and nesting "
            "all work). Pass use_reentrant=False to silence this warning.",
            UserWarning,
            stacklevel=2,
        )
    if respect_saved_tensors_hooks and policy is not None and not _keeps_nothing(policy):
        raise ValueError(
            "forget: respect_saved_tensors_hooks=True routes what torch's selective "
            "checkpoint (context_fn) keeps through the saved_tensors_hooks around the call, "
            f"but the outputs policy={policy!r} keeps are held by forget and never go "
            "through those hooks (NOTE [respect saved-tensor hooks]). Pass "
            "respect_saved_tensors_hooks=None (or False), or select the ops with torch's "
            "create_selective_checkpoint_contexts as context_fn instead of policy=."
        )
    if torch.compiler.is_compiling() and torch.is_grad_enabled():  # NOTE [compile], engine
        return compiled_region(
            function,
            args,
            kwargs,
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            context_fn=context_fn,
            early_stop=early_stop,
        )
    options: dict[str, Any] = {
        "preserve_rng_state": preserve_rng_state,
        "check": determinism_check == "default",
        "policy": as_policy(policy),
        "early_stop": _torch_flag("_enable_checkpoint_early_stop", early_stop),
        "debug": _torch_flag("_checkpoint_debug_enabled", debug),
    }
    if context_fn is None:
        return run_region(function, args, kwargs, **options)
    forward_context, recompute_context = context_fn()
    _tell_selective_checkpoint(forward_context, respect_saved_tensors_hooks)
    with forward_context:
        return run_region(
            function, args, kwargs, recompute_context=lambda: recompute_context, **options
        )


def _keeps_nothing(policy: Policy | bool) -> bool:
    converted = as_policy(policy)
    return converted is None or converted.saves_nothing


def _tell_selective_checkpoint(forward_context: Any, respect: bool | None) -> None:
    """Hand ``respect_saved_tensors_hooks`` to torch's selective checkpoint, as torch does.

    NOTE [respect saved-tensor hooks]: torch's selective checkpoint (SAC) keeps what
    its policy saves in a cache outside autograd's saved tensors, so outside any
    ``saved_tensors_hooks`` (``save_on_cpu``). torch's checkpoint takes
    ``respect_saved_tensors_hooks`` and sets it on SAC's caching mode: ``True`` packs
    the cache through the hooks, ``False`` keeps it outside, ``None`` keeps it
    outside and warns when hooks are around. forget sets it on the same context, so
    ``forget.checkpoint`` behaves as torch's (its own hooks are seen through: NOTE
    [checkpoint-internal hooks]). Found by attribute, not version: a torch without
    it keeps the cache outside whatever is passed, so ``True`` raises there rather
    than hold on the device what the user meant to move off it; so does ``True``
    with a forget ``policy=`` that keeps outputs, which forget holds outside the
    hooks. Under ``torch.compile`` the setting is ignored, as torch ignores it.
    """
    caching = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
    if caching is None or not isinstance(forward_context, caching):
        return  # not torch's selective checkpoint: it keeps nothing outside autograd
    if hasattr(forward_context, "respect_saved_tensors_hooks"):
        forward_context.respect_saved_tensors_hooks = respect
    elif respect:
        raise ValueError(
            "forget: respect_saved_tensors_hooks=True asks torch's selective checkpoint "
            "(context_fn) to pack what it keeps through the saved_tensors_hooks around "
            f"the call, which torch {torch.__version__} cannot do: its selective "
            "checkpoint keeps its cache outside every hook (torch 2.14 added the choice). "
            "Install torch 2.14 or later, or pass respect_saved_tensors_hooks=None (or "
            "False), what this torch does anyway."
        )


def _torch_flag(name: str, local: bool) -> bool:
    """What torch's checkpoint would use: its global flag ``name`` when set, else ``local``.

    ``set_checkpoint_early_stop`` and ``set_checkpoint_debug_enabled`` set a module
    global of ``torch.utils.checkpoint`` (``None`` when no such context is active),
    read, as torch reads it, when the forward runs.
    """
    value = getattr(torch_checkpoint, name, None)
    return local if value is None else bool(value)
