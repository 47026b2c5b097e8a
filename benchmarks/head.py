"""Issue 43's targets: a language model's step below its logits (the head in chunks).

    python benchmarks/head.py [--models llama,gpt2] [--rounds 7] [--runs 3]
        [--tokens 512] [--batch 2] [--threads 1] [--skip-time] [--skip-cap]

Models are built from their configs' defaults (``use_cache`` on) at hidden 256,
4 layers and a vocabulary of 16,000 (Llama 3.2 1B's ratio of vocabulary to
width), with 2 sequences of 512 tokens, and train on the loss the model
computes itself. Peaks are the allocator's (``forget.measure(...,
probe="profiler")``), over the plain step's. Rows:

* plain; every layer forgotten (``integrations.transformers.enable``);
* ``forget.plan`` at 20 % without the chunked head (the error it raises);
* every layer forgotten with ``chunk_loss`` at 4 and 16 chunks and by default;
* torch alone: every layer checkpointed by transformers' own checkpointing and
  ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` on the
  last hidden states (the shifted labels, ``ignore_index=-100``);
* a chunked NLL written by hand, each chunk a ``forget.forget`` region, every
  layer forgotten;
* ``chunk_loss`` and ``forget.plan`` at the torch combination's peak;
* the least feasible budget with ``chunk_loss``: the budget an infeasible
  ``forget.plan`` names, then planned at (it must fit).

Times: every step above with a time is run side by side in ``--rounds``
interleaved rounds (`forget._planning.time_calls`), each on its own copy of the
model; a row's figure is the median over rounds of its time over the torch
combination's in the same round, and ``--runs`` such runs give its spread. The
head's own cost: the head and its loss alone on the last hidden states, plain,
chunked (default count) and its forward without grad, timed the same way; the
chunked head's extra time over the plain head's, in forwards of the head.
The cap: ``forget.cap`` at 30 % of the plain peak with ``chunk_loss``, steps of
lengths 256 to 512, each step's allocator peak over the cap.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import forget
from forget._planning import time_calls
from forget.integrations import transformers as forget_hf

WIDTH, LAYERS, VOCAB = 256, 4, 16000


def build(kind: str) -> nn.Module:
    """The model of ``kind`` from its config's defaults, at this benchmark's sizes."""
    import transformers

    if kind == "llama":
        llama = transformers.LlamaConfig(
            hidden_size=WIDTH,
            intermediate_size=688,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=VOCAB,
        )
        return transformers.LlamaForCausalLM(llama).train()
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=WIDTH, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config).train()
    raise ValueError(f"no model named {kind!r}; expected llama or gpt2")


def peak(model: nn.Module, step: Callable[[], Any]) -> int:
    model.zero_grad(set_to_none=True)
    return forget.measure(step, probe="profiler").peak_bytes


def model_step(model: nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def torch_step(model: Any, ids: torch.Tensor) -> Callable[[], None]:
    """transformers' checkpointing (torch's checkpoint) and torch's chunked linear loss."""
    options = torch.nn.LinearCrossEntropyOptions()
    labels = ids[:, 1:].reshape(-1)
    head = model.get_output_embeddings()

    def step() -> None:
        hidden = getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        F.linear_cross_entropy(
            flat, head.weight, labels, ignore_index=-100, options=options
        ).backward()

    return step


def hand_step(model: Any, ids: torch.Tensor, chunks: int) -> Callable[[], None]:
    """A chunked NLL written by hand: each chunk a `forget.forget` region."""
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
    weight = model.get_output_embeddings().weight

    def nll(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, weight).float(), y, reduction="sum")

    def step() -> None:
        hidden = getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        total = sum(
            forget.forget(nll, h, y)
            for h, y in zip(flat.tensor_split(chunks), labels.tensor_split(chunks), strict=True)
        )
        assert isinstance(total, torch.Tensor)
        (total / (labels != -100).sum()).backward()

    return step


