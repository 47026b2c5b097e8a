"""What every command shares: targets, argument parsing, budgets, errors, progress bars, plots.

Each command module (`_demo`, `_bench`, `_plan`, `_profile`) imports from here
and from the public names of the other packages, never from another command.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from .. import checkpoint, policies
from .._memory import budget_bytes as read_budget
from ..policies import Policy
from ..schedules import MIB
from ._models import MODEL_NAMES, BlockModel, BlockWrapper, build_model, model_settings

#: The budget of one plan, as every command reads it: what `forget.plan` takes
#: (NOTE [one budget] in `forget._memory`: bytes, ``"512MiB"``, ``"50%"``; the
#: commands run on the CPU, so no ``"free"``), or ``min``, the least feasible budget.
BUDGET_HELP = "bytes, a size (512MiB), a share of the plain peak (50%%) or 'min'"


def check_budget(label: str) -> None:
    """Raise ``ValueError`` before any work if ``label`` is no budget (`resolve_budget`)."""
    if label != "min":
        read_budget(label, 1 << 40, None)


def resolve_budget(label: str, plain_peak_bytes: int, min_feasible_bytes: int) -> int:
    """The budget ``label`` in bytes (``min``: ``min_feasible_bytes``)."""
    if label == "min":
        return min_feasible_bytes
    return read_budget(label, plain_peak_bytes, None)


def above_plain_note(budget_bytes: int, plain_peak_bytes: int) -> str:
    """The note for a budget at or above the plain step's peak: nothing need be forgotten."""
    return (
        f"the budget {budget_bytes:,} B is at or above the plain step's peak, "
        f"{plain_peak_bytes:,} B: the plain step fits, so nothing is forgotten"
    )


def _torch_checkpoint(block: nn.Module, h: Tensor) -> Tensor:
    out: Tensor = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
    return out


def _forget_checkpoint(block: nn.Module, h: Tensor) -> Tensor:
    out: Tensor = checkpoint(block, h)
    return out


#: How ``forget bench`` runs each block, per variant (``None``: plainly).
BLOCK_WRAPPERS: dict[str, BlockWrapper | None] = {
    "plain": None,
    "torch_checkpoint": _torch_checkpoint,
    "forget": _forget_checkpoint,
}


# ---------------------------------------------------------------- output


def mib(n_bytes: int) -> str:
    """A table cell in MiB, to the KiB: ``7.212``."""
    return f"{n_bytes / MIB:.3f}"


def plot_hint(flag: str) -> str:
    """The message for a PNG flag without matplotlib."""
    return (
        f"forget: {flag} needs matplotlib; install it with pip install matplotlib "
        "(the [plot] extra)"
    )


