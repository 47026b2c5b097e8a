"""`forget.cap` and `forget.plan` on models nobody here wrote: torchvision, timm, diffusers.

By hand, never in CI: torchvision does not load against the CPU torch the project
installs, so this runs in a separate venv with ``torch==2.14.1 torchvision==0.29.1``
and ``pip install timm diffusers`` (models built from their code with random
weights; nothing is downloaded)::

    PYTHONPATH=src /path/to/venv214/bin/python benchmarks/real_models.py
        [--models resnet18,...] [--share 0.5] [--plan] [--passes 3] [--partial none]

Per model, a plain copy and a capped copy run the same steps of varying batch
sizes (the same seed before each, so dropout and stochastic depth draw alike):
per step, the capped step's peak by the allocator (``forget.measure(...,
probe="profiler")``) over the cap, the regions the cap evicted, and whether
the gradients are bitwise equal to plain; after the run, whether the buffers
(BatchNorm's running statistics) are. The cap is ``--share`` of the plain
step's peak at the largest batch. ``--plan`` adds a `forget.plan` at that
budget on the largest batch: its peak over the budget and the gradients
against plain. A model whose cap cannot hold says what the cap's error said.
``--passes 3`` runs the batch sizes three times over: from a size's second
step on the cap repeats its decision (NOTE [steps of known shapes]), marked.
``--partial none`` caps with whole regions only (``partial=None``; the default
is ``"selective"``, NOTE [partial evictions]); the regions evicted in part are
counted beside the whole ones.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import forget
from forget._runtime._cap import _cap_with

Batch = Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]


def _images(size: int) -> Batch:
    return lambda n: (
        (torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(n)),),
        {},
    )


def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(weights=None, **kwargs)

    return make


def _small_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(
        image_size=64, patch_size=8, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=256
    )


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import timm

        model: nn.Module = timm.create_model(name, pretrained=False, **kwargs)
        return model

    return make


class _UNet(nn.Module):
    """diffusers' UNet2DModel (attention and GroupNorm), its output as a tensor."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        self.unet = UNet2DModel(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.full((x.shape[0],), 10, dtype=torch.long)
        out: torch.Tensor = self.unet(x, t).sample
        return out


MODELS: dict[str, tuple[Callable[[], nn.Module], Batch, tuple[int, ...]]] = {
    # Images large enough that activations, not parameter gradients, fill the step.
    "resnet18": (_torchvision("resnet18"), _images(160), (4, 8, 2, 6)),
    "mobilenet_v3_small": (_torchvision("mobilenet_v3_small"), _images(160), (4, 8, 2, 6)),
    "efficientnet_b0": (_torchvision("efficientnet_b0"), _images(128), (4, 8, 2, 6)),
    "convnext_tiny": (_torchvision("convnext_tiny"), _images(64), (2, 4, 1, 3)),
    "vit_small_tv": (_small_vit, _images(64), (4, 8, 2, 6)),
    "timm_resnet26d": (_timm("resnet26d", drop_path_rate=0.1), _images(64), (4, 8, 2, 6)),
    "timm_vit_tiny": (
        _timm("vit_tiny_patch16_224", img_size=64, drop_path_rate=0.1),
        _images(64),
        (4, 8, 2, 6),
    ),
    "timm_convnext_atto": (_timm("convnext_atto", drop_path_rate=0.1), _images(64), (4, 8, 2, 6)),
    "diffusers_unet": (_UNet, _images(32), (4, 8, 2, 6)),
}


def _loss(out: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def _step(model: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
    args, kwargs = batch
    torch.manual_seed(0)
    _loss(model(*args, **kwargs)).backward()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _peak(model: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]]) -> int:
    model.zero_grad(set_to_none=True)
    return forget.measure(lambda: _step(model, batch), probe="profiler").peak_bytes


def run(
    name: str,
    share: float,
    with_plan: bool,
    passes: int = 1,
    read: str = "largest",
    partial: str | None = None,
) -> None:
    make, batch_of, sizes = MODELS[name]
    torch.manual_seed(0)
    plain = make().train()
    capped = copy.deepcopy(plain)
    largest = batch_of(max(sizes))
    warm = copy.deepcopy(plain)
    _step(warm, largest)  # lazily made state exists before the peak is read
    plain_peak = _peak(warm, largest)
    cap_bytes = int(share * plain_peak)
    print(f"{name}: plain peak {plain_peak:,} B at batch {max(sizes)}; cap {cap_bytes:,} B")
    # NOTE [records within a measure]: the steps the cap reads (NOTE [what the count
    # misses]) it reads from the profiler that measures them here.
    handle = _cap_with(capped, cap_bytes, read_allocator=read, partial=partial)
    rows = []
    held = True
    try:
        for n in sizes * passes:
            batch = batch_of(n)
            plain.zero_grad(set_to_none=True)
            _step(plain, batch)
            try:
                peak = _peak(capped, batch)
            except forget.ForgetError as error:
                rows.append(f"{n}: cannot hold ({str(error)[:200]}...)")
                held = False
                break
            report = handle.last_step
            assert report is not None
            equal = _same(_grads(plain), _grads(capped))
            rows.append(
                f"{n}: {peak / cap_bytes:.3f} ({len(report.evicted)}/{len(report.regions)}"
                f"{f', {len(report.partial)} in part' if report.partial else ''}"
                f"{', repeated' if report.repeated else ''}"
                f"{', read' if report.allocator_peak_bytes is not None else ''}"
                f"{', grads EQUAL' if equal else ', grads DIFFER'})"
            )
    finally:
        handle.remove()
    # After a step the cap stopped, its buffers are put back and plain's ran on.
    buffers = all(torch.equal(a, b) for a, b in zip(plain.buffers(), capped.buffers(), strict=True))
    after = f"; buffers {'equal' if buffers else 'DIFFER'}" if held else ""
    print(f"  cap {share:.0%}: " + "; ".join(rows) + after)
    if not with_plan:
        return
    torch.manual_seed(0)
    reference = make().train()
    planned = copy.deepcopy(reference)
    args, kwargs = largest
    try:
        plan = forget.plan(planned, *args, budget=cap_bytes, loss_fn=_loss, repeats=1, **kwargs)
    except forget.BudgetInfeasibleError as error:
        print(f"  plan {share:.0%}: infeasible, least {error.min_feasible_bytes:,} B")
        return
    plan.apply(planned)
    _step(reference, largest)
    peak = _peak(planned, largest)
    equal = _same(_grads(reference), _grads(planned))
    print(
        f"  plan {share:.0%}: {peak / cap_bytes:.3f} of the budget, "
        f"{sum(c != 'keep' for c in plan.choices.values())} of {len(plan.choices)} regions "
        f"not kept, grads {'EQUAL' if equal else 'DIFFER'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--share", type=float, default=0.5)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument(
        "--read",
        choices=("largest", "every", "never"),
        default="largest",
        help="the cap's read_allocator (NOTE [what the count misses])",
    )
    parser.add_argument("--passes", type=int, default=1, help="run the batch sizes this many times")
    parser.add_argument(
        "--partial",
        default="selective",
        type=lambda name: None if name == "none" else name,
        help="forget.cap's partial= (selective, or none)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        run(name, args.share, args.plan, args.passes, args.read, args.partial)


if __name__ == "__main__":
    main()