def least_with_chunks(model: nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """The budget an infeasible plan names, and the peak of the plan made at it."""
    try:
        forget.plan(model, budget=1 << 20, input_ids=ids, labels=ids)
        raise RuntimeError("a 1 MiB budget fit")
    except forget.BudgetInfeasibleError as exc:
        named = exc.min_feasible_bytes
    plan = forget.plan(model, budget=named, input_ids=ids, labels=ids)
    return named, plan.measured_peak_bytes


def run_model(kind: str, args: argparse.Namespace) -> None:
    ids = torch.randint(
        0, VOCAB, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0)
    )
    base = build(kind)
    rows: list[tuple[str, str]] = []
    plain_model = copy.deepcopy(base)
    plain = peak(plain_model, model_step(plain_model, ids))
    rows.append(("plain", f"1.000 ({plain:,} B)"))

    layers = forget_hf.enable(copy.deepcopy(base))
    rows.append(("every layer forgotten", f"{peak(layers, model_step(layers, ids)) / plain:.3f}"))

    try:
        forget.plan(copy.deepcopy(base), budget="20%", input_ids=ids, labels=ids)
        rows.append(("forget.plan at 20 %", "fits (unexpected)"))
    except forget.BudgetInfeasibleError as exc:
        named = exc.min_feasible_bytes / plain
        rows.append(("forget.plan at 20 %", f"BudgetInfeasibleError, names {named:.3f}"))

    steps: dict[str, Callable[[], None]] = {}
    models: dict[str, nn.Module] = {}
    for chunks in (4, 16, None):
        m = copy.deepcopy(base)
        handle = forget_hf.chunk_loss(m, chunks=chunks)
        if chunks is None:
            alone = peak(m, model_step(m, ids))
            rows.append(
                (f"chunk_loss alone (default → {handle.last_chunks})", f"{alone / plain:.3f}")
            )
        forget_hf.enable(m)
        p = peak(m, model_step(m, ids))
        rows.append(
            (
                f"every layer forgotten, chunk_loss({chunks or 'default'} → {handle.last_chunks})",
                f"{p / plain:.3f}",
            )
        )
        if chunks is None:
            steps["layers + chunk_loss"], models["layers + chunk_loss"] = model_step(m, ids), m
    torchy: Any = copy.deepcopy(base)
    torchy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch_peak = peak(torchy, torch_step(torchy, ids))
    rows.append(
        (
            "torch: layers checkpointed + F.linear_cross_entropy (chunked)",
            f"{torch_peak / plain:.3f}",
        )
    )
    steps["torch"], models["torch"] = torch_step(torchy, ids), torchy

    hand = forget_hf.enable(copy.deepcopy(base))
    hand_peak = peak(hand, hand_step(hand, ids, 16))
    rows.append(
        (
            "hand-written chunked NLL (16 forget.forget), every layer forgotten",
            f"{hand_peak / plain:.3f}",
        )
    )
    steps["hand-written"], models["hand-written"] = hand_step(hand, ids, 16), hand

    planned = copy.deepcopy(base)
    forget_hf.chunk_loss(planned)
    start = time.perf_counter()
    plan = forget.plan(planned, budget=torch_peak, input_ids=ids, labels=ids)
    plan_s = time.perf_counter() - start
    plan.apply(planned)
    forget_peak = peak(planned, model_step(planned, ids))
    rows.append(
        (
            f"forget: chunk_loss + forget.plan at torch's peak (planned in {plan_s:.0f} s)",
            f"{forget_peak / plain:.3f} (plan: measured {plan.measured_peak_bytes / plain:.3f}, "
            f"predicted {plan.predicted_peak_bytes / plain:.3f}; plain with the chunked head "
            f"predicted {plan.plain_peak_bytes / plain:.3f})",
        )
    )
    steps["forget plan"], models["forget plan"] = model_step(planned, ids), planned
    steps["plain"], models["plain"] = model_step(plain_model, ids), plain_model
    steps["every layer forgotten"], models["every layer forgotten"] = (
        model_step(layers, ids),
        layers,
    )

    least_model = copy.deepcopy(base)
    forget_hf.chunk_loss(least_model)
    named, fitted = least_with_chunks(least_model, ids)
    rows.append(
        (
            "least feasible with chunk_loss (named, then planned at)",
            f"{named / plain:.3f} (plan at it peaks {fitted / plain:.3f})",
        )
    )

    print(
        f"\n## {kind}: hidden {WIDTH}, {LAYERS} layers, vocabulary {VOCAB}, "
        f"{args.batch} x {args.tokens} tokens\n"
    )
    print("| step | peak / plain |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")

    if not args.skip_time:
        ratios: dict[str, list[float]] = {k: [] for k in steps if k != "torch"}
        for _ in range(args.runs):
            times = time_calls(
                steps, args.rounds, prepare=lambda key: models[key].zero_grad(set_to_none=True)
            )
            for key in ratios:
                per_round = [t / b for t, b in zip(times[key], times["torch"], strict=True)]
                ratios[key].append(statistics.median(per_round))
        print("\n| step | time / torch's, median per round, each run |\n|---|---|")
        for key, values in ratios.items():
            print(f"| {key} | {', '.join(f'{v:.3f}' for v in values)} |")
        head_cost(base, ids, args)
    if not args.skip_cap:
        cap_run(base, plain, args)