def require_matplotlib(flag: str) -> None:
    """Raise ``ValueError(plot_hint(flag))`` without matplotlib: fail before the run, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(plot_hint(flag)) from None


def draw_plans(
    ax: Any,
    plain_peak_bytes: int,
    plans: Sequence[tuple[int, float, float | None]],
    budgets: Sequence[tuple[str, int]] = (),
) -> None:
    """Finish a Pareto axis (peak MiB against step-time overhead %): plain, plans, budgets, labels.

    ``plans``: per plan, its measured peak in bytes, its predicted overhead and
    its measured overhead (None: not timed), both fractions of the plain step's
    time. Like with like: a plan is drawn where the curves are (measured peak,
    predicted time) and again at its measured time, which carries the run's
    timing noise. ``budgets``: ``(label, bytes)`` of each budget planned, a
    dashed vertical line each, named above the axes: a plan lies on or left of
    its budget's line. The legend goes under the axes, where it covers no point
    (the figure's constrained layout makes room for it).
    """
    for i, (label, budget_bytes) in enumerate(budgets):
        ax.axvline(
            budget_bytes / MIB,
            color="gray",
            linestyle="--",
            linewidth=1,
            label="the budgets (--budgets): a plan's peak lies on or left of its own"
            if i == 0
            else None,
        )
        ax.annotate(
            label,
            (budget_bytes / MIB, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
            color="gray",
        )
    ax.plot(
        [plain_peak_bytes / MIB], [0.0], "k^", markersize=9, label="store-all (plain, predicted)"
    )
    ax.plot(
        [peak / MIB for peak, _, _ in plans],
        [100 * predicted for _, predicted, _ in plans],
        "r*",
        markersize=11,
        label="our plans (measured peak, predicted time)",
    )
    timed = [(peak, measured) for peak, _, measured in plans if measured is not None]
    if timed:
        ax.plot(
            [peak / MIB for peak, _ in timed],
            [100 * measured for _, measured in timed],
            "rx",
            markersize=7,
            label="our plans (measured peak, measured time, noisy)",
        )
    ax.set_xlabel("peak memory of one training step (MiB)")
    ax.set_ylabel("time recomputation adds (% of plain)")
    ax.grid(alpha=0.3)
    # Under the axes by a fixed distance, past the tick labels and the x label (a share of
    # the axes' height overlapped the label where the axes are short).
    from matplotlib.transforms import ScaledTranslation

    below = ax.transAxes + ScaledTranslation(0, -36 / 72, ax.figure.dpi_scale_trans)
    ax.legend(
        fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below, frameon=False
    )


def wrote(path: Path, what: str) -> None:
    """Say on stdout what a command wrote, and where."""
    print(f"wrote {path}: {what}")


_NO_TQDM_NOTE = (
    "forget: no progress bars: tqdm is not installed; "
    "pip install tqdm (the [cli] extra) adds them (--quiet hides this note)."
)
_noted_no_tqdm = False


class Progress:
    """A tqdm bar on a terminal, unless ``--quiet``; otherwise nothing.

    NOTE [bars on a terminal]: a bar redraws its one line with carriage returns,
    which only a terminal reads as such: in a file or a pipe every frame stays,
    and the line after the last one (an error, a warning) is glued to it. So a
    bar is drawn only where stderr is a terminal, and while it is drawn Python's
    warnings are written above it (``tqdm.write``), not across it. `close`
    clears the bar's line and puts the warnings back; every command closes its
    bar before it prints an error. Without tqdm, the first bar of the process
    that a terminal would show says once, on stderr, how to get one.
    """

    def __init__(self, total: int, enabled: bool, desc: str, unit: str = "step") -> None:
        global _noted_no_tqdm
        self._bar: Any = None
        self._showwarning: Any = None
        if not enabled or not _on_terminal(sys.stderr):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            if not _noted_no_tqdm:
                _noted_no_tqdm = True
                print(_NO_TQDM_NOTE, file=sys.stderr)
            return
        self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
        self._showwarning = warnings.showwarning

        def above_the_bar(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            text = warnings.formatwarning(message, category, filename, lineno, line)
            tqdm.write(text.rstrip("\n"), file=sys.stderr)

        warnings.showwarning = above_the_bar

    def update(self, label: str) -> None:
        """Count one unit of work done; ``label`` says which."""
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        """Clear the bar's line (the cursor at its start) and put the warnings back."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            warnings.showwarning = self._showwarning


def _on_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


# ---------------------------------------------------------------- models


def model_and_inputs(
    spec: str,
    size: str,
    seed: int,
    input_shape: str | None,
    settings: dict[str, int | float] | None = None,
) -> tuple[str, Any, tuple[Any, ...]]:
    """Build a reference model by name, or a user's ``module:factory``, and sample inputs.

    ``settings`` (``--set``) replace a reference model's preset keyword arguments.
    """
    if settings and spec not in MODEL_NAMES:
        raise ValueError(f"forget: --set changes reference models only, not {spec}")
    if spec in MODEL_NAMES:
        settings = settings or {}
        known = model_settings(spec, size)
        unknown = sorted(settings.keys() - known.keys())
        if unknown:
            raise ValueError(
                f"forget: --set {', '.join(unknown)}: {spec} takes "
                + ", ".join(f"{k} (now {v})" for k, v in known.items())
            )
        try:
            model: Any = build_model(spec, size, seed=seed, **settings)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"forget: --set for {spec}: {str(exc).removeprefix('forget: ')}"
            ) from exc
    else:
        if ":" not in spec:
            raise ValueError(
                f"forget: expected a model name ({', '.join(MODEL_NAMES)}) or module:factory, "
                f"got {spec!r}"
            )
        model = call_factory(spec, seed)
        if isinstance(model, tuple):
            raise ValueError(
                f"forget: {spec}() returned a tuple, (model, batch), which forget plans over its "
                f"module tree: forget plan {spec} (--model and --input-shape take a factory "
                "that returns a chain alone)"
            )
    return chain_inputs(spec, model, seed, input_shape)


