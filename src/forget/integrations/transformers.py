"""Hugging Face transformers: checkpoint a model's layers with forget's engine.

transformers (4.35 and later, 5.x) checkpoints a layer by calling the
``_gradient_checkpointing_func`` attribute that ``activation_checkpointing_enable``
(``gradient_checkpointing_enable`` before 5.0) sets on every module carrying a
``gradient_checkpointing`` flag; by default that function is
``torch.utils.checkpoint.checkpoint`` with the given keyword arguments bound.
`enable` lets transformers do its own switching (the flags, ``every_n_layers``),
then puts `forget.checkpoint` in place of that function on each such module. So
every layer transformers checkpoints runs as a forgotten region: gradients equal
the plain run's (dropout replayed), BatchNorm-like buffers are updated once, and
``policy`` selects what each layer keeps.

NOTE [one door]: everything that switches checkpointing on calls the model's
``activation_checkpointing_enable``: ``Trainer.train()`` when
``TrainingArguments(gradient_checkpointing=True)`` (or ``activation_checkpointing``),
PEFT's ``prepare_model_for_kbit_training``, user code. Each call would put torch's
checkpoint back and silently end forget. So `enable` puts forget's own in front of
that door, on the model instance: transformers still does its switching with the
arguments of the call, then forget's function goes in, the call's checkpoint
keyword arguments bound to it (they are torch's, which `forget.checkpoint`
takes), and an ``offload=True`` that forget cannot honour raises instead of
being dropped. A documented ``TrainingArguments`` recipe alone would not do: the
keyword arguments Trainer passes reach torch's checkpoint, a policy is no JSON
value for ``TrainingArguments``, and every other caller would still drop forget.
`disable` hands the door back to transformers.

NOTE [settings kept]: `enable` on a model whose layers transformers already
checkpoints keeps the layers it chose (``every_n_layers``, or any flags set by
hand) and the keyword arguments bound to its function; ``every_n_layers=...``
switches again. What forget cannot keep raises: ``offload=True`` (transformers
keeps each layer's inputs in host memory; forget's engine keeps a region's
inputs on their device) or a checkpoint function that is not torch's.

NOTE [input-grad hooks]: transformers' enable also hooks the input embeddings so
that their output requires grad, which reentrant checkpointing needs to reach
the parameters of a layer whose inputs need no grad (LoRA on a frozen model).
forget's engine is not reentrant and needs no such hook, and transformers adds
one more on every call without removing the last; so `enable` and `disable`
leave the model's input-embedding hooks exactly as they found them.

PEFT models (``get_peft_model(...)``) are accepted: the functions work on the
``PreTrainedModel`` that ``get_base_model()`` returns. transformers is imported
only inside the functions here; ``import forget.integrations.transformers``
works without it, and peft is never imported.

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
    >>> model.activation_checkpointing_enable()  # as Trainer does: forget stays
    >>> forget_hf.is_enabled(model)
    True
    >>> forget_hf.is_enabled(forget_hf.disable(model))
    False
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .. import checkpoint
from ..policies import Policy, as_policy

__all__ = ["checkpoint_function", "checkpointed_layers", "disable", "enable", "is_enabled"]

_INSTALL = 'pip install "transformers>=4.35"  (or: pip install "torch-forget[transformers]")'
_ATTR = "_gradient_checkpointing_func"
_MARK = "_forget_checkpoint"
# What transformers' enable_input_require_grads sets on the model (NOTE [input-grad hooks]).
_HOOK_ATTRS = ("_require_grads_hooks", "_require_grads_hook")


def enable(
    model: Any,
    *,
    policy: Policy | bool | None = None,
    preserve_rng_state: bool | None = None,
    every_n_layers: int | None = None,
    budget: int | float | str | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> Any:
    """Turn on gradient checkpointing in ``model``, with forget running every checkpointed layer.

    Memory and compute are transformers' checkpointing's: each checkpointed layer
    keeps only its inputs (and what ``policy`` keeps) and runs its forward once
    more in backward. forget stays in force through ``Trainer`` and every later
    ``model.activation_checkpointing_enable(...)`` until `disable` (NOTE [one door]).

    Args:
        model: a ``transformers.PreTrainedModel`` that supports gradient
            checkpointing, or a PEFT model wrapping one.
        policy: what each layer keeps (`forget.policies`); ``None`` keeps nothing
            but the layer inputs.
        preserve_rng_state: replay RNG in the recomputation (dropout stays exact);
            ``None`` keeps what the checkpoint keyword arguments say, else ``True``.
        every_n_layers: checkpoint every n-th layer, as transformers' own argument;
            ``None`` keeps the layers transformers checkpoints already (NOTE
            [settings kept]), or all of them when it checkpoints none.
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
        TypeError: ``model`` is not a ``PreTrainedModel`` (nor wraps one);
            ``budget`` without ``inputs``.
        ValueError: the model does not support gradient checkpointing, or uses the
            pre-4.35 format that calls torch's checkpoint directly; its layers are
            checkpointed by a function forget would replace at a loss (NOTE
            [settings kept]).
        forget.BudgetInfeasibleError: even with every layer checkpointed the
            measured peak is above ``budget``; the error names that peak.
    """
    base = _base_model(model)
    if every_n_layers is not None and (
        isinstance(every_n_layers, bool)
        or not isinstance(every_n_layers, int)
        or every_n_layers < 1
    ):
        raise ValueError(
            f"forget: every_n_layers must be a whole number of at least 1 (1 checkpoints every "
            f"layer, 2 every other one), got {every_n_layers!r}."
        )
    if budget is not None and inputs is None:
        raise TypeError(
            "forget: enable(model, budget=...) measures training steps to fit the budget and "
            "needs their inputs: pass inputs={'input_ids': ids, 'labels': ids} (whatever "
            "model(**inputs).loss takes)."
        )
    door = _door(base)
    if door is None:
        door = _ForgetDoor(base, _found_options(base))
    options = {**door.options, "policy": as_policy(policy)}
    if preserve_rng_state is not None:
        options["preserve_rng_state"] = preserve_rng_state
    door.options = options
    door.install()
    if every_n_layers is None and any(layer.gradient_checkpointing for layer in _layers(base)):
        door.put_forget_in()  # NOTE [settings kept]
    else:
        door.switch_on(every_n_layers=1 if every_n_layers is None else every_n_layers)
    if budget is not None:
        assert inputs is not None
        _fit_budget(model, budget, inputs)
    return model


def disable(model: Any) -> Any:
    """Turn gradient checkpointing off again (forget's or transformers'); return ``model``.

    The model's ``activation_checkpointing_enable`` is transformers' own again,
    and its input-embedding hooks are as `enable` found them.
    """
    base = _base_model(model)
    door = _door(base)
    if door is not None:
        door.uninstall()
    name = "activation_checkpointing_disable"
    if not hasattr(base, name):  # transformers 4.x
        name = "gradient_checkpointing_disable"
    with _input_hooks_as_found(base):
        getattr(base, name)()
    return model


def is_enabled(model: Any) -> bool:
    """Whether some layer of ``model`` is checkpointed, and every checkpointed one by forget."""
    flagged = [m for m in _checkpointing_modules(model) if m.gradient_checkpointing]
    return bool(flagged) and all(getattr(getattr(m, _ATTR, None), _MARK, False) for m in flagged)


def checkpointed_layers(model: Any) -> list[str]:
    """Names of the layers of ``model`` that transformers checkpoints now."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in _layers(model) if m.gradient_checkpointing]