def head_cost(base: Any, ids: torch.Tensor, args: argparse.Namespace) -> None:
    """The head and its loss alone: plain, chunk_loss's and `forget.chunked`'s, in
    forwards of the head."""
    from forget.integrations._transformers_head import _HeadLoss, default_chunks

    with torch.no_grad():
        hidden0 = getattr(base, base.base_model_prefix)(input_ids=ids).last_hidden_state
    flat0 = hidden0.reshape(-1, hidden0.shape[-1])
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
    weight = base.get_output_embeddings().weight
    chunks = default_chunks(flat0.shape[0], flat0.shape[1], weight.shape[0], 4)

    def nll(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, weight).float(), y, reduction="sum")

    def plain() -> None:
        nll(flat0.detach().requires_grad_(), labels).backward()

    def head_loss() -> None:
        h = flat0.detach().requires_grad_()
        _HeadLoss.apply(h, weight, None, None, labels, chunks, -100).backward()

    def recomputed() -> None:
        forget.chunked(nll, flat0.detach().requires_grad_(), labels, chunks=chunks).backward()

    def forward() -> None:
        with torch.no_grad():
            nll(flat0, labels)

    calls = {"plain": plain, "chunk_loss": head_loss, "chunked": recomputed, "forward": forward}
    extra: dict[str, list[float]] = {"chunk_loss": [], "chunked": []}
    for _ in range(args.runs):
        times = time_calls(calls, args.rounds, prepare=lambda _: setattr(weight, "grad", None))
        for key, values in extra.items():
            per_round = [
                (c - p) / f
                for c, p, f in zip(times[key], times["plain"], times["forward"], strict=True)
            ]
            values.append(statistics.median(per_round))
    for key, values in extra.items():
        print(
            f"\nThe head's own cost, {key} ({chunks} chunks): its extra time over the plain "
            f"head, in forwards of the head, each run: {', '.join(f'{e:.2f}' for e in values)}"
        )


def cap_run(base: nn.Module, plain: int, args: argparse.Namespace) -> None:
    model = copy.deepcopy(base)
    forget_hf.chunk_loss(model)
    handle = forget.cap(model, int(0.3 * plain))
    lengths = (256, 320, 384, 448, 512, 512, 384, 256, 448)
    figures = []
    for tokens in lengths:
        ids = torch.randint(0, VOCAB, (args.batch, tokens))
        p = peak(model, model_step(model, ids))
        figures.append(f"{tokens}: {p / handle.budget_bytes:.3f}")
    handle.remove()
    print(
        f"\nThe cap at 30 % of the plain peak ({handle.budget_bytes:,} B), each step's "
        "allocator peak / cap: " + ", ".join(figures)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-cap", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for kind in args.models.split(","):
        run_model(kind, args)


if __name__ == "__main__":
    main()
