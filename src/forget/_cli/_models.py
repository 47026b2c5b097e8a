"""Reference models for the CLI's demo and bench, and for tests and benchmarks (not public).

Three small networks, each a stem, a ``blocks`` list of repeated blocks and a
head, so that a harness can run every block through a wrapper: a plain call,
``torch.utils.checkpoint.checkpoint`` or ``forget.checkpoint``. Wrapping a
block keeps only its input alive between forward and backward and recomputes
the rest, trading one extra forward of the block for its activations.

* :class:`ResidualMLP` -- Linear-GELU-Linear blocks with a residual and
  LayerNorm (no state, no randomness: the simplest case).
* :class:`SmallCNN` -- conv-BatchNorm-ReLU blocks (stateful layers: running
  statistics that a recomputation must not update twice).
* :class:`TinyGPT` -- a GPT-style decoder with causal attention through
  :func:`torch.nn.functional.scaled_dot_product_attention` and dropout
  (randomness that a recomputation must replay exactly).

`forget.plan` plans one as the module tree it is:
``forget.plan(model, x, loss_fn=lambda out: model.loss(out, target))``.

Build one by name and size with :func:`build_model`, or call a factory
(:func:`residual_mlp`, :func:`small_cnn`, :func:`tiny_gpt`) with your own
sizes. Construction is deterministic given ``seed`` and leaves the global RNG
untouched.

Example:
    >>> import torch
    >>> from forget._cli._models import build_model
    >>> model = build_model("residual_mlp", "tiny", seed=0)
    >>> x, target = model.example_input(4, generator=torch.Generator().manual_seed(0))
    >>> loss = model.loss(model(x), target)
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BlockWrapper = Callable[[nn.Module, Tensor], Tensor]
"""How a model runs one block: ``wrap(block, h) -> block's output``."""

MODEL_NAMES: tuple[str, ...] = ("residual_mlp", "small_cnn", "tiny_gpt")
SIZES: tuple[str, ...] = ("tiny", "quick", "default")

__all__ = [
    "MODEL_NAMES",
    "SIZES",
    "BlockModel",
    "BlockWrapper",
    "ResidualMLP",
    "SmallCNN",
    "TinyGPT",
    "build_model",
    "model_settings",
    "residual_mlp",
    "small_cnn",
    "tiny_gpt",
]


