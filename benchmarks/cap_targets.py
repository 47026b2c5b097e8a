"""Figures for `forget.cap` (issue 31): peak / cap per step of runs whose shapes vary, and times.

For each model (Hugging Face Llama, GPT-2 and BERT from small configs with 64 to
512 tokens; a ResNet with BatchNorm with batches of 4 to 16), the plain step's
peak at the largest shape is measured by the allocator (``forget.measure(...,
probe="profiler")``); then, under caps at 75 % and 50 % of it, a run of steps
whose shapes vary (the largest last but one, a small one first) is measured step
by step: peak / cap, regions evicted, the runtime's estimate. ``--times`` adds,
at the largest shape, the capped step's time against plain (a cap never reached:
1e12 bytes), against the cap at 50 %, and against a ``forget.plan`` at that
budget and layer checkpointing, medians of interleaved rounds, by the wall
clock and by the process's CPU time (less moved by other processes on a
loaded machine), with the regions the cap evicted and the plan's choices. ``--floor`` adds,
per shape, the peak with every default candidate region that has none inside it
forgotten (`forget.apply_forget`): about the least any choice of those regions
reaches, to tell a cap that cannot hold from a runtime that evicts badly.
``--largest-first`` runs the largest shape first, with nothing learned.
``--partial none`` caps with whole regions only (``_cap_with(..., partial=None)``,
the cap with its defaults open; the default is ``"selective"``, NOTE [partial evictions]).
``--passes 3`` runs the shapes three times over: from the second step of a
shape on, the cap repeats its decision (NOTE [steps of known shapes]).
``--split`` times instead, by CPU time, the forward and the backward of the
plain step and of the step under a cap never reached, at the largest shape.
``--calls`` counts instead the Python calls (cProfile's, C functions included)
of that forward and that backward, after two warm-up steps: a figure the
machine's load does not move. With either, ``--candidates model,lm_head`` caps
those regions only (names, as `forget.cap` takes them) instead of the default.

``--evictions dtr,largest,first_run,cheapest_per_byte`` runs the same caps once
per eviction order (NOTE [eviction order]) instead, side by side: per order the
largest peak / cap of the run, the regions evicted over its steps, and what
their re-runs cost: the evicted regions' forward FLOPs over the run's forward
FLOPs (``torch.utils.flop_counter`` on the plain model at each shape, attention
run eagerly so that its matmuls count; elementwise ops count nothing), and the
evicted regions' forward time as the cap's own records have it
(`StepReport.evicted_forward_s`, a wall-clock figure).

    PYTHONPATH=src python benchmarks/cap_targets.py [--models llama,gpt2,bert,resnet]
        [--times] [--rounds 5] [--floor] [--largest-first] [--passes 3] [--evictions dtr,largest]
        [--split] [--calls] [--candidates NAMES] [--partial none]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import forget
from forget._planning import time_calls
from forget._runtime._cap import _cap_with

tf: Any = transformers

TOKENS = (128, 512, 64, 256, 384)
BATCHES = (8, 16, 4, 12)


def _lm(config: Any, cls: Any) -> Callable[[int], tuple[nn.Module, dict[str, Any]]]:
    def make(tokens: int) -> tuple[nn.Module, dict[str, Any]]:
        torch.manual_seed(0)
        ids = torch.randint(1, config.vocab_size, (2, tokens))
        return cls(config).train(), {"input_ids": ids, "labels": ids}

    return make


def models() -> dict[
    str, tuple[Callable[[int], tuple[nn.Module, dict[str, Any]]], tuple[int, ...]]
]:
    small = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4}
    llama = tf.LlamaConfig(
        **small,
        num_hidden_layers=4,
        intermediate_size=128,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    gpt2 = tf.GPT2Config(
        vocab_size=256, n_embd=64, n_head=4, n_layer=4, n_positions=512, use_cache=False
    )
    bert = tf.BertConfig(
        **small, num_hidden_layers=4, intermediate_size=128, max_position_embeddings=512
    )
    resnet = tf.ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[16, 32, 64],
        depths=[2, 2, 2],
        layer_type="basic",
        num_labels=10,
    )

    def make_resnet(batch: int) -> tuple[nn.Module, dict[str, Any]]:
        torch.manual_seed(0)
        x = torch.randn(batch, 3, 64, 64)
        return tf.ResNetForImageClassification(resnet).train(), {
            "pixel_values": x,
            "labels": torch.arange(batch) % 10,
        }

    return {
        "llama": (_lm(llama, tf.LlamaForCausalLM), TOKENS),
        "gpt2": (_lm(gpt2, tf.GPT2LMHeadModel), TOKENS),
        "bert": (_lm(bert, tf.BertForMaskedLM), TOKENS),
        "resnet": (make_resnet, BATCHES),
    }


def step_of(model: nn.Module, inputs: dict[str, Any]) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()

    return step


def peak(model: nn.Module, inputs: dict[str, Any]) -> int:
    model.zero_grad(set_to_none=True)
    gc.collect()
    return forget.measure(step_of(model, inputs), probe="profiler").peak_bytes


def run_peaks(
    name: str, largest_first: bool = False, passes: int = 1, partial: str | None = None
) -> None:
    make, shapes = models()[name]
    largest = max(shapes)
    if largest_first:  # the hardest first step: nothing learned, the largest shape
        shapes = (largest, *(shape for shape in shapes if shape != largest))
    model, big = make(largest)
    plain = peak(model, big)
    print(f"## {name}: plain peak at {largest} = {plain:,} B")
    for share in (0.75, 0.5):
        budget = int(plain * share)
        capped = copy.deepcopy(model)
        handle = _cap_with(capped, budget, partial=partial)
        row = []
        for shape in shapes * passes:
            _, inputs = make(shape)
            try:
                got = peak(capped, inputs)
            except forget.ForgetError as error:
                row.append(f"{shape}: error ({str(error)[:90]}...)")
                continue
            report = handle.steps[-1]
            mark = " repeated" if report.repeated else ""
            part = f", {len(report.partial)} in part" if report.partial else ""
            row.append(
                f"{shape}: {got / budget:.3f} ({len(report.evicted)}/{len(report.regions)} "
                f"evicted{part}{mark}, est {report.estimated_peak_bytes / budget:.3f})"
            )
        handle.remove()
        print(f"  cap {share:.0%} = {budget:,} B: " + "; ".join(row))


def run_floor(name: str) -> None:
    make, shapes = models()[name]
    model, big = make(max(shapes))
    budget = peak(model, big)
    names = forget.cap(copy.deepcopy(model), 10**12).names
    leaves = [n for n in names if not any(other.startswith(f"{n}.") for other in names)]
    row = []
    for shape in shapes:
        _, inputs = make(shape)
        got = peak(forgotten_copy(model, leaves), inputs)
        row.append(f"{shape}: {got:,} B ({got / budget:.3f} of plain at {max(shapes)})")
    print(f"  every region with none inside forgotten ({len(leaves)}): " + "; ".join(row))


def forgotten_copy(model: nn.Module, names: list[str]) -> nn.Module:
    """A copy of ``model`` with the submodules ``names`` forgotten."""
    forgotten = copy.deepcopy(model)
    chosen = {id(forgotten.get_submodule(name)) for name in names}
    return forget.apply_forget(forgotten, lambda m: id(m) in chosen)


def region_flops(model: nn.Module, inputs: dict[str, Any], names: tuple[str, ...]) -> list[int]:
    """The forward FLOPs of the model, then of each named region, at these inputs."""
    counted: Any = copy.deepcopy(model)
    if hasattr(counted, "set_attn_implementation"):
        counted.set_attn_implementation("eager")  # matmuls the counter sees
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        counted(**inputs)
    flops = {key: sum(per.values()) for key, per in counter.get_flop_counts().items()}
    root = type(model).__name__
    return [flops[root], *(flops.get(f"{root}.{n}", 0) for n in names)]


def run_evictions(name: str, evictions: list[str]) -> None:
    make, shapes = models()[name]
    model, big = make(max(shapes))
    plain = peak(model, big)
    names = forget.cap(copy.deepcopy(model), 10**12).names
    flops = {shape: region_flops(model, make(shape)[1], names) for shape in shapes}
    print(f"## {name}: plain peak at {max(shapes)} = {plain:,} B; eviction orders")
    for share in (0.75, 0.5):
        budget = int(plain * share)
        for eviction in evictions:
            capped = copy.deepcopy(model)
            handle = _cap_with(capped, budget, eviction=eviction)
            ratios, evicted, rerun, total, rerun_s, errors = [], 0, 0, 0, 0.0, []
            for shape in shapes:
                _, inputs = make(shape)
                try:
                    got = peak(capped, inputs)
                except forget.ForgetError:
                    errors.append(str(shape))
                    continue
                report = handle.steps[-1]
                ratios.append(got / budget)
                evicted += len(report.evicted)
                total += flops[shape][0]
                rerun += sum(flops[shape][1 + names.index(r)] for r in report.evicted)
                rerun_s += report.evicted_forward_s
            handle.remove()
            print(
                f"  cap {share:.0%} {eviction}: max peak/cap {max(ratios, default=0):.3f} "
                f"(per step {' '.join(f'{r:.3f}' for r in ratios)}); evicted {evicted}; "
                f"re-run FLOPs {rerun / max(total, 1):.3f} of the forward's; "
                f"re-run {rerun_s * 1e3:.1f} ms; ForgetError at {','.join(errors) or '-'}"
            )


def run_times(name: str, rounds: int, partial: str | None = None) -> None:
    make, shapes = models()[name]
    model, inputs = make(max(shapes))
    if not getattr(model, "supports_gradient_checkpointing", True):
        print(f"## {name} times: skipped (no layer checkpointing to compare with)")
        return
    plain_peak = peak(model, inputs)
    budget = plain_peak // 2
    never = copy.deepcopy(model)
    forget.cap(never, 10**12)
    capped = copy.deepcopy(model)
    handle = _cap_with(capped, budget, partial=partial)
    layers: Any = copy.deepcopy(model)
    layers.activation_checkpointing_enable({"use_reentrant": False})
    calls = {
        "plain": step_of(model, inputs),
        "cap never reached": step_of(never, inputs),
        "cap 50%": step_of(capped, inputs),
        "layer checkpointing": step_of(layers, inputs),
    }
    try:
        planned = copy.deepcopy(model)
        fitted = forget.plan(planned, budget=budget, **inputs)
        fitted.apply(planned)
        calls["plan 50%"] = step_of(planned, inputs)
    except forget.ForgetError as error:
        print(f"  plan at 50%: {error}")
    cpu_s: dict[str, list[float]] = {key: [] for key in calls}
    rounds_s = time_calls({key: cpu_timed(call, cpu_s[key]) for key, call in calls.items()}, rounds)
    print(f"## {name} times at {max(shapes)} (medians of {rounds} interleaved rounds)")
    for label, per_call in (("wall", rounds_s), ("cpu", cpu_s)):
        # time_calls's warm-up round is recorded by cpu_timed too: drop it
        times = {key: statistics.median(ts[-rounds:]) for key, ts in per_call.items()}
        base = times["plain"]
        for key, value in times.items():
            print(f"  {label} {key}: {value * 1e3:.1f} ms ({value / base:.3f} x plain)")
        if "plan 50%" in times:
            print(
                f"  {label} cap 50% / plan 50%: {times['cap 50%'] / times['plan 50%']:.3f}; "
                f"cap 50% / layer checkpointing: "
                f"{times['cap 50%'] / times['layer checkpointing']:.3f}"
            )
    report = handle.steps[-1]
    print(
        f"  cap 50% evicted {len(report.evicted)}/{len(report.regions)}: "
        f"{', '.join(report.evicted) or '-'} (their forward {report.evicted_forward_s * 1e3:.1f}"
        f" ms as the last step timed it; estimate {report.estimated_peak_bytes / budget:.3f}"
        f" of the cap); in part: {', '.join(report.partial) or '-'}"
    )
    if "plan 50%" in calls:
        chosen = ", ".join(f"{region}={choice}" for region, choice in fitted.choices.items())
        print(
            f"  plan 50% runs as: {chosen or '-'} (measured peak "
            f"{fitted.measured_peak_bytes / budget:.3f} of the budget)"
        )


def cpu_timed(call: Callable[[], None], into: list[float]) -> Callable[[], None]:
    """``call``, appending the process's CPU seconds of each run to ``into``.

    CPU time counts only this process's work, so other processes on a loaded
    machine move it far less than the wall clock (with one torch thread).
    """

    def timed() -> None:
        start = time.process_time()
        call()
        into.append(time.process_time() - start)

    return timed


def run_split(name: str, rounds: int, candidates: list[str] | None = None) -> None:
    """CPU time of the forward and of the backward, plain and under a cap never reached."""
    make, shapes = models()[name]
    model, inputs = make(max(shapes))
    never = copy.deepcopy(model)
    forget.cap(never, 10**12, candidates=candidates)
    split: dict[str, tuple[list[float], list[float]]] = {"plain": ([], []), "never": ([], [])}
    for round_ in range(rounds + 2):  # two warm-up rounds; the order alternates
        pairs = [("plain", model), ("never", never)]
        for key, net in pairs if round_ % 2 else pairs[::-1]:
            net.zero_grad(set_to_none=True)
            start = time.process_time()
            loss = net(**inputs).loss
            middle = time.process_time()
            loss.backward()
            if round_ >= 2:
                split[key][0].append(middle - start)
                split[key][1].append(time.process_time() - middle)
            del loss
    (pf, pb), (nf, nb) = ([statistics.median(t) * 1e3 for t in ts] for ts in split.values())
    print(
        f"## {name} at {max(shapes)}, CPU ms (medians of {rounds} alternating steps): forward "
        f"{pf:.2f} -> {nf:.2f} under a cap never reached, backward {pb:.2f} -> {nb:.2f}"
    )


def run_calls(name: str, candidates: list[str] | None = None) -> None:
    """cProfile's count of calls in one forward and one backward, plain and under a cap
    never reached, at the largest shape (after two warm-up steps)."""
    make, shapes = models()[name]
    model, inputs = make(max(shapes))
    never = copy.deepcopy(model)
    forget.cap(never, 10**12, candidates=candidates)
    counts = []
    for net in (model, never):
        for _ in range(3):  # two warm-up steps, then the one counted
            net.zero_grad(set_to_none=True)
            forward, backward = cProfile.Profile(), cProfile.Profile()
            forward.enable()
            loss = net(**inputs).loss
            forward.disable()
            backward.enable()
            loss.backward()
            backward.disable()
            del loss
        stats = [pstats.Stats(p) for p in (forward, backward)]
        counts.append([s.total_calls for s in stats])  # type: ignore[attr-defined]
    (pf, pb), (nf, nb) = counts
    print(
        f"## {name} at {max(shapes)}, Python calls: forward {pf} -> {nf} under a cap never "
        f"reached, backward {pb} -> {nb}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gpt2,bert,resnet")
    parser.add_argument("--times", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--largest-first", action="store_true")
    parser.add_argument("--passes", type=int, default=1, help="run the shapes this many times")
    parser.add_argument("--evictions", default=None, help="compare these eviction orders")
    parser.add_argument("--split", action="store_true", help="forward and backward CPU time")
    parser.add_argument("--calls", action="store_true", help="forward and backward Python calls")
    parser.add_argument("--candidates", default=None, help="regions of --split and --calls")
    parser.add_argument(
        "--partial",
        default="selective",
        type=lambda name: None if name == "none" else name,
        help="forget.cap's partial= (selective, or none)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    candidates = args.candidates.split(",") if args.candidates else None
    for name in args.models.split(","):
        if args.split:
            run_split(name, args.rounds, candidates)
            continue
        if args.calls:
            run_calls(name, candidates)
            continue
        if args.evictions:
            run_evictions(name, args.evictions.split(","))
            continue
        run_peaks(name, args.largest_first, args.passes, args.partial)
        if args.floor:
            run_floor(name)
        if args.times:
            run_times(name, args.rounds, args.partial)


if __name__ == "__main__":
    main()
