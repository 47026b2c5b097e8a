"""One training step of any module: its inputs, its loss, the samples it is planned for.

A tree plan (`.planner`) plans the step ``loss = loss_fn(model(*args,
**kwargs)); loss.backward()``. `TreeStep` holds it; `step_loss` is the default
loss; `samples_step` picks, among several batches, the one planned for (the
largest) and records every batch's input sizes, which an applied plan compares
its inputs against (`LargerInputs`); `traced` and `check_same_calls` hold the
planner to one structure of the step (NOTE [one structure per step]).

NOTE [plan's keywords]: ``forget.plan(model, *args, budget=..., **kwargs)``
takes its own arguments (``budget``, ``loss_fn``, ``options``, ``candidates``,
``samples``, ``repeats``) by keyword,
and hands every other keyword to the model, as `forget.checkpoint` and
`forget.measure` do with the function they run: a Hugging Face step reads as
it is called, ``forget.plan(model, input_ids=ids, labels=ids, budget="60%")``.
A model keyword named like one of plan's own goes through ``samples=[{...}]``,
whose dicts reach the model untouched; the collision is rare (no Hugging Face
model takes any of those names), and a second spelling for every call (a
``kwargs=`` dict) would be paid by every user to serve it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..._engine import in_recomputing
from ..._errors import ForgetError
from .._targets import _Target

TreeLossFn = Callable[[Any], Tensor]


def step_loss(output: Any, loss_fn: TreeLossFn | None) -> Tensor:
    """The scalar a step differentiates: ``loss_fn(output)``, or the default loss.

    The default is ``output.loss`` when the output has one (a Hugging Face model
    given ``labels``), the sum of a tensor output otherwise.

    Raises:
        TypeError: no ``loss_fn`` and neither applies; a loss that is not a
            one-element floating tensor.
    """
    loss: object
    if loss_fn is not None:
        loss = loss_fn(output)
        what = "loss_fn(output)"
    elif isinstance(output, Tensor):
        loss, what = output.sum(), "the sum of the output"
    else:
        loss = getattr(output, "loss", None)
        what = "output.loss"
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"forget: plan differentiates loss_fn(model(...)), and without loss_fn the "
                f"output's .loss or the sum of a tensor output; the model returned "
                f"{type(output).__name__} with no loss tensor (a Hugging Face model computes "
                "one when given labels=...); pass labels, or loss_fn=lambda out: ... "
                "returning a scalar tensor"
            )
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = (
            f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, Tensor)
            else type(loss).__name__
        )
        raise TypeError(
            f"forget: {what} must be a floating tensor with one element (the loss that "
            f"backward starts from), got {got}; reduce it, e.g. loss_fn=lambda out: "
            "out.logits.mean()"
        )
    return loss


@dataclass
class TreeStep:
    """One training step of ``model``: ``loss_fn(model(*args, **kwargs)).backward()``."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: TreeLossFn | None

    def loss(self) -> Tensor:
        """Run the forward and return the loss (the output is not kept)."""
        return step_loss(self.model(*self.args, **self.kwargs), self.loss_fn)

    def run(self) -> None:
        """Run forward and backward; the output is freed before backward starts."""
        self.loss().backward()

    def target(self) -> _Target:
        """What the step touches, for `untouched` and `zero_grads`."""
        tensors = tuple(t for t in pytree.tree_leaves((self.args, self.kwargs)) if _is_tensor(t))
        return _Target([self.model], tensors)


def warn_eval_mode(model: nn.Module) -> None:
    """Warn where ``model`` is in eval mode (NOTE [the step as given]).

    NOTE [the step as given]: a plan is measured on the step it is given, and
    ``model.eval()`` changes that step: dropout runs as the identity and
    BatchNorm normalizes with its running statistics, so the step holds other
    tensors (no dropout masks, no batch statistics) and re-runs other ops. A
    plan made there fits the eval-mode step, not the training step, which may
    need more than the budget. The planner does not switch modes itself: a
    model planned in eval mode on purpose (a frozen BatchNorm's fine-tuning) is
    planned as it is, so the fix is the user's ``model.train()``, and the
    warning says so once per plan. Only the model's own flag counts: a model
    in train mode with some modules in eval mode chose them.
    """
    if model.training:
        return
    warnings.warn(
        f"forget: {type(model).__name__} is in eval mode (model.training is False), and the "
        "step is planned as given: dropout off and BatchNorm on its running statistics, "
        "so a plan made here fits the eval-mode step, not the training step, which may hold "
        "more (NOTE [the step as given]); call model.train() before planning to plan the "
        "training step",
        UserWarning,
        stacklevel=_callers_level(),
    )


