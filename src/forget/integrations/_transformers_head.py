"""`chunk_loss`: a causal language model's loss from its last hidden states, chunk by chunk.

NOTE [the head in chunks]: every layer forgotten, a language model's step still
holds its logits (tokens x vocabulary, upcast to float) and their gradient.
`chunk_loss` computes transformers' ``ForCausalLMLoss`` (the shift,
``ignore_index``, ``num_items_in_batch``, the upcast) slice by slice over the
tokens, so the logits never exist whole. It wraps the model's forward on the
instance, so that a plan or cap put on later sees the head inside the step: a
call with ``labels`` runs the model with ``labels=None`` and
``logits_to_keep=1``, catches the base model's last hidden states with a hook,
and returns the loss with ``logits=None``.

NOTE [gradients in the forward]: a loss is the last thing a step computes, and
the first its backward differentiates; so each slice's gradients (of the hidden
states, the head's weight and bias) are made in the forward, while its logits
exist, and only they are kept: a scalar's backward then scales them. Forgetting
the slices instead (`forget.chunked`) would compute each slice's logits twice,
and the head's matmul is the largest of such a step. What it gives up: a second
derivative of the loss (``create_graph``), which no language model's training
asks for.

NOTE [the head checked]: what a model does between its base model and its loss
is its own code, so the first call compares the model's logits of the kept
position with the chunked head's of the same hidden state (tied or not, with
the soft-cap the config names), and raises where they differ rather than
compute another loss. A custom ``loss_function`` is refused at once: only
transformers' own causal loss is known.

NOTE [no cache in a training step]: a training call with ``labels`` and no
``use_cache`` runs with ``use_cache=False``, as transformers' own checkpointing
runs it: the key/value cache holds every layer's keys and values to the end of
the step, memory no training step reads, and with the logits gone it would be
the next floor. A ``use_cache`` the call gives is kept.

NOTE [default chunks]: a slice's float logits are bounded by the hidden states'
bytes, so that one slice's logits and their gradient weigh about as much as
one more layer's kept input, and a slice keeps at least `MIN_ROWS` tokens, below which
the head's matmul stops paying for its calls (the figures that chose it:
benchmarks/measured.md, "The head in chunks").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._regions import CHUNKED as _ATTR
from .._regions import HEAD, unwrap_forward, wrap_forward

__all__ = ["ChunkedLoss", "chunk_loss", "chunked_loss_of", "default_chunks"]

# Tokens a slice keeps at least (NOTE [default chunks]).
MIN_ROWS = 64
# Keyword arguments of transformers' ForCausalLMLoss this head honours.
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def chunk_loss(model: Any, chunks: int | None = None) -> ChunkedLoss:
    """Compute a causal LM's loss chunk by chunk, so its logits never exist whole.

    With ``labels``, ``model(...)`` computes its loss from the last hidden states
    slice by slice over the tokens, with transformers' semantics (the shift,
    ``ignore_index=-100``, ``num_items_in_batch``, the upcast to float), each
    slice's gradients made as its logits are (NOTE [gradients in the forward]),
    and returns ``logits=None``: the memory of the logits and their gradient
    falls to one slice's, for about the plain head's time. Without ``labels``
    the model runs as before, logits included. ``state_dict`` keys do not change.

    Args:
        model: a transformers causal LM (a ``PreTrainedModel`` with an
            ``lm_head`` and transformers' own causal ``loss_function``), or a
            PEFT model wrapping one.
        chunks: how many slices the tokens are cut into; ``None`` chooses from
            the sizes at each call (`default_chunks`). Calling `chunk_loss` again
            on the same model sets a new count on the same handle.

    Returns:
        The `ChunkedLoss` handle; ``handle.remove()`` restores the model.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``model`` is no ``PreTrainedModel``, has no linear
            ``lm_head``, no base model, takes no ``logits_to_keep``, or computes
            its loss with a ``loss_function`` other than transformers' causal one.
        ValueError: ``chunks`` is not ``None`` nor a whole number of at least 1.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from forget.integrations import transformers as forget_hf
        >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
        >>> model = LlamaForCausalLM(config).train()
        >>> handle = forget_hf.chunk_loss(model, chunks=4)
        >>> ids = torch.randint(0, 1000, (2, 16))
        >>> out = model(input_ids=ids, labels=ids)
        >>> out.logits is None
        True
        >>> out.loss.backward()
        >>> handle.remove()
        >>> model(input_ids=ids).logits.shape
        torch.Size([2, 16, 1000])
    """
    _check_chunks(chunks)
    base = _causal_lm(model)
    handle: ChunkedLoss | None = base.__dict__.get(_ATTR)
    if handle is not None:
        handle.chunks = chunks
        return handle
    return ChunkedLoss(base, chunks)


def chunked_loss_of(model: Any) -> ChunkedLoss | None:
    """The `ChunkedLoss` that `chunk_loss` put on ``model`` (or its PEFT base), or ``None``."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return getattr(base, "__dict__", {}).get(_ATTR)


def default_chunks(tokens: int, hidden_size: int, vocab_size: int, hidden_itemsize: int) -> int:
    """The chunk count `chunk_loss` takes by default (NOTE [default chunks]).

    The least count whose slice of float logits is no larger than the hidden
    states (``tokens x hidden_size`` of ``hidden_itemsize`` bytes), but never so
    many that a slice holds fewer than `MIN_ROWS` tokens.
    """
    by_bytes = math.ceil(vocab_size * 4 / (hidden_size * hidden_itemsize))
    by_rows = max(1, tokens // MIN_ROWS)
    return max(1, min(by_bytes, by_rows))


class ChunkedLoss:
    """A causal LM's loss run chunk by chunk (`chunk_loss`); ``remove()`` undoes it.

    Attributes:
        model: the ``PreTrainedModel`` it hooks.
        chunks: the chunk count, or ``None`` for `default_chunks` at each call;
            `forget.plan` may pin a larger one where the budget needs it (NOTE
            [chunks by the budget]).
        last_chunks: the count the latest call used (``None`` before any), and
        last_tokens: the tokens it cut (0 before any).
    """

    def __init__(self, model: Any, chunks: int | None) -> None:
        if "forward" in model.__dict__:
            raise ValueError(
                f"forget: {type(model).__name__}'s forward is wrapped already (by a forget "
                "plan or cap, or your own instance forward); a plan or cap must see the "
                "chunked head inside the step, so call chunk_loss first: remove the plan "
                "or cap, call chunk_loss(model), then plan or cap again."
            )
        self.model: Any = model  # a transformers PreTrainedModel
        self.chunks = chunks
        self.last_chunks: int | None = None
        self.last_tokens = 0
        self._checked = False
        self._hidden: list[torch.Tensor | None] = []
        self._signature = inspect.signature(type(model).forward)
        self._takes_cache = "use_cache" in self._signature.parameters
        base = getattr(model, model.base_model_prefix)
        self._hook = base.register_forward_hook(self._caught)
        wrap_forward(model, self._forward, HEAD, "chunked loss")
        model.__dict__[_ATTR] = self

    def remove(self) -> None:
        """Put the model back as it was: its loss and logits computed whole again.

        Raises:
            ValueError: a plan or cap wrapped the model's forward after `chunk_loss`;
                remove it first.
        """
        if self.model.__dict__.get(_ATTR) is not self:
            return  # removed already
        if not unwrap_forward(self.model, HEAD):
            raise ValueError(
                f"forget: {type(self.model).__name__}'s forward was wrapped after "
                "chunk_loss (by a plan or cap); remove that first, then the chunked loss."
            )
        self._hook.remove()
        del self.model.__dict__[_ATTR]

    def __repr__(self) -> str:
        chunks = "by the sizes" if self.chunks is None else self.chunks
        return f"ChunkedLoss({type(self.model).__name__}, chunks={chunks})"

    # A call, in the order it runs.

    def _forward(
        self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        bound = self._signature.bind_partial(self.model, *args, **kwargs)
        given = bound.arguments
        labels = given.get("labels")
        if labels is None:
            return forward(*args, **kwargs)
        extra = given.get(_var_keyword(self._signature), {})
        if given.get("return_dict", extra.get("return_dict")) is False:
            raise ValueError(
                "forget: chunk_loss returns logits=None, which a tuple output "
                "(return_dict=False) cannot say without shifting its positions; call the "
                "model with return_dict=True (the default) while chunk_loss is on."
            )
        keep = given.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise ValueError(
                f"forget: chunk_loss computes the loss over every position, and the call "
                f"asks for logits_to_keep={keep!r}; leave it out when passing labels."
            )
        loss_kwargs = {k: extra.pop(k) for k in _LOSS_KWARGS if k in extra}
        given["labels"] = None
        given["logits_to_keep"] = 1
        if self.model.training and given.get("use_cache") is None and self._takes_cache:
            given["use_cache"] = False  # NOTE [no cache in a training step]
        self._hidden.append(None)
        try:
            output = forward(*bound.args[1:], **bound.kwargs)
        finally:
            hidden = self._hidden.pop()
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(
                f"forget: chunk_loss needs the last hidden states of "
                f"{type(self.model).__name__}'s base model ({self.model.base_model_prefix}), "
                "and its output carried none (no last_hidden_state); call handle.remove()."
            )
        head = self._head()
        if not self._checked and not _is_fake(hidden):
            self._check(head, hidden, output.logits)
        loss = self._loss(head, hidden, labels, loss_kwargs)
        fields = {k: v for k, v in output.items() if k not in ("loss", "logits")}
        return type(output)(loss=loss, logits=None, **fields)

    def _caught(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._hidden and self._hidden[-1] is None:
            hidden = getattr(output, "last_hidden_state", None)
            if hidden is None and isinstance(output, tuple):
                hidden = output[0]
            self._hidden[-1] = hidden

    # The loss.

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
        """The head's weight, bias and Gemma's soft-cap (the config's), as `_logits` takes them."""
        lm_head = self.model.get_output_embeddings()
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        return lm_head.weight, lm_head.bias, softcap

    def _loss(
        self,
        head: tuple[torch.Tensor, torch.Tensor | None, float | None],
        hidden: torch.Tensor,
        labels: torch.Tensor,
        loss_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        ignore_index = loss_kwargs.get("ignore_index", -100)
        shift = loss_kwargs.get("shift_labels")
        if shift is None:
            shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift.reshape(-1).to(hidden.device)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.shape[0] != targets.shape[0]:
            raise ValueError(
                f"forget: chunk_loss has {flat.shape[0]} positions of hidden states and "
                f"{targets.shape[0]} labels after the shift; labels must be (batch, tokens) "
                "as the input ids are."
            )
        chunks = self.chunks
        if chunks is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            chunks = default_chunks(flat.shape[0], flat.shape[1], vocab, flat.element_size())
        self.last_chunks, self.last_tokens = chunks, flat.shape[0]
        summed = _HeadLoss.apply(flat, *head, targets, chunks, ignore_index)
        count = loss_kwargs.get("num_items_in_batch")
        if count is None:
            count = (targets != ignore_index).sum()
        elif isinstance(count, torch.Tensor):
            count = count.to(summed.device)
        return summed / count

    def _check(
        self,
        head: tuple[torch.Tensor, torch.Tensor | None, float | None],
        hidden: torch.Tensor,
        logits: Any,
    ) -> None:
        """The model's own logits of its last position are the chunked head's (NOTE [the
        head checked]); a TypeError where not."""
        with torch.no_grad():
            ours = _logits(*head, hidden[:, -1:, :])
        if not (
            isinstance(logits, torch.Tensor)
            and logits.shape == ours.shape
            and torch.allclose(logits.float(), ours.float(), rtol=1e-4, atol=1e-5)
        ):
            raise TypeError(
                f"forget: chunk_loss computes the logits as the output embeddings "
                f"({type(self.model.get_output_embeddings()).__name__}) of the last hidden "
                "states (with the config's final_logit_softcapping), and "
                f"{type(self.model).__name__}'s own logits differ from that: its forward "
                "does more between its base model and its loss, which chunk_loss cannot "
                "honour. Call handle.remove() and compute the loss with forget.chunked "
                "yourself (docs/head.md)."
            )
        self._checked = True


def _logits(
    weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None, h: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(h, weight, bias)
    if softcap is not None:  # Gemma's, as its forward does it
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class _HeadLoss(torch.autograd.Function):
    """The summed cross-entropy of a head's logits, slice by slice, its gradients made
    in the forward (NOTE [gradients in the forward])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        softcap: float | None,
        targets: torch.Tensor,
        chunks: int,
        ignore_index: int,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = (
            torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        parts = max(1, min(chunks, hidden.shape[0]))
        for h, y, into in zip(
            hidden.tensor_split(parts),
            targets.tensor_split(parts),
            grad_h.tensor_split(parts) if grad_h is not None else [None] * parts,
            strict=True,
        ):
            raw = F.linear(h, weight, bias)
            capped = None
            if softcap is not None:  # Gemma's, as its forward does it
                capped = torch.tanh(raw / softcap)
                raw = capped * softcap
            logits = raw.float()
            del raw
            valid = y != ignore_index
            safe = torch.where(valid, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            # d(summed loss)/d(logits): softmax less the one-hot target, on kept rows.
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(len(safe), device=grad.device), safe] -= 1.0
            grad.mul_(valid[:, None])
            if capped is not None:  # through the soft-cap: 1 - tanh^2
                grad.mul_(1.0 - capped.float().square())
            del capped
            grad_in = grad.to(weight.dtype)
            if into is not None:  # a slice along the rows: contiguous
                torch.mm(grad_in, weight, out=into)
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h.float())
            if grad_b is not None:
                grad_b.add_(grad.sum(0))
            del grad, grad_in
        ctx.save_for_backward(
            *(t if t is not None else torch.empty(0) for t in (grad_h, grad_w, grad_b))
        )
        ctx.weight_dtype = weight.dtype
        ctx.has = (grad_h is not None, grad_w is not None, grad_b is not None)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        grad_h, grad_w, grad_b = (t if has else None for t, has in zip(saved, ctx.has, strict=True))
        scale = grad_out.to(torch.float32)
        if grad_h is not None:
            grad_h = grad_h.mul_(scale.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(ctx.weight_dtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(scale).to(ctx.weight_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def _check_chunks(chunks: Any) -> None:
    if chunks is not None and (
        isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1
    ):
        raise ValueError(
            f"forget: chunks must be None (chosen from the sizes) or a whole number of at "
            f"least 1, got {chunks!r}."
        )


def _causal_lm(model: Any) -> Any:
    """``model`` (or its PEFT base) as a causal LM chunk_loss can serve; TypeError where not."""
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError as exc:  # pragma: no cover - transformers is a test dependency
        raise ImportError(
            'forget: chunk_loss needs transformers: pip install "transformers>=5"'
        ) from exc
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    name = type(base).__name__
    if not isinstance(base, PreTrainedModel):
        raise TypeError(
            f"forget: chunk_loss takes a transformers causal LM (a PreTrainedModel), got "
            f"{name}; for your own model, run its head and loss through forget.chunked "
            "(docs/head.md)."
        )
    head = base.get_output_embeddings()
    if not isinstance(getattr(base, "lm_head", None), nn.Linear) or head is not base.lm_head:
        raise TypeError(
            f"forget: chunk_loss needs a causal LM whose output embeddings are a linear "
            f"lm_head, and {name} has {type(getattr(base, 'lm_head', None)).__name__} there."
        )
    if head.out_features != getattr(base.config, "vocab_size", head.out_features):
        raise TypeError(
            f"forget: {name}'s lm_head has {head.out_features} outputs and its config a "
            f"vocabulary of {base.config.vocab_size}; transformers' loss views the logits by "
            "the config's, which chunk_loss does not reproduce."
        )
    if not isinstance(getattr(base, base.base_model_prefix, None), nn.Module):
        raise TypeError(f"forget: chunk_loss finds no base model in {name}.")
    params = inspect.signature(type(base).forward).parameters
    if "labels" not in params or "logits_to_keep" not in params:
        raise TypeError(
            f"forget: chunk_loss needs a forward that takes labels and logits_to_keep "
            f"(transformers' causal LMs do), and {name}.forward takes "
            f"{', '.join(params) or 'neither'}."
        )
    if base.loss_function is not ForCausalLMLoss:
        raise TypeError(
            f"forget: {name} computes its loss with {base.loss_function!r}, not "
            "transformers' ForCausalLMLoss, and chunk_loss honours only that one (the "
            "shift, ignore_index, num_items_in_batch); run your loss through forget.chunked "
            "instead (docs/head.md)."
        )
    return base


def _var_keyword(signature: inspect.Signature) -> str:
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return p.name
    return "\0"


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` has no data to compare (a fake or meta tensor, or a fake mode on: the
    planner's counting run)."""
    if t.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import is_fake

    fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return fake_mode is not None or bool(is_fake(t))