def chain_inputs(
    spec: str, model: Any, seed: int, input_shape: str | None
) -> tuple[str, Any, tuple[Any, ...]]:
    """A chain's random input batch: a reference model's own, or ``--input-shape``'s."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, BlockModel):
        return spec, model, model.example_input(generator=generator)
    if input_shape is None:
        raise ValueError(
            f"forget: {spec} is not a reference model; give its input with --input-shape N,D"
        )
    return spec, model, (torch.randn(parse_shape(input_shape), generator=generator),)


def chain_step(model: Any, inputs: tuple[Any, ...]) -> UserStep:
    """The step `forget.plan` plans for a reference model or a chain, as a factory's step.

    A reference model's ``(input, target)`` becomes its input and a loss
    against the target; a list of blocks, the ``nn.Sequential`` of them.
    """
    if isinstance(model, BlockModel):
        x, target = inputs
        return UserStep(model, (x,), {}, functools.partial(_reference_loss, model, target))
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        model = nn.Sequential(*model)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"forget: expected an nn.Module or a list of blocks, got {type(model).__name__}"
        )
    return UserStep(model, inputs, {}, None)


def _reference_loss(model: BlockModel, target: Tensor, output: Tensor) -> Tensor:
    return model.loss(output, target)


def load_factory(spec: str) -> Callable[[], Any]:
    """Return the callable named by ``module:factory`` or ``path/to/file.py:factory``.

    A module is imported with the current directory searched first; a ``.py``
    path is run as a module of its own, with its directory searched first (its
    sibling modules import). Every failure is a one-line ``ValueError``.
    """
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise ValueError(
            f"forget: expected module:factory or path/to/file.py:factory (a module or a "
            f"Python file, a colon, then the function to call), got {spec!r}"
        )
    module = _import_file(Path(source)) if source.endswith(".py") else _import_module(source)
    if not hasattr(module, attr):
        defined = [
            name
            for name, value in vars(module).items()
            if callable(value)
            and not name.startswith("_")
            and getattr(value, "__module__", None) == module.__name__
        ]
        some = f"; it defines {', '.join(defined[:6])}" if defined else ""
        raise ValueError(
            f"forget: {source}:{attr} is not a callable factory: {source} has no "
            f"attribute {attr!r}{some}"
        )
    factory = getattr(module, attr)
    if not callable(factory):
        raise ValueError(
            f"forget: {source}:{attr} is not a callable factory (type {type(factory).__name__})"
        )
    return factory  # type: ignore[no-any-return]


def call_factory(spec: str, seed: int) -> Any:
    """Call the factory ``spec`` names (`load_factory`), torch seeded by ``seed``."""
    factory = load_factory(spec)
    torch.manual_seed(seed)
    try:
        return factory()
    except Exception as exc:  # a user's factory: report it as a usage error
        raise ValueError(f"forget: {spec}() raised {first_line(exc)}") from exc


_CONTRACT = (
    "return (model, batch) or (model, batch, loss_fn): an nn.Module, a tuple of "
    "positional inputs or a dict of keyword inputs (or one tensor), and optionally "
    "output -> scalar loss"
)


@dataclass(frozen=True)
class UserStep:
    """What a factory returned, checked (NOTE [factory contract] in `._plan_tree`)."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], Tensor] | None