def _callers_level() -> int:
    """The ``stacklevel`` that makes a warning name the first frame outside forget: the
    user's call of `forget.plan` (or of ``enable``), however deep the planner warns."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    inside = (package + os.sep, contextlib.__file__)  # decorators run in contextlib
    frame, level = sys._getframe(1), 1  # the function that warns, as ``stacklevel=1`` is
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def positional_batch(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], error: Exception
) -> TypeError | None:
    """The error to raise instead of ``error``, the first call's, where the batch was
    passed as a positional dict (NOTE [a batch passed positionally]); None elsewhere.

    NOTE [a batch passed positionally]: ``forget.plan(model, batch)`` with the
    batch a dict runs ``model(batch)``, and a Hugging Face model fails deep in
    its first op ("embedding(): argument 'indices' must be Tensor, not dict"),
    which names neither forget nor the fix, ``**batch``. A model may take a dict
    as a positional input on purpose, so nothing is refused before the model
    runs: only where its first call failed, and a positional input is a mapping
    whose keys all name other parameters of the model's forward (so it was
    meant as those keywords), is that error replaced by one that says so.
    """
    signature = signature_of(model)
    if signature is None:
        return None
    keywords = {
        name
        for name, parameter in signature.parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }
    for i, value in enumerate(args):
        if not isinstance(value, Mapping) or not value:
            continue
        keys = list(value)
        if all(isinstance(k, str) and k in keywords for k in keys):
            first = str(error).splitlines()[0] if str(error) else ""
            return TypeError(
                f"forget: plan ran {type(model).__name__} with its positional input {i} a "
                f"{type(value).__name__} of {', '.join(keys)}, and the model's forward failed "
                f"on it ({type(error).__name__}: {first}); those keys are its forward's "
                "keyword inputs, so pass the batch as keywords: forget.plan(model, **batch, "
                "budget=...) (NOTE [a batch passed positionally])"
            )
    return None


# A module call of a step's forward: the module's path and its tensor inputs' shapes.
Call = tuple[str, tuple[tuple[int, ...], ...]]


@contextlib.contextmanager
def traced(model: nn.Module) -> Iterator[list[Call]]:
    """Record the module calls made while ``model``'s forward runs inside the block, in order.

    NOTE [one structure per step]: a plan assigns choices to the modules of the
    step it measured, and the planner runs that step several times (profiled, under
    the ledger, under each assignment), mixing figures from different runs. A step
    whose module calls change from run to run (control flow on the data or on
    random draws) has no one structure to plan. So each of those runs records its
    module calls (path and input shapes), and `check_same_calls` compares them with
    the first run's. Only calls made during the model's own forward count, never a
    re-run (`forget.in_recomputing`): re-runs are the same calls by construction,
    and the first run, forward only, has none. A hook allocates no tensor, so the
    peaks measured around it are the step's alone.
    """
    calls: list[Call] = []
    depth = [0]  # the model's forwards running (a model may call itself)

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if (depth[0] or not name) and not in_recomputing():
                leaves = pytree.tree_leaves((args, kwargs))
                calls.append((name, tuple(tuple(t.shape) for t in leaves if _is_tensor(t))))
            depth[0] += not name

        return record

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] -= 1

    handles = [
        module.register_forward_pre_hook(hook(name), with_kwargs=True)
        for name, module in model.named_modules()
    ]
    handles.append(model.register_forward_hook(leave, always_call=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def check_same_calls(
    model: nn.Module, first: Sequence[Call], again: Sequence[Call], run: str
) -> None:
    """Raise `ForgetError` naming the first module call where ``again`` departs from ``first``.

    ``run`` names the run ``again`` came from, for the message (NOTE [one
    structure per step]).
    """
    detail = None
    for i, ((name, shapes), (name2, shapes2)) in enumerate(zip(first, again, strict=False)):
        if name != name2:
            detail = (
                f"call {i + 1} of the first run was module {_path(name)}, of the {run} "
                f"module {_path(name2)}"
            )
        elif shapes != shapes2:
            detail = (
                f"module {_path(name)} took inputs of shapes {list(shapes)} in the first run "
                f"and {list(shapes2)} in the {run}"
            )
        if detail:
            break
    if detail is None and len(first) != len(again):
        n = min(len(first), len(again))
        extra = first[n][0] if len(first) > n else again[n][0]
        detail = (
            f"the first run made {len(first)} module calls, the {run} {len(again)}; "
            f"call {n + 1}, to module {_path(extra)}, is in only one"
        )
    if detail is not None:
        raise ForgetError(
            f"forget: {type(model).__name__}'s step changed structure between two runs on "
            f"the same inputs: {detail}. A plan assigns choices to the modules of the step it "
            "measured, so the step must call the same modules on the same shapes every time "
            "(NOTE [one structure per step]); control flow on the data or on random draws "
            "(a layer skipped when its input's sum is negative, say) changes it. Fix the "
            "control flow while planning (decide it outside the model), or plan each path "
            "as a model of its own"
        )


def _path(name: str) -> str:
    return repr(name) if name else "(the model itself)"


def _is_tensor(value: object) -> bool:
    return isinstance(value, Tensor)


def signature_of(model: nn.Module) -> inspect.Signature | None:
    """The signature of ``model``'s forward, to name its inputs; None if it has none."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def input_sizes(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], signature: inspect.Signature | None = None
) -> dict[str, list[int]]:
    """The shape of every tensor among the inputs, by the name of its argument.

    Inputs are bound to ``signature`` (the model's forward), so ``model(x)`` and
    ``model(x=x)`` name their input alike, ``x``; a tensor inside a structure
    adds its path within (``past[0][1]``). Without a signature, or where the
    inputs do not bind, a positional input is named by its index (``[0]``).
    """
    named: list[tuple[str, Any]] = []
    if signature is not None:
        try:
            named = list(signature.bind(*args, **kwargs).arguments.items())
        except TypeError:
            named = []
    if not named:
        named = [(f"[{i}]", value) for i, value in enumerate(args)] + list(kwargs.items())
    sizes: dict[str, list[int]] = {}
    for name, value in named:
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, Tensor):
                sizes[name + pytree.keystr(path)] = list(leaf.shape)
    return sizes


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def samples_step(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    samples: Sequence[Any] | None,
    signature: inspect.Signature | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any], list[dict[str, list[int]]]]:
    """The inputs to plan for and the input sizes of every sample.

    Without ``samples`` that is ``args`` and ``kwargs``. With them, each sample
    is one batch: a dict (keyword inputs), a tuple or list (positional inputs)
    or a tensor (the one positional input); the plan is made for the largest,
    by the number of elements of its tensor inputs (the first of equals).

    Raises:
        TypeError: samples together with inputs; an empty or malformed list.
    """
    if samples is None:
        return args, kwargs, [input_sizes(args, kwargs, signature)]
    if args or kwargs:
        raise TypeError(
            "forget: pass the step's inputs either as plan(model, *args, **kwargs) or as "
            f"samples=[...], not both (got {len(args)} positional and "
            f"{sorted(kwargs)} keyword inputs besides samples)"
        )
    if isinstance(samples, Tensor | Mapping | str) or not isinstance(samples, Sequence):
        raise TypeError(
            "forget: samples is a list of batches, each a dict of keyword inputs, a tuple "
            f"of positional inputs or a tensor, got {type(samples).__name__}"
        )
    if not samples:
        raise TypeError("forget: samples is empty; give at least one batch")
    batches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    for i, sample in enumerate(samples):
        if isinstance(sample, Tensor):
            batches.append(((sample,), {}))
        elif isinstance(sample, Mapping):
            batches.append(((), dict(sample)))
        elif isinstance(sample, tuple | list):
            batches.append((tuple(sample), {}))
        else:
            raise TypeError(
                f"forget: sample {i} is {type(sample).__name__}; a sample is a dict of "
                "keyword inputs, a tuple of positional inputs or a tensor"
            )
    sizes = [input_sizes(a, k, signature) for a, k in batches]
    largest = max(range(len(batches)), key=lambda i: (sum(map(_numel, sizes[i].values())), -i))
    return (*batches[largest], sizes)


