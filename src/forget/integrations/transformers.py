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
from collections.abc import Callable, Mapping
from typing import Any

from .. import checkpoint
from ..policies import Policy, as_policy

__all__ = ["checkpoint_function", "checkpointed_layers", "disable", "enable", "is_enabled"]

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
    model: Any,
    *,
    policy: Policy | bool | None = None,
    preserve_rng_state: bool = True,
    budget: int | float | str | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> Any:
    """Turn on gradient checkpointing in ``model``, with forget running every checkpointed layer.

    Args:
        model: a ``transformers.PreTrainedModel`` that supports gradient checkpointing.
        policy: what each layer keeps (`forget.policies`); ``None`` keeps nothing
            but the layer inputs.
        preserve_rng_state: replay RNG in the recomputation (dropout stays exact).
        budget: fit one training step into this peak memory, checkpointing as few
            layers as it takes: bytes, a size (``"512MiB"``) or a share of the
            plain step's measured peak (``"60%"``, ``0.6``). Needs ``inputs``.
            NOTE [budget by layers].
        inputs: keyword inputs of one training step, ``model(**inputs).loss``
            (for example ``{"input_ids": ids, "labels": ids}``), used to measure.

    Returns:
        ``model`` itself, changed in place. As with transformers' own
        checkpointing, layers are checkpointed only in ``model.train()`` mode.

    Raises:
        ImportError: transformers is not installed (the message has the pip command).
        TypeError: ``model`` is not a ``PreTrainedModel``; ``budget`` without ``inputs``.
        ValueError: the model does not support gradient checkpointing, or uses the
            pre-4.35 format that calls torch's checkpoint directly.
        forget.BudgetInfeasibleError: even with every layer checkpointed the
            measured peak is above ``budget``; the error names that peak.
    """
    _check_model(model)
    if budget is not None and inputs is None:
        raise TypeError(
            "forget: enable(model, budget=...) measures training steps to fit the budget and "
            "needs their inputs: pass inputs={'input_ids': ids, 'labels': ids} (whatever "
            "model(**inputs).loss takes)."
        )
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
    if budget is not None:
        assert inputs is not None
        _fit_budget(model, budget, inputs)
    return model


# NOTE [budget by layers]: transformers checkpoints a layer when its
# ``gradient_checkpointing`` flag is set, so a budget is met by choosing how many
# layers keep the flag. Checkpointing the first k of L layers, the measured peak
# of a step falls as k grows (the tests check it on the reference models); we
# measure k = L (the least memory: above the budget, the budget is infeasible)
# and k = 0 (the plain step, what a share refers to), then bisect for the least k
# whose *measured* peak fits. The first layers go first: their activations wait
# longest for backward, and a checkpointed layer recomputes after the plain layers
# above it have freed theirs. Each probe is one step measured with forget.measure;
# RNG, gradients and buffers are put back afterwards.


def _layers(model: Any) -> list[Any]:
    """The checkpointable layers: flagged modules with no flagged module inside."""
    flagged = [m for m in _checkpointing_modules(model) if hasattr(m, _ATTR)]
    return [
        m
        for m in flagged
        if not any(o is not m and hasattr(o, _ATTR) for o in m.modules() if o in flagged)
    ]


def _fit_budget(model: Any, budget: int | float | str, inputs: Mapping[str, Any]) -> None:
    import torch

    from ..errors import BudgetInfeasibleError
    from ..memory import measure
    from ..schedules import parse_budget

    layers = _layers(model)
    params = list(model.parameters())
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    grads = [p.grad for p in params]
    buffers = {n: b.clone() for n, b in model.named_buffers()}

    def peak(k: int) -> int:
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < k
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=cuda):  # probes draw no one's random numbers
            report = measure(lambda: model(**inputs).loss.backward())
        return report.peak_bytes

    chosen = len(layers)  # what enable leaves when the budget cannot be met
    try:
        least, plain = peak(len(layers)), peak(0)
        limit = parse_budget(budget, plain)
        if least > limit:
            raise BudgetInfeasibleError(
                f"forget: the budget {limit:,} B is below the smallest feasible one, "
                f"{least:,} B (one step with all {len(layers)} layers checkpointed; the plain "
                f"step peaks at {plain:,} B)",
                budget_bytes=limit,
                min_feasible_bytes=least,
            )
        lo, hi = 0, len(layers)  # peak(hi) <= limit
        if plain <= limit:
            hi = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak(mid) <= limit:
                hi = mid
            else:
                lo = mid
        chosen = hi
    finally:
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < chosen
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])


def checkpointed_layers(model: Any) -> list[str]:
    """Names of the layers of ``model`` that transformers checkpoints now."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in _layers(model) if m.gradient_checkpointing]


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
