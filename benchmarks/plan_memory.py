"""Issue 30's first target: how much memory `forget.plan` itself needs, against the budget.

    python benchmarks/plan_memory.py [--models llama,gpt2,bert,t5,vit,resnet]
        [--budgets 75%,50%,least] [--parts] [--quick]

Measured independently of the planner's own probes, by the operating system:
each call runs in a fresh child process (this script, run again with
``--child``), which builds the model and batch (seeded, from transformers
configs, no downloads), runs one plain step on a sliver of the batch
(`warm_up`: the process's one-time costs), collects garbage, resets its
resident-set high-water mark (Linux: ``5`` written to
``/proc/self/clear_refs``) and reads ``VmRSS`` and ``VmHWM`` from
``/proc/self/status`` before and after the call. The rise
of ``VmHWM`` is the call's memory: what it made the process take from the
system beyond what it held at the reset (memory the allocator already holds,
freed, is reused without a rise). The calls, per model:

* ``plain``: one plain step, ``model(**batch).loss.backward()``, the model's
  gradients ``None`` first; then, in the same child, the plain step's peak by
  the allocator (``forget.measure(step, probe="profiler")``), of which the
  budgets' percentages are taken, so that a percentage is the same number of
  bytes in every row and for every planner;
* ``least``: `forget._planning.TreePlanner`'s ``least()``, the least feasible
  budget measured (a plan at 1 KiB stops at its first guarded forward and
  names a bound, not the least);
* ``plan``: ``forget.plan(model, budget=B, **batch)`` with ``B`` in bytes; the
  returned `forget.Plan` is saved to a file;
* ``step``: a fresh child loads that plan, applies it, resets the mark and
  runs one step;
* with ``--parts``, ``parts``: `forget._planning.TreePlanner` built alone (the
  profile) and then its ``.plan(B)`` (the search), the mark reset between them.

One row per model and budget: the budget, the plain step's rise, the plan's
rise and wall time, the planned step's rise, each over the budget, and the
plan's own ``measured_peak_bytes`` over the budget. Torch runs one thread. Run
with ``PYTHONPATH`` naming another checkout's ``src`` to measure its planner
(the children inherit the environment).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_NAMES = ("llama", "gpt2", "bert", "t5", "vit", "resnet")
CALLS = ("plain", "least", "plan", "step", "parts")


# ------------------------------------------------------------------ the parent


@dataclass
class Row:
    """One model at one budget: the budget and the children's figures."""

    model: str
    label: str
    budget_bytes: int
    plain: dict[str, Any]
    plan: dict[str, Any]
    step: dict[str, Any]
    parts: dict[str, Any] | None = None


def run_child(
    call: str, model: str, quick: bool, budget_bytes: int = 0, path: str = ""
) -> dict[str, Any]:
    """Run one call in a fresh interpreter; its figures (the last line it prints, JSON)."""
    argv = [sys.executable, __file__, "--child", call, "--models", model, "--budget-bytes"]
    argv += [str(budget_bytes), "--plan-path", path, *(["--quick"] if quick else [])]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": f"{call} exited {done.returncode}: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def budget_of(label: str, plain_peak_bytes: int, least: dict[str, Any]) -> int | None:
    """A budget label (``75%``, ``least`` or bytes) in bytes; None where it has none."""
    if label == "least":
        value = least.get("min_feasible_bytes")
        return int(value) if value is not None else None
    if label.endswith("%"):
        return int(plain_peak_bytes * float(label[:-1]) / 100)
    return int(label)


def measure_model(
    model: str, labels: Sequence[str], quick: bool, parts: bool, log: Callable[[str], None]
) -> list[Row]:
    """The rows of one model, one per budget label."""
    plain = run_child("plain", model, quick)
    log(f"{model}: plain {plain}")
    if "error" in plain:
        return [Row(model, label, 0, plain, plain, {}) for label in labels]
    least = run_child("least", model, quick) if "least" in labels else {}
    if least:
        log(f"{model}: least {least}")
    rows = []
    for label in labels:
        budget = budget_of(label, int(plain["peak_bytes"]), least)
        if budget is None:
            rows.append(Row(model, label, 0, plain, {"error": f"no least: {least}"}, {}))
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "plan.json")
            planned = run_child("plan", model, quick, budget, path)
            log(f"{model} {label}: plan {planned}")
            step = run_child("step", model, quick, budget, path) if "error" not in planned else {}
            log(f"{model} {label}: step {step}")
        split = run_child("parts", model, quick, budget) if parts else None
        if split is not None:
            log(f"{model} {label}: parts {split}")
        rows.append(Row(model, label, budget, plain, planned, step, split))
    return rows


def _ratio(rise: Any, budget: int) -> str:
    return f"{rise / budget:.2f}" if isinstance(rise, int) and budget else "-"