class LargerInputs:
    """A forward pre-hook warning once when an input is larger than any planned for.

    NOTE [larger inputs]: a plan's measured peak holds for the inputs it was
    planned with. Activations grow with the input (linearly in tokens for a
    transformer's projections, quadratically for eager attention's scores), so
    a tensor input with more elements than any sample had may need more than
    the budget; the hook says so once per applied plan. Inputs no larger than
    planned are not measured either; their activations are no larger, so the
    step stays within the budget as far as activations go, but kernels may
    choose other workspaces for other shapes: plan with ``samples=`` covering
    the shapes you run to have each measured.
    """

    def __init__(
        self,
        sizes: Sequence[Mapping[str, Sequence[int]]],
        budget_bytes: int,
        signature: inspect.Signature | None,
    ) -> None:
        self.max_numel: dict[str, int] = {}
        for sample in sizes:
            for path, shape in sample.items():
                self.max_numel[path] = max(self.max_numel.get(path, 0), _numel(shape))
        self.budget_bytes = budget_bytes
        self.signature = signature
        self.warned = False

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.warned or torch.compiler.is_compiling():
            return
        for path, shape in input_sizes(args, kwargs, self.signature).items():
            planned = self.max_numel.get(path)
            if planned is not None and _numel(shape) > planned:
                self.warned = True
                warnings.warn(
                    f"forget: input {path} has shape {tuple(shape)} ({_numel(shape):,} "
                    f"elements), more than the {planned:,} of any input the plan was made "
                    f"for, so the step may need more than the budget of "
                    f"{self.budget_bytes:,} B (NOTE [larger inputs]); plan again with "
                    "samples=[...] including a batch this large",
                    UserWarning,
                    stacklevel=2,
                )
                return