class BlockModel(nn.Module):
    """Base of the reference models: ``stem -> blocks -> head``.

    Subclasses set ``blocks`` (an :class:`torch.nn.ModuleList`) and
    ``batch_size`` (the default for :meth:`example_input`) and implement
    :meth:`embed`, :meth:`readout`, :meth:`example_input` and :meth:`loss`.
    """

    blocks: nn.ModuleList
    batch_size: int

    def embed(self, x: Tensor) -> Tensor:
        """Map the raw input to the first block's input."""
        raise NotImplementedError

    def readout(self, h: Tensor) -> Tensor:
        """Map the last block's output to the model's output."""
        raise NotImplementedError

    def forward(self, x: Tensor, wrap: BlockWrapper | None = None) -> Tensor:
        """Run the model, calling ``wrap(block, h)`` for every block.

        Args:
            x: the model's input, as :meth:`example_input` makes it.
            wrap: how to run each block; ``None`` calls the block directly.
                Pass e.g. ``lambda b, h: forget.checkpoint(b, h)`` to keep
                only each block's input and recompute the rest in backward.

        Returns:
            The model's output (logits).
        """
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if wrap is None else wrap(block, h)
        return self.readout(h)

    def example_input(
        self, batch_size: int | None = None, *, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Return a random ``(input, target)`` pair for a batch.

        Args:
            batch_size: examples in the batch; ``None`` uses ``self.batch_size``.
            generator: the source of randomness; the same seed gives the same
                batch. ``None`` uses the global RNG.
        """
        raise NotImplementedError

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Return the scalar training loss of ``output`` against ``target``."""
        raise NotImplementedError

    def step(self, x: Tensor, target: Tensor, wrap: BlockWrapper | None = None) -> Tensor:
        """Run one training step's forward and backward; return the loss, detached.

        Gradients accumulate into ``.grad`` as usual; zero them between steps
        (``model.zero_grad(set_to_none=True)``) if you compare them.
        """
        loss = self.loss(self(x, wrap), target)
        loss.backward()
        return loss.detach()

    def extra_repr(self) -> str:
        params = sum(p.numel() for p in self.parameters())
        return f"blocks={len(self.blocks)}, params={params}, batch_size={self.batch_size}"


# ---------------------------------------------------------------- ResidualMLP


class _MLPBlock(nn.Module):
    """``h -> LayerNorm(h + Linear(GELU(Linear(h))))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h: Tensor) -> Tensor:
        return self.norm(self._residual(h))

    def _residual(self, h: Tensor) -> Tensor:
        out: Tensor = h + self.fc2(F.gelu(self.fc1(h)))
        return out


class ResidualMLP(BlockModel):
    """A chain of residual MLP blocks on vectors, with a classifier head.

    Each block keeps, in a plain run, its two Linear inputs, the GELU input
    and the LayerNorm statistics: about ``2 * hidden + 2 * width`` floats per
    example. Checkpointed, it keeps one ``width`` vector per example.
    """

    def __init__(
        self,
        *,
        in_features: int,
        width: int,
        hidden: int,
        depth: int,
        num_classes: int,
        batch_size: int,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(_MLPBlock(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def embed(self, x: Tensor) -> Tensor:
        return self.stem(x)

    def readout(self, h: Tensor) -> Tensor:
        return self.head(h)

    def example_input(
        self, batch_size: int | None = None, *, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        n = self.batch_size if batch_size is None else batch_size
        x = torch.randn(n, self.in_features, generator=generator)
        target = torch.randint(self.num_classes, (n,), generator=generator)
        return x, target

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)


# ------------------------------------------------------------------- SmallCNN


class _ConvBlock(nn.Module):
    """``x -> ReLU(BatchNorm(Conv3x3(x)))``; the conv has no bias (BN has one)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


class SmallCNN(BlockModel):
    """Conv-BatchNorm-ReLU blocks on images, then global pooling and a classifier.

    The first block maps the image to ``channels`` channels; the block in the
    middle of the chain halves the resolution and doubles the channels. In
    training mode every block updates its BatchNorm running statistics, the
    state that ``torch.utils.checkpoint`` updates twice per step.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        channels: int,
        depth: int,
        image_size: int,
        num_classes: int,
        batch_size: int,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"forget: SmallCNN needs depth >= 1, got {depth}.")
        self.in_channels = in_channels
        self.image_size = image_size
        self.num_classes = num_classes
        self.batch_size = batch_size
        blocks: list[nn.Module] = []
        c_in, c_out = in_channels, channels
        for i in range(depth):
            stride = 2 if depth > 1 and i == depth // 2 else 1
            if stride == 2:
                c_out = 2 * c_out
            blocks.append(_ConvBlock(c_in, c_out, stride))
            c_in = c_out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_out, num_classes)

    def embed(self, x: Tensor) -> Tensor:
        return x

    def readout(self, h: Tensor) -> Tensor:
        return self.head(h.mean(dim=(2, 3)))

    def example_input(
        self, batch_size: int | None = None, *, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        n = self.batch_size if batch_size is None else batch_size
        shape = (n, self.in_channels, self.image_size, self.image_size)
        x = torch.randn(shape, generator=generator)
        target = torch.randint(self.num_classes, (n,), generator=generator)
        return x, target

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)


# -------------------------------------------------------------------- TinyGPT


class _CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"forget: TinyGPT width {width} is not divisible by heads {heads}.")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, h: Tensor) -> Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(h).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _GPTBlock(nn.Module):
    """Pre-norm decoder block: ``h + Drop(Attn(LN(h)))``, then ``h + Drop(MLP(LN(h)))``."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: Tensor) -> Tensor:
        return self._mlp_half(self._attn_half(h))

    def _attn_half(self, h: Tensor) -> Tensor:
        out: Tensor = h + self.drop(self.attn(self.ln1(h)))
        return out

    def _mlp_half(self, h: Tensor) -> Tensor:
        out: Tensor = h + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(h)))))
        return out


