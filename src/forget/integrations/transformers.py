"""Hugging Face transformers: checkpoint a model's layers with forget's engine, or fit a budget.

transformers (4.35 and later, 5.x) checkpoints a layer by calling the
``_gradient_checkpointing_func`` attribute that ``activation_checkpointing_enable``
(``gradient_checkpointing_enable`` before 5.0) sets on every module carrying a
``gradient_checkpointing`` flag; by default that function is
``torch.utils.checkpoint.checkpoint`` with the given keyword arguments bound.
`enable` lets transformers do its own switching (the flags, ``every_n_layers``),
then puts `forget.checkpoint` in place of that function on each such module, so
every layer transformers checkpoints runs as a forgotten region (gradients as
plain, dropout replayed, buffers updated once; ``policy`` selects what each layer
keeps). With ``budget=`` it picks no layers: it puts a plan in force; `cap`
puts a runtime cap in force instead.

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

NOTE [plan in force]: with ``budget=``, `enable` plans ``model(**inputs)`` with
`forget.plan` (regions anywhere in the module tree, nested, the allocator's
peak) and applies the `Plan` (instance forwards). transformers' own
checkpointing is off while it plans and stays off: a layer in a plan's region
and checkpointed by transformers too would be a region nested in another, re-run
twice in backward; one checkpointed outside the plan is memory and time the plan
did not measure. The door keeps the plan: a later ``activation_checkpointing_enable``
(Trainer's) switches no layer on, and raises for what the plan would not do
(``every_n_layers`` other than 1, ``offload=True``, torch checkpoint options its
regions do not take; ``use_reentrant`` is taken as `forget.checkpoint` takes
it). `enable` without a budget removes the plan and checkpoints layers; with
another budget it plans the plain model again; `disable` removes the plan. A
plan needs no checkpointing support from transformers (its ResNet has none).

NOTE [settings kept]: `enable` on a model whose layers transformers already
checkpoints keeps the layers it chose (``every_n_layers``, or any flags set by
hand) and the keyword arguments bound to its function; ``every_n_layers=...``
switches again. What forget cannot keep raises: ``offload=True`` (transformers
keeps each layer's inputs in host memory; forget's engine keeps a region's
inputs on their device) or a checkpoint function that is not torch's. `disable`
puts back transformers' checkpointing as the first `enable` found it: the
flags, and each module's checkpoint function (or its absence).

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
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import checkpoint
from ..policies import Policy, as_policy
from ._transformers_cap import cleared, enable_cap
from ._transformers_head import ChunkedLoss as ChunkedLoss
from ._transformers_head import chunk_loss as chunk_loss
from ._transformers_head import chunked_loss_of as chunked_loss_of

if TYPE_CHECKING:
    from .._planning import Plan
    from .._runtime import Cap

__all__ = [
    "ChunkedLoss",
    "cap",
    "cap_of",
    "checkpoint_function",
    "checkpointed_layers",
    "chunk_loss",
    "chunked_loss_of",
    "disable",
    "enable",
    "is_enabled",
    "plan_of",
]

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
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
    candidates: str | type | Iterable[str | type] | None = None,
    options: Mapping[str, Policy | bool] | None = None,
) -> Any:
    """Turn on gradient checkpointing in ``model``, run by forget; with ``budget``, a fitted plan.

    Without ``budget``, memory and compute are transformers' checkpointing's:
    each checkpointed layer keeps only its inputs (and what ``policy`` keeps)
    and runs its forward once more in backward. With ``budget``, the step is
    planned to fit it at the least recomputation measured (`forget.plan` over
    the module tree) and the plan put in force (NOTE [plan in force]). Either
    way forget stays in force through ``Trainer`` and every later
    ``model.activation_checkpointing_enable(...)`` until `disable` (NOTE [one door]).

    Args:
        model: a ``transformers.PreTrainedModel`` (one that supports gradient
            checkpointing, unless ``budget`` is given), or a PEFT model wrapping one.
        policy: what each layer keeps (`forget.policies`); ``None`` keeps nothing
            but the layer inputs. Not with ``budget`` (see ``options``).
        preserve_rng_state: replay RNG in the recomputation (dropout stays exact);
            ``None`` keeps what the checkpoint keyword arguments say, else ``True``.
            Not with ``budget``: a plan's regions always replay it.
        every_n_layers: checkpoint every n-th layer, as transformers' own argument;
            ``None`` keeps the layers transformers checkpoints already (NOTE
            [settings kept]), or all of them when it checkpoints none. Not with
            ``budget``.
        budget: fit one training step into this peak memory, by the allocator:
            bytes, a size (``"512MiB"``) or a share of the plain step's peak
            (``"60%"``, ``0.6``). Needs ``inputs``.
        inputs: the keyword inputs of one training step, ``model(**inputs)``
            (for example ``{"input_ids": ids, "labels": ids}``), or a list of
            such dicts, batches of the shapes you train on: the plan is made for
            the largest, and a larger input warns (`forget.plan`'s ``samples``).
        loss_fn: output -> scalar loss of the step planned; default ``output.loss``.
        candidates: which submodules may be regions, as `forget.plan` takes them.
        options: name -> policy, partial keeps a region may take instead of
            forgetting everything, as `forget.plan` takes them.

    Returns:
        ``model`` itself, changed in place. As with transformers' own
        checkpointing, layers are checkpointed only in ``model.train()`` mode;
        a plan's regions run whenever gradients are on.

    Raises:
        ImportError: transformers is not installed (the message has the pip command).
        TypeError: ``model`` is not a ``PreTrainedModel`` (nor wraps one);
            ``budget`` without ``inputs``, or with a layer option.
        ValueError: the model does not support gradient checkpointing (without
            ``budget``), or uses the pre-4.35 format that calls torch's
            checkpoint directly; its layers are checkpointed by a function forget
            would replace at a loss (NOTE [settings kept]).
        forget.BudgetInfeasibleError: the budget is below the least peak of any
            plan measured; the error names it (``min_feasible_bytes``). The
            model is left as it was.
    """
    n = every_n_layers
    planning = {"inputs": inputs, "loss_fn": loss_fn, "candidates": candidates, "options": options}
    if budget is not None:
        layer_options = {"policy": policy, "preserve_rng_state": preserve_rng_state}
        return _enable_plan(model, budget, planning, {**layer_options, "every_n_layers": n})
    if given := [name for name, value in planning.items() if value is not None]:
        raise TypeError(
            f"forget: {given} are for fitting a budget, and enable without budget= "
            "checkpoints layers and plans nothing. Pass budget= as well, or leave them out."
        )
    base = _base_model(model)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(
            f"forget: every_n_layers must be a whole number of at least 1 (1 checkpoints every "
            f"layer, 2 every other one), got {every_n_layers!r}."
        )
    door = _door(base)
    if door is None:
        door = _ForgetDoor(base, _found_options(base))
    door.remove_plan()
    bound = {**door.options, "policy": as_policy(policy)}
    if preserve_rng_state is not None:
        bound["preserve_rng_state"] = preserve_rng_state
    door.options = bound
    door.install()
    if every_n_layers is None and any(layer.gradient_checkpointing for layer in _layers(base)):
        door.put_forget_in()  # NOTE [settings kept]
    else:
        door.switch_on(every_n_layers=1 if every_n_layers is None else every_n_layers)
    return model


def cap(
    model: Any,
    budget: int | float | str,
    *,
    candidates: str | type | Iterable[str | type] | None = None,
) -> Any:
    """Keep every training step of ``model`` under ``budget`` with a runtime cap, no plan.

    The cap (`forget.cap`) decides at run time, step by step and whatever the
    shapes, which regions to evict and re-run in backward; nothing is planned
    beforehand. As with a plan, transformers' own checkpointing is off and stays
    off, and the cap stays in force through ``Trainer`` until `disable` or
    `enable` (NOTE [cap in force]).

    Args:
        model: a ``transformers.PreTrainedModel`` or a PEFT model wrapping one.
        budget: what `forget.cap` takes: bytes or a size (``"2GiB"``); on CUDA
            also ``"free"`` or a share of what is free.
        candidates: which submodules may be regions, as `forget.cap` takes them.

    Returns:
        ``model`` itself, changed in place; ``cap_of(model)`` is the cap's handle.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``model`` is not a ``PreTrainedModel`` (nor wraps one).
        ValueError: what `forget.cap` refuses. The model is left as it was.
    """
    base = _base_model(model, layers=False)
    door = _door(base) or _ForgetDoor(base, _found_options(base))
    enable_cap(door, _checkpointing_state(base), _put_back, budget, candidates)
    return model


def disable(model: Any) -> Any:
    """Turn forget off again; return ``model``, as the first `enable` found it.

    The plan (NOTE [plan in force]) is removed, the model's
    ``activation_checkpointing_enable`` is transformers' own again, transformers'
    checkpointing (flags and functions) is as `enable` found it (NOTE [settings
    kept]), and the input-embedding hooks are as they were. On a model forget
    has not enabled, transformers' checkpointing is switched off, as its own
    ``activation_checkpointing_disable`` does.
    """
    base = _base_model(model, layers=False)
    door = _door(base)
    if door is not None:
        door.remove_plan()
        door.uninstall()
        door.put_back_found()
        return model
    name = "activation_checkpointing_disable"
    if not hasattr(base, name):  # transformers 4.x
        name = "gradient_checkpointing_disable"
    with _input_hooks_as_found(base):
        getattr(base, name)()
    return model


def is_enabled(model: Any) -> bool:
    """Whether a plan or cap is in force on ``model``, or forget runs each checkpointed layer.

    Layers: some layer is checkpointed, and every checkpointed one by forget.
    """
    if plan_of(model) is not None or cap_of(model) is not None:
        return True
    flagged = [m for m in _checkpointing_modules(model) if m.gradient_checkpointing]
    return bool(flagged) and all(getattr(getattr(m, _ATTR, None), _MARK, False) for m in flagged)


def plan_of(model: Any) -> Plan | None:
    """The `forget.Plan` that ``enable(model, budget=...)`` put in force, or ``None``.

    ``print(plan_of(model))`` shows the regions as a tree with their bytes; the
    plan's ``measured_peak_bytes`` is the planned step's peak by the allocator.
    """
    return getattr(_door_of(model), "plan", None)


def cap_of(model: Any) -> Cap | None:
    """The handle of the cap ``cap(model, budget)`` put in force (`forget.cap`'s), or ``None``."""
    return getattr(_door_of(model), "cap", None)


def _door_of(model: Any) -> _ForgetDoor | None:  # of a PEFT model's base model too
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return _door(base) if hasattr(base, "__dict__") else None


def checkpointed_layers(model: Any) -> list[str]:
    """Names of the layers of ``model`` that transformers checkpoints now (none under a plan)."""
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


def _enable_plan(
    model: Any, budget: int | float | str, planning: dict[str, Any], layer_options: dict[str, Any]
) -> Any:
    """`enable` with a budget: plan the plain model, then put the plan in (NOTE [plan in force])."""
    from .._planning import plan

    base = _base_model(model, layers=False)
    if given := [name for name, value in layer_options.items() if value is not None]:
        raise TypeError(
            f"forget: {given} choose how transformers' layers are checkpointed, and with "
            "budget= enable checkpoints no layers: it plans regions over the whole model "
            "(NOTE [plan in force]). Leave them out; to let regions keep some outputs, "
            "offer policies with options={'name': policy}."
        )
    samples = _samples(planning.pop("inputs"))
    door = _door(base)
    if door is None:
        door = _ForgetDoor(base, _found_options(base))
    undo = cleared(door, _checkpointing_state(base), _put_back)
    try:  # the model as it was, should planning or applying fail
        fitted = plan(base, budget=budget, samples=samples, **planning)
        fitted.apply(base)
    except BaseException:
        undo()
        raise
    door.plan = fitted
    door.install()
    return model


class _ForgetDoor:
    """What ``model.activation_checkpointing_enable`` is while forget is enabled (NOTE [one door]).

    It holds the `forget.checkpoint` options bound to every layer (``options``),
    the plan in force (``plan``), what the instance had under that name before
    (``previous``) and transformers' checkpointing as it found it (``found``).
    """

    def __init__(self, model: Any, options: dict[str, Any]) -> None:
        self.model = model
        self.options = options
        self.plan: Plan | None = None
        self.cap: Any = None  # a forget._runtime.Cap (NOTE [cap in force])
        self.name = "activation_checkpointing_enable"
        if not hasattr(model, self.name):  # transformers 4.x
            self.name = "gradient_checkpointing_enable"
        self.previous = model.__dict__.get(self.name)
        self.found = _checkpointing_state(model)

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
        if self.plan is not None or self.cap is not None:
            self.keep_plan(given, every_n_layers)
            return
        self.options = {**self.options, **given}
        self.switch_on(every_n_layers=every_n_layers)

    def keep_plan(self, given: Mapping[str, Any], every_n_layers: int) -> None:
        """The door called under a plan or a cap: nothing switched on; what cannot hold raises."""
        fixed, how = (self.plan, "a plan fitted to") if self.plan else (self.cap, "a cap of")
        chooser = f"{how} {fixed.budget_bytes:,} B chooses (enable(model, budget=) or cap)"
        # Taken: use_reentrant (the engine is never reentrant), and what the regions do.
        taken = {("preserve_rng_state", True)}
        asked = [
            f"{k}={v!r}" for k, v in given.items() if k != "use_reentrant" and (k, v) not in taken
        ]
        if every_n_layers != 1 or asked:
            asked = [f"every_n_layers={every_n_layers}"] * (every_n_layers != 1) + asked
            raise ValueError(
                f"forget: {self.name}({', '.join(asked)}) on a model whose regions {chooser}; "
                "it stays in force and checkpoints no layer on top of it (NOTE [plan "
                "in force]), so this would be lost. Leave it out (of TrainingArguments' "
                "activation_checkpointing_kwargs too), or checkpoint layers instead: "
                "forget.integrations.transformers.enable(model) without budget."
            )
        if given.get("use_reentrant"):
            warnings.warn(
                "forget: use_reentrant=True is ignored; the regions of forget's plan or cap run "
                "forget's own non-reentrant engine. Pass use_reentrant=False to silence "
                "this warning.",
                UserWarning,
                stacklevel=3,
            )

    def install(self) -> None:
        setattr(self.model, self.name, self)

    def uninstall(self) -> None:
        if self.previous is None:
            delattr(self.model, self.name)
        else:
            setattr(self.model, self.name, self.previous)

    def remove_plan(self) -> None:
        if self.plan is not None:
            self.plan.remove(self.model)
            self.plan = None
        if self.cap is not None:
            self.cap.remove()
            self.cap = None

    def put_back_found(self) -> None:
        """transformers' checkpointing as the door found it (NOTE [settings kept])."""
        _put_back(self.found)

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


def _base_model(model: Any, *, layers: bool = True) -> Any:
    """The ``PreTrainedModel`` of ``model``: itself, or what a PEFT model wraps.

    ``layers``: it must support transformers' gradient checkpointing (a plan
    needs no such support, NOTE [plan in force]).
    """
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
    if layers and not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"forget: {type(base).__name__} does not support gradient checkpointing in "
            "transformers (supports_gradient_checkpointing is False), so there are no layers "
            "to run through forget. Fit a budget instead, which plans regions over any "
            "model: enable(model, budget=..., inputs={...}); or wrap its blocks with "
            "forget.Forget."
        )
    return base


def _samples(
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
) -> list[Mapping[str, Any]]:
    """``inputs`` as `forget.plan`'s samples: dicts that reach the model untouched."""
    samples = [inputs] if isinstance(inputs, Mapping) else inputs
    if (
        isinstance(samples, list | tuple)
        and samples
        and all(isinstance(x, Mapping) for x in samples)
    ):
        return list(samples)
    raise TypeError(
        "forget: enable(model, budget=...) measures training steps to fit the budget and "
        "needs their inputs: pass inputs={'input_ids': ids, 'labels': ids} (whatever "
        f"model(**inputs) takes), or a list of such dicts; got {type(inputs).__name__}."
    )


def _checkpointing_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def _checkpointing_state(model: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Each module with a checkpointing flag, with the flag and function its instance holds.

    transformers' layers have a class-level ``gradient_checkpointing = False``:
    what is put back is the instance's own attributes, or their absence.
    """
    names = ("gradient_checkpointing", _ATTR)
    return [
        (m, {name: m.__dict__[name] for name in names if name in m.__dict__})
        for m in _checkpointing_modules(model)
    ]


def _put_back(state: list[tuple[Any, dict[str, Any]]]) -> None:
    for module, own in state:
        for name in ("gradient_checkpointing", _ATTR):
            if name in own:
                module.__dict__[name] = own[name]
            else:
                module.__dict__.pop(name, None)


def _layers(model: Any) -> list[Any]:
    """The checkpointable layers: flagged modules with no flagged module inside."""
    flagged = [m for m in _checkpointing_modules(model) if hasattr(m, _ATTR)]
    return [
        m
        for m in flagged
        if not any(o is not m and hasattr(o, _ATTR) for o in m.modules() if o in flagged)
    ]
