"""Hugging Face transformers: checkpoint a model's layers with forget's engine.

transformers (4.35 and later, 5.x) checkpoints a layer by calling the
``_gradient_checkpointing_func`` attribute that ``gradient_checkpointing_enable``
/ ``activation_checkpointing_enable`` sets on every module carrying a
``gradient_checkpointing`` flag; by default that function is
``torch.utils.checkpoint.checkpoint`` with the given keyword arguments bound.
`enable` lets transformers do all of its own switching (flags on the layers,
``every_n_layers``, ``use_cache`` handling, input-grad hooks), then puts
`forget.checkpoint` in place of that function on each such module. So every
layer transformers would checkpoint runs as a forgotten region: gradients
equal the plain run's (dropout replayed), BatchNorm-like buffers are updated
once, and ``policy`` selects what each layer keeps.

transformers is imported only inside the functions here; ``import
forget.integrations.transformers`` works without it.

Example:
    >>> import torch
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from forget.integrations import transformers as forget_hf
    >>> config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
    ...                     bos_token_id=0, eos_token_id=0, use_cache=False)
    >>> model = forget_hf.enable(GPT2LMHeadModel(config).train())
    >>> forget_hf.is_enabled(model)
    True
    >>> ids = torch.randint(0, 100, (2, 8))
    >>> model(input_ids=ids, labels=ids).loss.backward()  # each block recomputed by forget
    >>> forget_hf.is_enabled(forget_hf.disable(model))
    False
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .._checkpoint import checkpoint
from ..policies import Policy, as_policy

__all__ = ["checkpoint_function", "disable", "enable", "is_enabled"]

_INSTALL = 'pip install "transformers>=4.35"  (or: pip install "torch-forget[transformers]")'
_ATTR = "_gradient_checkpointing_func"
_MARK = "_forget_checkpoint"


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "forget: forget.integrations.transformers needs Hugging Face transformers, "
            f"which is not installed. Install it with: {_INSTALL}"
        ) from error
    return transformers


def _check_model(model: Any) -> None:
    transformers = _require_transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            "forget: enable/disable take a transformers PreTrainedModel, "
            f"got {type(model).__name__}."
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"forget: {type(model).__name__} does not support gradient checkpointing in "
            "transformers (supports_gradient_checkpointing is False), so there are no layers "
            "to run through forget. Wrap its blocks with forget.Forget instead."
        )


def checkpoint_function(
    *, policy: Policy | bool | None = None, preserve_rng_state: bool = True
) -> Callable[..., Any]:
    """The function `enable` installs: `forget.checkpoint` with these options bound.

    transformers calls it as ``func(layer_forward, *args)``.
    """
    func = functools.partial(
        checkpoint,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        policy=as_policy(policy),
    )
    setattr(func, _MARK, True)
    return func


def _checkpointing_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def enable(
    model: Any, *, policy: Policy | bool | None = None, preserve_rng_state: bool = True
) -> Any:
    """Turn on gradient checkpointing in ``model``, with forget running every checkpointed layer.

    Args:
        model: a ``transformers.PreTrainedModel`` that supports gradient checkpointing.
        policy: what each layer keeps (`forget.policies`); ``None`` keeps nothing
            but the layer inputs.
        preserve_rng_state: replay RNG in the recomputation (dropout stays exact).

    Returns:
        ``model`` itself, changed in place. As with transformers' own
        checkpointing, layers are checkpointed only in ``model.train()`` mode.

    Raises:
        ImportError: transformers is not installed (the message has the pip command).
        TypeError: ``model`` is not a ``PreTrainedModel``.
        ValueError: the model does not support gradient checkpointing, or uses the
            pre-4.35 format that calls torch's checkpoint directly.
    """
    _check_model(model)
    func = checkpoint_function(policy=policy, preserve_rng_state=preserve_rng_state)
    # transformers does its own switching first (flags, every_n_layers, input-grad
    # hooks); the keyword arguments only reach the torch function replaced below.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4.x; 5.x deprecates this name with a FutureWarning
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    replaced = 0
    for module in _checkpointing_modules(model):
        if hasattr(module, _ATTR):
            setattr(module, _ATTR, func)
            replaced += 1
    if replaced == 0:
        raise ValueError(
            f"forget: {type(model).__name__} turned on gradient checkpointing but no module "
            f"has a {_ATTR} attribute: it uses the pre-4.35 format of transformers, which "
            "calls torch.utils.checkpoint directly and cannot be redirected. Upgrade the model "
            "code, or wrap its blocks with forget.Forget."
        )
    return model


def disable(model: Any) -> Any:
    """Turn gradient checkpointing off again (forget's or transformers'); return ``model``."""
    _check_model(model)
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
    return model


def is_enabled(model: Any) -> bool:
    """Whether some layer of ``model`` is checkpointed, and every checkpointed one by forget."""
    flagged = [m for m in _checkpointing_modules(model) if m.gradient_checkpointing]
    return bool(flagged) and all(getattr(getattr(m, _ATTR, None), _MARK, False) for m in flagged)