def _bytes(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def table(rows: Sequence[Row]) -> str:
    """The rows as a markdown table (a failed call shows its error below it)."""
    out = [
        "| model | budget | budget B | plain rise B | plan rise B | plan rise / budget "
        "| planned step rise / budget | plan s | plan's measured peak / budget |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        b = r.budget_bytes
        out.append(
            f"| {r.model} | {r.label} | {_bytes(b)} | {_bytes(r.plain.get('rise_bytes'))} "
            f"| {_bytes(r.plan.get('rise_bytes'))} | {_ratio(r.plan.get('rise_bytes'), b)} "
            f"| {_ratio(r.step.get('rise_bytes'), b)} "
            f"| {r.plan['wall_s']:.1f} | {_ratio(r.plan.get('measured_peak_bytes'), b)} |"
            if "wall_s" in r.plan
            else f"| {r.model} | {r.label} | {_bytes(b)} | {_bytes(r.plain.get('rise_bytes'))} "
            f"| {_bytes(r.plan.get('rise_bytes'))} | {_ratio(r.plan.get('rise_bytes'), b)} "
            "| - | - | - |"
        )
        for what, d in (("plain", r.plain), ("plan", r.plan), ("step", r.step)):
            if "error" in d:
                notes.append(f"- {r.model} {r.label}, {what}: {d['error']}")
    if any(r.parts for r in rows):
        out += [
            "",
            "| model | budget | profile rise / budget | search rise / budget "
            "| profile s | search s |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            p = r.parts or {}
            b = r.budget_bytes
            if "error" in p:
                notes.append(f"- {r.model} {r.label}, parts: {p['error']}")
            out.append(
                f"| {r.model} | {r.label} | {_ratio(p.get('profile_rise_bytes'), b)} "
                f"| {_ratio(p.get('search_rise_bytes'), b)} "
                f"| {p.get('profile_s', 0.0):.1f} | {p.get('search_s', 0.0):.1f} |"
            )
    return "\n".join(out + ([""] if notes else []) + notes)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line; measure in children, or be one."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated")
    parser.add_argument(
        "--budgets", default="75%,50%,least", help="comma-separated: N%%, least, or bytes"
    )
    parser.add_argument("--parts", action="store_true", help="also profile and search apart")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny Llama at its least feasible budget alone"
    )
    parser.add_argument("--child", choices=CALLS, help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--plan-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(
            json.dumps(
                child(args.child, args.models, args.quick, args.budget_bytes, args.plan_path)
            )
        )
        return
    if not Path("/proc/self/clear_refs").exists():
        parser.error("needs Linux: /proc/self/clear_refs resets the high-water mark")
    models = ["llama"] if args.quick else [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODEL_NAMES:
            parser.error(f"unknown model {m!r}; choose from {', '.join(MODEL_NAMES)}")
    labels = ["least"] if args.quick else [b for b in args.budgets.split(",") if b]

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = [r for m in models for r in measure_model(m, labels, args.quick, args.parts, log)]
    print(table(rows))


# ------------------------------------------------------------------ a child


def _status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset() -> dict[str, int]:
    """Collect garbage, reset the high-water mark to the resident set; the status then."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status()


def _rise(before: dict[str, int]) -> dict[str, int]:
    return {"rss_before_bytes": before["VmRSS"], "rise_bytes": _status()["VmHWM"] - before["VmHWM"]}


def child(call: str, name: str, quick: bool, budget_bytes: int, path: str) -> dict[str, Any]:
    """Run ``call`` on a fresh model and batch in this process; its figures."""
    import torch

    import forget

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = build(name, quick)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    warm_up(model, batch)
    if call == "plain":
        before = _reset()
        step()
        out: dict[str, Any] = _rise(before)
        out["peak_bytes"] = forget.measure(step, probe="profiler").peak_bytes
        return out
    if call == "least":
        # A plan far below the least stops at its first guarded forward and names a
        # bound, not the least (NOTE [planning within the budget]); the planner
        # measures the least where asked (NOTE [least on demand]).
        before = _reset()
        from forget._planning import TreePlanner

        least = TreePlanner(model, (), batch).least()
        return {**_rise(before), "min_feasible_bytes": least}
    if call == "plan":
        before = _reset()
        start = time.perf_counter()
        try:
            plan = forget.plan(model, budget=budget_bytes, **batch)
        except forget.BudgetInfeasibleError as e:
            return {**_rise(before), "error": f"infeasible, least {e.min_feasible_bytes:,} B"}
        wall_s = time.perf_counter() - start
        out = {**_rise(before), "wall_s": wall_s, "measured_peak_bytes": plan.measured_peak_bytes}
        plan.save(path)
        return out
    if call == "step":
        forget.Plan.load(path).apply(model)
        before = _reset()
        step()
        return _rise(before)
    from forget._planning import TreePlanner

    before = _reset()
    start = time.perf_counter()
    planner = TreePlanner(model, (), batch)
    profile_s = time.perf_counter() - start
    profile = _rise(before)
    before = _reset()
    start = time.perf_counter()
    try:
        planner.plan(budget_bytes)
        error = ""
    except forget.BudgetInfeasibleError as e:
        error = f"infeasible, least {e.min_feasible_bytes:,} B"
    search_s = time.perf_counter() - start
    return {
        "profile_rise_bytes": profile["rise_bytes"],
        "search_rise_bytes": _rise(before)["rise_bytes"],
        "profile_s": profile_s,
        "search_s": search_s,
        **({"error": error} if error else {}),
    }


def warm_up(model: Any, batch: dict[str, Any]) -> None:
    """One plain step on a sliver of the batch (one sample, 16 tokens), one on fake tensors.

    The first step of a process initialises what every later one reuses
    (thread pools, the autograd engine, kernel caches): tens of MB of resident
    memory on these models, which would otherwise be charged to whichever call
    comes first, and would swamp the small models' budgets.
    """
    sliver = {k: v[:1, :16] if v.dim() == 2 else v[:1] for k, v in batch.items()}
    model(**sliver).loss.backward()
    model.zero_grad(set_to_none=True)
    # Fake tensors (torch's FakeTensorMode, which the planner profiles on) load
    # sympy and torch's symbolic shapes once per process: about 79 MiB of
    # resident memory whatever the model, a cost of the process as importing
    # torch is, not of the call measured.
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(2, 2, requires_grad=True))
        (x @ x).sum().backward()


def build(name: str, quick: bool) -> tuple[Any, dict[str, Any]]:
    """A seeded model from a transformers config, in training mode, and its batch."""
    import torch
    import transformers as tf

    vocab = 4000
    if name in ("llama", "gpt2", "bert", "t5"):
        hidden, layers, batch, seq = {
            "llama": (256, 6, 8, 256),
            "gpt2": (256, 4, 8, 128),
            "bert": (256, 4, 8, 128),
            "t5": (256, 4, 4, 128),
        }[name]
        if quick:
            hidden, layers, batch, seq = 64, 2, 4, 32
        ids = torch.randint(1, vocab, (batch, seq))
        inputs = {"input_ids": ids, "labels": ids}
        if name == "llama":
            config: Any = tf.LlamaConfig(
                num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
                intermediate_size=2 * hidden + hidden // 2, num_key_value_heads=2,
                vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
            )  # fmt: skip
            return tf.LlamaForCausalLM(config).train(), inputs
        if name == "gpt2":
            config = tf.GPT2Config(
                n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=seq,
                bos_token_id=0, eos_token_id=0, use_cache=False,
            )  # fmt: skip
            return tf.GPT2LMHeadModel(config).train(), inputs
        if name == "bert":
            config = tf.BertConfig(
                num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                num_attention_heads=4, vocab_size=vocab, max_position_embeddings=seq,
                pad_token_id=0,
            )  # fmt: skip
            return tf.BertForMaskedLM(config).train(), inputs
        t5: dict[str, Any] = dict(
            vocab_size=vocab, d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden,
            num_layers=layers, num_decoder_layers=layers, num_heads=4, use_cache=False,
            pad_token_id=0, decoder_start_token_id=0,
        )  # fmt: skip
        return tf.T5ForConditionalGeneration(tf.T5Config(**t5)).train(), inputs
    images = 4 if quick else 8
    labels = torch.arange(images) % 10
    if name == "vit":
        side = 32 if quick else 64
        vit: dict[str, Any] = dict(
            hidden_size=64 if quick else 256, num_hidden_layers=2 if quick else 4,
            num_attention_heads=4, intermediate_size=128 if quick else 512, image_size=side,
            patch_size=8, num_labels=10,
        )  # fmt: skip
        pixels = torch.randn(images, 3, side, side)
        return tf.ViTForImageClassification(tf.ViTConfig(**vit)).train(), {
            "pixel_values": pixels,
            "labels": labels,
        }
    side = 32 if quick else 128
    resnet: dict[str, Any] = dict(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32] if quick else [16, 32, 64, 128],
        depths=[1, 1] if quick else [3, 3, 3, 3], layer_type="basic", num_labels=10,
    )  # fmt: skip
    pixels = torch.randn(images, 3, side, side)
    return tf.ResNetForImageClassification(tf.ResNetConfig(**resnet)).train(), {
        "pixel_values": pixels,
        "labels": labels,
    }


if __name__ == "__main__":
    main()