def load_step(spec: str, seed: int, command: str = "plan") -> UserStep:
    """Call the factory ``spec`` names and check what it returned (NOTE [factory contract]).

    Raises:
        ValueError: one line: ``spec`` names no callable, the factory raised, or
            it returned something else than the contract's tuple.
    """
    return check_factory_output(spec, call_factory(spec, seed), command)


def check_factory_output(spec: str, out: object, command: str = "plan") -> UserStep:
    """Read ``(model, batch[, loss_fn])`` (NOTE [factory contract]); a one-line ValueError else.

    ``command`` (``plan``, ``profile``) names the command in the hint for a factory
    that returns a chain alone.
    """
    if isinstance(out, nn.Module):
        chain = "--model module:factory" if command == "plan" else "module:factory"
        raise ValueError(
            f"forget: {spec}() returned only the model ({type(out).__name__}); {_CONTRACT} "
            f"(a chain with a random input: forget {command} {chain} --input-shape ...)"
        )
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise ValueError(f"forget: {spec}() must {_CONTRACT}; it returned {_describe(out)}")
    model, batch = out[0], out[1]
    loss_fn = out[2] if len(out) == 3 else None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"forget: {spec}() returned a model of type {type(model).__name__}, not an "
            f"nn.Module; {_CONTRACT}"
        )
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    if isinstance(batch, Tensor):
        args = (batch,)
    elif isinstance(batch, tuple):
        args = batch
    elif isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
        kwargs = dict(batch)
    else:
        raise ValueError(
            f"forget: {spec}() returned a batch of type {type(batch).__name__}; the batch is "
            "a tuple of positional inputs (model(*batch)), a dict of keyword inputs with "
            "str keys (model(**batch)), or one tensor"
            + (": make the list a tuple" if isinstance(batch, list) else "")
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(
            f"forget: {spec}() returned a loss_fn of type {type(loss_fn).__name__}; the third "
            "item is a callable, output -> scalar loss (or None, or leave it out)"
        )
    return UserStep(model, args, kwargs, loss_fn)


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        items = ", ".join(type(v).__name__ for v in value)
        return f"a tuple of {len(value)} ({items})"
    return f"a {type(value).__name__}"


def first_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, cut to its first line (for one-line errors)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def describe_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A module call's inputs in one line: ``(float32[4, 16], mask=None)``."""

    def one(value: Any) -> str:
        if isinstance(value, Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        if value is None or isinstance(value, bool | int | float):
            return repr(value)
        return type(value).__name__

    items = [one(v) for v in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(items[:8]) + (", ..." if len(items) > 8 else "") + ")"


#: Set (to anything but 0) to have every command print a failing step's whole trace.
TRACEBACK_ENV = "FORGET_TRACEBACK"
TRACEBACK_HELP = (
    f"where your model, batch or loss raises, print the whole trace before the one-line "
    f"error (or set {TRACEBACK_ENV}=1)"
)


def step_error(exc: BaseException, spec: str, model: nn.Module | None, show: bool) -> str | None:
    """The one line a command prints for an error of the user's step, or None for a bug.

    NOTE [the user's errors]: what a user's model, batch or loss function
    raises while forget runs the step is a broken target, like a factory
    that does not load: one ``forget:`` line and exit status 2, not a trace
    through the planner. The line names the innermost call of a module of
    ``model`` that the error passed through (found in the traceback, where
    torch's ``Module._call_impl`` holds the module and its inputs) with the
    inputs it got. A ``forget:`` error about the step is printed as it is.
    Anything else, raised in forget's own code, is a bug in forget and
    keeps its trace (None). ``show`` (``--traceback``, or `TRACEBACK_ENV`)
    prints the whole trace before the line.
    """
    text = str(exc)
    if isinstance(exc, TypeError | ValueError) and text.startswith("forget:"):
        line = text
    else:
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        if not frames or _in_forget(frames[-1].f_code.co_filename):
            return None
        where = _failed_call(frames, model)
        line = (
            f"forget: the step of {spec} failed{where}: {first_line(exc)}; fix the model or "
            f"what the factory gives it (--traceback or {TRACEBACK_ENV}=1 prints the whole trace)"
        )
    if show or os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    return line


_FORGET_SOURCE = str(Path(__file__).resolve().parent.parent)


def _in_forget(filename: str) -> bool:
    return str(Path(filename).resolve()).startswith(_FORGET_SOURCE + os.sep)


def _failed_call(frames: Sequence[Any], model: nn.Module | None) -> str:
    """``" calling blocks.1 (Inner) with (float32[4, 16])"``: the innermost module call."""
    if model is None:
        return ""
    names = {id(module): name for name, module in model.named_modules()}
    for frame in reversed(frames):
        local = frame.f_locals
        module = local.get("self")
        if frame.f_code.co_name == "_call_impl" and id(module) in names:
            name = names[id(module)] or "the model"
            inputs = describe_inputs(local.get("args", ()), local.get("kwargs") or {})
            return f" calling {name} ({type(module).__name__}) with {inputs}"
    return ""


@contextlib.contextmanager
def _searched_first(folder: Path) -> Iterator[None]:
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        if entry in sys.path:
            sys.path.remove(entry)


def _import_module(name: str) -> ModuleType:
    with _searched_first(Path.cwd()):
        try:
            return importlib.import_module(name)
        except Exception as exc:  # a user's module: report any failure as a usage error
            raise ValueError(f"forget: cannot import {name!r}: {first_line(exc)}") from exc


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ValueError(f"forget: cannot import {str(path)!r}: no such file")
    # A name of its own, so that the file neither shadows nor is shadowed by an
    # installed module of its stem's name; re-run on every load.
    name = f"_forget_factory_{''.join(c if c.isalnum() else '_' for c in path.stem)}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"forget: cannot import {str(path)!r}: not a Python source file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    with _searched_first(path.resolve().parent):
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # a user's file: report any failure as a usage error
            sys.modules.pop(name, None)
            raise ValueError(f"forget: cannot import {str(path)!r}: {first_line(exc)}") from exc
    return module


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``--input-shape 64,512`` (commas or x) into a tuple of positive ints."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"forget: --input-shape takes positive sizes like 64,512, got {text!r}")
    return shape


def parse_setting(text: str) -> tuple[str, int | float]:
    """``"context=512"`` -> ``("context", 512)``; ``"dropout=0.0"`` -> ``("dropout", 0.0)``."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    number: int | float | None = None
    for kind in (int, float):
        try:
            number = kind(value)
            break
        except ValueError:
            continue
    if not sep or not key.isidentifier() or number is None:
        raise ValueError(
            f"forget: --set takes KEY=NUMBER, e.g. context=512 or dropout=0.0, got {text!r}"
        )
    return key, number


OPTION_GROUPS = ("LINEAR", "CONV", "ATTENTION", "DROPOUT", "MATMUL")


def parse_option(text: str) -> tuple[str, Policy]:
    """``"sel=LINEAR+ATTENTION"`` -> ``("sel", save_outputs_of(*LINEAR, *ATTENTION))``.

    Each ``+``-joined part is a group of `forget.policies` (any case) or an aten
    op name (``bmm``, ``aten.bmm``). ``NAME=REGENERATE`` keeps the stage and
    rebuilds GELU / SiLU / LayerNorm outputs and dropout products and masks in
    backward (`forget.policies.regenerate`).
    """
    name, sep, ops = text.partition("=")
    name, ops = name.strip(), ops.strip()
    if not sep or not name or not ops:
        raise ValueError(
            f"forget: --option takes NAME=OPS, e.g. sel=LINEAR+ATTENTION+DROPOUT, got {text!r}"
        )
    if name in ("kept", "forgotten"):
        raise ValueError(f"forget: --option name {name!r} is taken; choose another")
    if ops.upper() == "REGENERATE":
        return name, policies.regenerate()
    names: list[str] = []
    for part in ops.split("+"):
        part = part.strip()
        if not part:
            raise ValueError(f"forget: --option {text!r} has an empty op between '+'")
        group = part.upper()
        names.extend(getattr(policies, group) if group in OPTION_GROUPS else (part,))
    return name, policies.save_outputs_of(*names)