def checkpoint_function(
    *, policy: Policy | bool | None = None, preserve_rng_state: bool = True, **kwargs: Any
) -> Callable[..., Any]:
    """The function `enable` installs: `forget.checkpoint` with these options bound.

    transformers calls it as ``func(layer_forward, *args)``. ``kwargs`` are more
    keyword arguments of `forget.checkpoint` (``determinism_check``, ``debug``,
    ``early_stop``, ``context_fn``; torch's ``use_reentrant`` is taken, as
    `forget.checkpoint` takes it).
    """
    options = {"use_reentrant": False, **kwargs}
    func = functools.partial(
        checkpoint, preserve_rng_state=preserve_rng_state, policy=as_policy(policy), **options
    )
    setattr(func, _MARK, True)
    return func


class _ForgetDoor:
    """What ``model.activation_checkpointing_enable`` is while forget is enabled (NOTE [one door]).

    It holds the `forget.checkpoint` options bound to every layer (``options``)
    and whatever the instance had under that name before (``previous``), put
    back by `uninstall`.
    """

    def __init__(self, model: Any, options: dict[str, Any]) -> None:
        self.model = model
        self.options = options
        self.name = "activation_checkpointing_enable"
        if not hasattr(model, self.name):  # transformers 4.x
            self.name = "gradient_checkpointing_enable"
        self.previous = model.__dict__.get(self.name)

    def __repr__(self) -> str:
        return f"<forget's {self.name} of {type(self.model).__name__}: {self.options}>"

    def __call__(
        self,
        activation_checkpointing_kwargs: Mapping[str, Any] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
        *,
        gradient_checkpointing_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if offload:
            raise ValueError(
                f"forget: {self.name}(offload=True) asks transformers to keep each checkpointed "
                "layer's inputs in host memory, and forget, enabled on this model, keeps a "
                "layer's inputs on their device (its engine has no input offload), so the "
                "setting would be lost. Leave offload out (of TrainingArguments' "
                "activation_checkpointing_kwargs too), or go back to transformers' own "
                "checkpointing: forget.integrations.transformers.disable(model), then "
                f"model.{self.name}(offload=True)."
            )
        given = activation_checkpointing_kwargs or gradient_checkpointing_kwargs or {}
        self.options = {**self.options, **given}
        self.switch_on(every_n_layers=every_n_layers)

    def install(self) -> None:
        setattr(self.model, self.name, self)

    def uninstall(self) -> None:
        if self.previous is None:
            delattr(self.model, self.name)
        else:
            setattr(self.model, self.name, self.previous)

    def switch_on(self, *, every_n_layers: int) -> None:
        """transformers' own enable (flags, ``every_n_layers``), then forget's function in."""
        original = self.previous or getattr(type(self.model), self.name).__get__(self.model)
        # The keyword arguments reach only torch's function, replaced right after.
        kwargs = {"use_reentrant": False}
        with _input_hooks_as_found(self.model):
            if self.name == "activation_checkpointing_enable":
                original(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
            elif every_n_layers == 1:
                original(gradient_checkpointing_kwargs=kwargs)
            else:
                raise ValueError(
                    f"forget: every_n_layers={every_n_layers} needs transformers 5, whose "
                    "activation_checkpointing_enable takes it; this transformers checkpoints "
                    "every layer. Upgrade transformers, or pass every_n_layers=None."
                )
        self.put_forget_in()

    def put_forget_in(self) -> None:
        func = checkpoint_function(**self.options)
        replaced = 0
        for module in _checkpointing_modules(self.model):
            if hasattr(module, _ATTR):
                setattr(module, _ATTR, func)
                replaced += 1
        if replaced == 0:
            disable(self.model)
            raise ValueError(
                f"forget: {type(self.model).__name__} turned on gradient checkpointing but no "
                f"module has a {_ATTR} attribute: it uses the pre-4.35 format of transformers, "
                "which calls torch.utils.checkpoint directly and cannot be redirected. Upgrade "
                "the model code, or wrap its blocks with forget.Forget."
            )


def _door(model: Any) -> _ForgetDoor | None:
    """forget's door on ``model``, if `enable` put one there."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        door = model.__dict__.get(name)
        if isinstance(door, _ForgetDoor):
            return door
    return None


def _found_options(model: Any) -> dict[str, Any]:
    """The checkpoint keyword arguments bound to the layers transformers checkpoints now.

    NOTE [settings kept]: torch's checkpoint (or forget's) with keyword arguments
    is what transformers installs without ``offload``; anything else forget would
    replace at a loss, so it raises.
    """
    import torch.utils.checkpoint

    options: dict[str, Any] = {}
    for module in _checkpointing_modules(model):
        func = getattr(module, _ATTR, None)
        if not module.gradient_checkpointing or func is None:
            continue
        inner = func.func if isinstance(func, functools.partial) else func
        if inner is torch.utils.checkpoint.checkpoint or getattr(func, _MARK, False):
            keywords = dict(getattr(func, "keywords", {}))
            keywords.pop("policy", None)  # forget's own: enable sets it
            options.update(keywords)
            continue
        what, loss = f"{inner!r}", ""
        if "_activation_checkpointing_enable" in getattr(inner, "__qualname__", ""):
            what = "transformers' offload=True"
            loss = (
                " (it keeps each layer's inputs in host memory; forget keeps them on their device)"
            )
        raise ValueError(
            f"forget: the layers of {type(model).__name__} are checkpointed by {what}, not by "
            "torch.utils.checkpoint.checkpoint; enable would put forget.checkpoint in its place "
            f"and lose what that does{loss}. Switch it off first with "
            "model.activation_checkpointing_disable(), then call enable."
        )
    return options


@contextlib.contextmanager
def _input_hooks_as_found(model: Any) -> Iterator[None]:
    """Run transformers' enable or disable leaving the input-embedding hooks as they are.

    NOTE [input-grad hooks]: the enable adds hooks and lists them in
    ``model._require_grads_hooks`` (replacing what was listed); a disable removes
    what is listed. Inside, nothing is listed; afterwards, what the call added is
    removed and the attributes are as before.
    """
    found = {name: model.__dict__[name] for name in _HOOK_ATTRS if name in model.__dict__}
    model._require_grads_hooks = []
    try:
        yield
    finally:
        for handle in model.__dict__.get("_require_grads_hooks", []):
            handle.remove()
        for name in _HOOK_ATTRS:
            model.__dict__.pop(name, None)
        model.__dict__.update(found)


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "forget: forget.integrations.transformers needs Hugging Face transformers, "
            f"which is not installed. Install it with: {_INSTALL}"
        ) from error
    return transformers


def _base_model(model: Any) -> Any:
    """The ``PreTrainedModel`` of ``model``: itself, or what a PEFT model wraps."""
    transformers = _require_transformers()
    base = model
    get_base_model = getattr(model, "get_base_model", None)
    if not isinstance(model, transformers.PreTrainedModel) and callable(get_base_model):
        base = get_base_model()  # peft's PeftModel, duck-typed: peft is not imported
    if not isinstance(base, transformers.PreTrainedModel):
        raise TypeError(
            "forget: enable/disable take a transformers PreTrainedModel or a PEFT model "
            f"wrapping one (its get_base_model() a PreTrainedModel), got {type(model).__name__}."
        )
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"forget: {type(base).__name__} does not support gradient checkpointing in "
            "transformers (supports_gradient_checkpointing is False), so there are no layers "
            "to run through forget. Wrap its blocks with forget.Forget instead."
        )
    return base


def _checkpointing_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]


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