class TinyGPT(BlockModel):
    """A small GPT-style language model: next-token cross-entropy on random tokens.

    Token and position embeddings, ``depth`` pre-norm decoder blocks with
    causal multi-head attention and dropout, a final LayerNorm and a linear
    head over the vocabulary. The input is ``(batch, context)`` token ids;
    the target is the same sequence shifted by one.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        context: int,
        width: int,
        depth: int,
        heads: int,
        dropout: float,
        batch_size: int,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.context = context
        self.batch_size = batch_size
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_GPTBlock(width, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def embed(self, x: Tensor) -> Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        return self.drop(self.tok_emb(x) + self.pos_emb(pos))

    def readout(self, h: Tensor) -> Tensor:
        return self.head(self.ln_f(h))

    def example_input(
        self, batch_size: int | None = None, *, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        n = self.batch_size if batch_size is None else batch_size
        tokens = torch.randint(self.vocab_size, (n, self.context + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


# ------------------------------------------------------------------ factories


_M = TypeVar("_M", bound=BlockModel)


def _seeded(seed: int, build: Callable[[], _M]) -> _M:
    # Initialise from a private seed without disturbing the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def residual_mlp(
    *,
    width: int = 128,
    depth: int = 12,
    hidden: int | None = None,
    in_features: int = 128,
    num_classes: int = 10,
    batch_size: int = 1024,
    seed: int = 0,
) -> ResidualMLP:
    """Build a :class:`ResidualMLP`; ``hidden`` defaults to ``4 * width``."""
    return _seeded(
        seed,
        lambda: ResidualMLP(
            in_features=in_features,
            width=width,
            hidden=4 * width if hidden is None else hidden,
            depth=depth,
            num_classes=num_classes,
            batch_size=batch_size,
        ),
    )


def small_cnn(
    *,
    channels: int = 32,
    depth: int = 6,
    image_size: int = 32,
    in_channels: int = 3,
    num_classes: int = 10,
    batch_size: int = 16,
    seed: int = 0,
) -> SmallCNN:
    """Build a :class:`SmallCNN` on ``image_size`` x ``image_size`` images."""
    return _seeded(
        seed,
        lambda: SmallCNN(
            in_channels=in_channels,
            channels=channels,
            depth=depth,
            image_size=image_size,
            num_classes=num_classes,
            batch_size=batch_size,
        ),
    )


def tiny_gpt(
    *,
    width: int = 128,
    depth: int = 6,
    heads: int = 4,
    context: int = 64,
    vocab_size: int = 256,
    dropout: float = 0.1,
    batch_size: int = 8,
    seed: int = 0,
) -> TinyGPT:
    """Build a :class:`TinyGPT`; set ``dropout=0.0`` for a deterministic forward."""
    return _seeded(
        seed,
        lambda: TinyGPT(
            vocab_size=vocab_size,
            context=context,
            width=width,
            depth=depth,
            heads=heads,
            dropout=dropout,
            batch_size=batch_size,
        ),
    )


_FACTORIES: dict[str, Callable[..., BlockModel]] = {
    "residual_mlp": residual_mlp,
    "small_cnn": small_cnn,
    "tiny_gpt": tiny_gpt,
}

# Per model and size, the factory's keyword arguments. "default" runs one
# training step in well under a second on a laptop-class CPU; "quick" keeps the whole
# `forget bench --quick` within seconds; "tiny" is for unit tests, with batches
# large enough that activations outweigh the weights and their gradients, so
# that planning saves memory on every model (`forget plan --size tiny`).
_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "residual_mlp": {
        "tiny": {"width": 16, "depth": 3, "in_features": 8, "batch_size": 64},
        "quick": {"width": 64, "depth": 8, "in_features": 64, "batch_size": 512},
        "default": {},
    },
    "small_cnn": {
        "tiny": {"channels": 4, "depth": 3, "image_size": 8, "batch_size": 16},
        "quick": {"channels": 16, "depth": 4, "image_size": 32, "batch_size": 16},
        "default": {},
    },
    "tiny_gpt": {
        "tiny": {"width": 16, "depth": 2, "heads": 2, "context": 8, "vocab_size": 32},
        "quick": {"width": 64, "depth": 4, "heads": 4, "context": 64, "batch_size": 8},
        "default": {},
    },
}


def _check_name_and_size(name: str, size: str) -> None:
    if name not in _FACTORIES:
        raise ValueError(
            f"forget: unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}."
        )
    if size not in SIZES:
        raise ValueError(f"forget: unknown size {size!r}; expected one of {', '.join(SIZES)}.")


def model_settings(name: str, size: str = "default") -> dict[str, Any]:
    """The keyword arguments ``build_model(name, size)`` passes its factory (seed aside).

    Every argument the factory takes is listed, with the preset's value or the
    factory's default; a ``build_model`` override may replace any of them.

    Raises:
        ValueError: for an unknown name or size.
    """
    _check_name_and_size(name, size)
    defaults = {
        key: p.default
        for key, p in inspect.signature(_FACTORIES[name]).parameters.items()
        if key != "seed"
    }
    return {**defaults, **_PRESETS[name][size]}


def build_model(name: str, size: str = "default", *, seed: int = 0, **overrides: Any) -> BlockModel:
    """Build a reference model by name at a preset size.

    Args:
        name: one of :data:`MODEL_NAMES`.
        size: one of :data:`SIZES`: ``"tiny"`` for unit tests, ``"quick"`` for
            ``forget bench --quick``, ``"default"`` for the full benchmark.
        seed: initialises the parameters; the same seed gives the same model.
        **overrides: factory keyword arguments that replace the preset's
            (e.g. ``dropout=0.0``, ``batch_size=8``).

    Raises:
        ValueError: for an unknown name or size; the message lists valid ones.
    """
    _check_name_and_size(name, size)
    kwargs = {**_PRESETS[name][size], **overrides}
    return _FACTORIES[name](seed=seed, **kwargs)
