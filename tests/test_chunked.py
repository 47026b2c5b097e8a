"""forget.chunked: a function on slices of its inputs, each slice a forgotten region.

Differential throughout: against the plain function on the whole input where only
the cut differs (allclose: a matmul over fewer rows may round differently), and
bitwise against the plain loop over the same slices, or against `forget.forget`
for ``chunks=1`` (issue 43, item 1; NOTE [chunked regions]).
"""

from __future__ import annotations

import copy
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import forget
from test_core import Counted, _grads  # the engine tests' call counter, gradients


def _leaf(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, requires_grad=True)


def _plain_loop(func, x, chunks, dim=0):
    """The plain reference for a concatenated output: func on each slice, joined by hand."""
    return torch.cat([func(c) for c in x.tensor_split(chunks, dim)], dim)


def _head(seed=0, tokens=12, width=8, vocab=50):
    torch.manual_seed(seed)
    head = nn.Linear(width, vocab)
    h = _leaf(seed + 1, tokens, width)
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
    return head, h, labels


CHUNKS = [1, 2, 3, 4, 5, 12, 16]


# --- a head and its loss, a token-wise MLP ----------------------------------------------


@pytest.mark.parametrize("chunks", CHUNKS, ids=[f"chunks={c}" for c in CHUNKS])
def test_head_with_summed_cross_entropy_matches_the_plain_loss_and_gradients(chunks):
    head, h, labels = _head()

    def loss_of(a, y):
        return F.cross_entropy(head(a), y, reduction="sum")

    plain = loss_of(h, labels)
    plain.backward()
    expected = _grads(h, head.weight, head.bias)
    h.grad = None
    head.zero_grad(set_to_none=True)
    loss = forget.chunked(loss_of, h, labels, chunks=chunks)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, plain)
    loss.backward()
    for got, want in zip(_grads(h, head.weight, head.bias), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_a_mean_is_the_summed_loss_divided_by_the_whole_count():
    # The docstring's rule: a mean over the slices is not the mean; divide the sum.
    head, h, labels = _head(tokens=10)
    loss = forget.chunked(
        lambda a, y: F.cross_entropy(head(a), y, reduction="sum"), h, labels, chunks=4
    )
    torch.testing.assert_close(loss / labels.numel(), F.cross_entropy(head(h), labels))


def test_one_chunk_is_forget_bit_for_bit():
    head, h, labels = _head()
    f = Counted(lambda a, y: F.cross_entropy(head(a), y, reduction="sum"))
    results = []
    for run in (forget.forget, lambda *a: forget.chunked(*a, chunks=1)):
        h.grad = None
        head.zero_grad(set_to_none=True)
        before = f.calls
        loss = run(f, h, labels)
        loss.backward()
        results.append((loss.detach(), *_grads(h, head.weight, head.bias), f.calls - before))
    ours, theirs = results[1], results[0]
    assert ours[-1] == theirs[-1] == 2  # forward and one re-run, alike
    for a, b in zip(ours[:-1], theirs[:-1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dim", [1, -2], ids=["dim=1", "dim=-2"])
@pytest.mark.parametrize("chunks", [1, 3, 10], ids=["chunks=1", "chunks=3", "chunks=10"])
def test_token_wise_mlp_in_chunks_along_tokens_matches_the_plain_mlp(chunks, dim):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6))
    x = _leaf(1, 2, 10, 6)
    plain = mlp(x)
    plain.square().sum().backward()
    expected = _grads(x, *mlp.parameters())
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    out = forget.chunked(mlp, x, chunks=chunks, dim=dim)
    assert out.shape == plain.shape
    torch.testing.assert_close(out, plain)
    out.square().sum().backward()
    for got, want in zip(_grads(x, *mlp.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_token_wise_mlp_is_bitwise_the_plain_loop_over_the_same_slices():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6))
    x = _leaf(1, 2, 10, 6)
    plain = _plain_loop(mlp, x, 3, dim=1)
    plain.square().sum().backward()
    expected = _grads(x, *mlp.parameters())
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    out = forget.chunked(mlp, x, chunks=3, dim=1)
    assert torch.equal(out, plain)
    out.square().sum().backward()
    for got, want in zip(_grads(x, *mlp.parameters()), expected, strict=True):
        assert torch.equal(got, want)


# --- re-runs, counted, and the memory they hold -----------------------------------------


@pytest.mark.parametrize(
    ("size", "chunks", "parts"),
    [(8, 1, 1), (8, 4, 4), (7, 3, 3), (3, 10, 3)],
    ids=["8/1", "8/4", "7/3", "3/10"],
)
def test_func_runs_once_per_chunk_in_forward_and_once_more_in_backward(size, chunks, parts):
    x = _leaf(2, size, 3)
    _plain_loop(lambda a: a.exp().sin(), x, parts).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    f = Counted(lambda a: a.exp().sin())
    out = forget.chunked(f, x, chunks=chunks)
    assert f.calls == parts
    assert f.flags == [False] * parts
    out.sum().backward()
    assert f.calls == 2 * parts
    assert f.flags == [False] * parts + [True] * parts
    assert torch.equal(x.grad, expected)


def test_no_grad_runs_each_chunk_once_and_matches():
    x = _leaf(3, 6, 2)
    f = Counted(lambda a: a.exp())
    with torch.no_grad():
        out = forget.chunked(f, x, chunks=3)
    assert f.calls == 3 and f.flags == [False] * 3
    assert not out.requires_grad
    assert torch.equal(out, _plain_loop(torch.exp, x.detach(), 3))


@pytest.mark.parametrize("chunks", [2, 4, 8], ids=["chunks=2", "chunks=4", "chunks=8"])
def test_backward_holds_one_chunks_intermediates_at_a_time(chunks):
    w = _leaf(4, 16, 256)
    x = _leaf(5, 32, 16)
    forward_refs: list[weakref.ref[torch.Tensor]] = []
    rerun_refs: list[weakref.ref[torch.Tensor]] = []
    freed_at_start: list[list[bool]] = []
    firsts: list[float] = []

    def f(a):
        rerunning = forget.in_recomputing()
        if rerunning:  # every earlier re-run's intermediate, already freed?
            freed_at_start.append([r() is None for r in rerun_refs])
            firsts.append(a[0, 0].item())
        big = (a @ w).exp()  # tokens x 256: the intermediate that dwarfs the input
        (rerun_refs if rerunning else forward_refs).append(weakref.ref(big))
        return big.sin().sum()

    loss = forget.chunked(f, x, chunks=chunks)
    assert [r() for r in forward_refs] == [None] * chunks  # forgotten in forward
    loss.backward()
    assert freed_at_start == [[True] * j for j in range(chunks)]
    assert [r() for r in rerun_refs] == [None] * chunks
    # NOTE [chunked regions]: the last slice re-runs first, then each earlier one.
    starts = [c[0, 0].item() for c in x.detach().tensor_split(chunks)]
    assert firsts == starts[::-1]


def _head_backward_peak(chunks):
    torch.manual_seed(0)
    head = nn.Linear(8, 1024)
    h = _leaf(6, 64, 8)
    labels = torch.randint(0, 1024, (64,), generator=torch.Generator().manual_seed(0))

    def step():
        loss = forget.chunked(
            lambda a, y: F.cross_entropy(head(a), y, reduction="sum"), h, labels, chunks=chunks
        )
        loss.backward()

    report = forget.measure(step)
    grad_bytes = sum(t.grad.nbytes for t in (h, head.weight, head.bias))
    return report.backward_peak_bytes, grad_bytes


def test_backward_peak_falls_with_the_chunk_count():
    # One chunk rebuilds the whole 64 x 1024 float logits (256 KiB), and holds their
    # log-softmax and its gradient beside them in backward; eight chunks hold an eighth
    # of that at a time, beside the gradients of h and of the head (38 KiB), which both
    # hold in full. A quarter leaves room for a slice's transients.
    peak_1, grad_bytes = _head_backward_peak(1)
    peak_8, _ = _head_backward_peak(8)
    logits_bytes = 64 * 1024 * 4
    assert peak_1 >= 2 * logits_bytes  # the logits dominate: the bound below means something
    assert peak_8 <= peak_1 // 4 + grad_bytes


# --- the engine's contract, slice by slice ----------------------------------------------


@pytest.mark.parametrize("chunks", [1, 4, 10], ids=["chunks=1", "chunks=4", "chunks=10"])
def test_dropout_is_replayed_bitwise_as_the_plain_loop(chunks):
    def f(a):
        return F.dropout(a.exp(), 0.5, training=True) * a.sin()

    results = []
    for run in (
        lambda a: _plain_loop(f, a, chunks),
        lambda a: forget.chunked(f, a, chunks=chunks),
    ):
        x = _leaf(7, 10, 3)
        torch.manual_seed(0)
        out = run(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, torch.rand(2)))  # and the stream after
    plain, ours = results
    assert (plain[0] == 0).any()  # dropout did drop
    for a, b in zip(ours, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunks", [1, 3], ids=["chunks=1", "chunks=3"])
def test_batchnorm_state_is_updated_once_per_chunk_not_again_in_backward(chunks):
    torch.manual_seed(0)
    plain_bn = nn.BatchNorm1d(5)
    ours_bn = copy.deepcopy(plain_bn)
    x = _leaf(8, 12, 5)
    for _ in range(2):
        x.grad = None
        plain = _plain_loop(plain_bn, x, chunks)
        plain.square().sum().backward()
        expected = x.grad.clone()
        x.grad = None
        out = forget.chunked(ours_bn, x, chunks=chunks)
        assert torch.equal(out, plain)
        out.square().sum().backward()
        assert torch.equal(x.grad, expected)
    assert ours_bn.num_batches_tracked.item() == 2 * chunks
    for (name, a), b in zip(
        plain_bn.state_dict().items(), ours_bn.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def _inner(a):
    return a.exp().cos()


NESTED = {
    "chunked in forget": (
        lambda a: forget.forget(lambda b: forget.chunked(_inner, b.sin(), chunks=3).tanh(), a),
        lambda a: _plain_loop(_inner, a.sin(), 3).tanh(),
    ),
    "forget in chunked": (
        lambda a: forget.chunked(lambda b: forget.forget(_inner, b).sin(), a, chunks=3),
        lambda a: _plain_loop(lambda b: _inner(b).sin(), a, 3),
    ),
    "chunked in chunked": (
        lambda a: forget.chunked(
            lambda b: forget.chunked(_inner, b, chunks=2, dim=1).sin(), a, chunks=3
        ),
        lambda a: _plain_loop(lambda b: _plain_loop(_inner, b, 2, dim=1).sin(), a, 3),
    ),
}


@pytest.mark.parametrize("case", list(NESTED))
def test_nested_regions_give_the_plain_gradients(case):
    ours, plain = NESTED[case]
    x = _leaf(9, 7, 4)
    expected = plain(x)
    expected.square().sum().backward()
    expected_grad = x.grad.clone()
    x.grad = None
    out = ours(x)
    assert torch.equal(out, expected)
    out.square().sum().backward()
    assert torch.equal(x.grad, expected_grad)


@pytest.mark.parametrize("chunks", [1, 3], ids=["chunks=1", "chunks=3"])
def test_double_backward_through_a_chunked_func_matches_plain(chunks):
    def f(a):
        return (a.sin() * a.exp()).sum()

    def plain(a):
        return sum(f(c) for c in a.tensor_split(chunks)) if chunks > 1 else f(a)

    x = _leaf(10, 9)
    (g1,) = torch.autograd.grad(plain(x), x, create_graph=True)
    (gg1,) = torch.autograd.grad(g1.square().sum(), x)
    (g2,) = torch.autograd.grad(forget.chunked(f, x, chunks=chunks), x, create_graph=True)
    (gg2,) = torch.autograd.grad(g2.square().sum(), x)
    assert torch.equal(g2, g1)
    assert torch.equal(gg2, gg1)


# --- outputs, arguments ------------------------------------------------------------------


def test_a_tuple_of_a_tensor_and_a_loss_joins_element_by_element():
    x = _leaf(11, 7, 2)

    def f(a):
        return a.exp(), a.square().sum()

    parts = [f(c) for c in x.tensor_split(3)]
    plain_out = torch.cat([p[0] for p in parts])
    plain_loss = (parts[0][1] + parts[1][1]) + parts[2][1]
    (plain_out.sum() + plain_loss).backward()
    expected = x.grad.clone()
    x.grad = None
    out = forget.chunked(f, x, chunks=3)
    assert isinstance(out, tuple) and len(out) == 2
    assert torch.equal(out[0], plain_out)
    assert out[1].dim() == 0 and torch.equal(out[1], plain_loss)
    (out[0].sum() + out[1]).backward()
    assert torch.equal(x.grad, expected)


def test_a_one_tuple_stays_a_one_tuple():
    x = _leaf(12, 6)
    out = forget.chunked(lambda a: (a * 2,), x, chunks=3)
    assert isinstance(out, tuple) and len(out) == 1
    assert torch.equal(out[0], x.detach() * 2)


def _by_call(*answers):
    """A func returning ``answers[k](a)`` on its k-th call."""
    calls: list[int] = []

    def f(a):
        calls.append(1)
        return answers[min(len(calls), len(answers)) - 1](a)

    return f


MISMATCHED = {
    "tensor then tuple": _by_call(lambda a: a * 2, lambda a: (a * 2,)),
    "tuple then tensor": _by_call(lambda a: (a * 2,), lambda a: a * 2),
    "tuple of 2 then of 1": _by_call(lambda a: (a * 2, a * 3), lambda a: (a * 2,)),
    "tuple of 1 then of 2": _by_call(lambda a: (a * 2,), lambda a: (a * 2, a * 3)),
}


@pytest.mark.parametrize("case", list(MISMATCHED))
def test_slices_returning_different_structures_raise_type_error(case):
    x = _leaf(13, 6)
    with pytest.raises(TypeError, match=r"^forget: .*every slice must return the same structure"):
        forget.chunked(MISMATCHED[case], x, chunks=3)


def test_a_loss_in_one_slice_and_a_vector_in_another_is_a_value_error():
    x = _leaf(14, 6)
    f = _by_call(lambda a: a.sum(), lambda a: a * 2)
    with pytest.raises(ValueError, match=r"^forget: the output of func is joined .*shapes"):
        forget.chunked(f, x, chunks=3)


@pytest.mark.parametrize("value", [[1], None, 3.5], ids=["list", "None", "float"])
def test_a_non_tensor_output_raises_type_error(value):
    x = _leaf(15, 6)
    with pytest.raises(TypeError, match=f"^forget: .*{type(value).__name__} was returned"):
        forget.chunked(lambda a: value, x, chunks=3)


def test_non_tensor_arguments_go_whole_to_every_chunk():
    x = _leaf(16, 6, 2)
    _plain_loop(lambda a: (a * 3.0).exp(), x, 3).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    tag = object()
    seen: list[tuple[float, object, tuple[int, ...]]] = []

    def f(a, k, t):
        seen.append((k, t, tuple(a.shape)))
        return (a * k).exp()

    out = forget.chunked(f, x, 3.0, tag, chunks=3)
    assert [(k, t) for k, t, _ in seen] == [(3.0, tag)] * 3
    assert [s for _, _, s in seen] == [(2, 2)] * 3
    out.sum().backward()
    assert [(k, t) for k, t, _ in seen] == [(3.0, tag)] * 6
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("chunks", [1, 4], ids=["chunks=1", "chunks=4"])
def test_closure_parameters_get_gradients_when_no_input_requires_grad(chunks):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(8, 4)  # no grad

    def f(a):
        return lin(a).tanh()

    _plain_loop(f, x, chunks).square().sum().backward()
    expected = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    forget.chunked(f, x, chunks=chunks).square().sum().backward()
    for p, want in zip(lin.parameters(), expected, strict=True):
        assert torch.equal(p.grad, want)


def test_more_chunks_than_positions_gives_one_slice_per_position():
    x = _leaf(17, 3, 2)
    shapes: list[tuple[int, ...]] = []

    def f(a):
        shapes.append(tuple(a.shape))
        return a.exp().sin()

    out = forget.chunked(f, x, chunks=10)
    assert shapes == [(1, 2)] * 3
    expected = _plain_loop(lambda a: a.exp().sin(), x, 3)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert shapes == [(1, 2)] * 6  # and one re-run per slice


def test_numpy_float_arrays_become_tensors_that_require_grad():
    seen: list[torch.Tensor] = []

    def f(a):
        seen.append(a)
        return (a * a).sum()

    arr = np.arange(6, dtype=np.float32)
    loss = forget.chunked(f, arr, chunks=3)
    assert len(seen) == 3
    assert all(isinstance(a, torch.Tensor) and a.requires_grad for a in seen)
    assert torch.equal(loss.detach(), torch.tensor(float((arr * arr).sum())))
    loss.backward()
    leaf = seen[0]._base  # the slices are views of one tensor made from the array
    assert leaf is not None and all(a._base is leaf for a in seen)
    assert torch.equal(leaf.grad, torch.from_numpy(arr * 2))


# --- bad input ---------------------------------------------------------------------------


def _bad(case):
    """(args, kwargs) for `forget.chunked`, the error type, and the message's pattern."""
    x = torch.randn(6, 4)
    return {
        "chunks=0": ((x,), {"chunks": 0}, ValueError, "chunks must be a whole number.* got 0"),
        "chunks=-1": ((x,), {"chunks": -1}, ValueError, "chunks must be a whole .* got -1"),
        "chunks=1.5": ((x,), {"chunks": 1.5}, ValueError, "chunks must be a whole .* got 1.5"),
        "chunks=True": ((x,), {"chunks": True}, ValueError, "chunks must be .* got True"),
        "chunks='2'": ((x,), {"chunks": "2"}, ValueError, "chunks must be .* got '2'"),
        "sizes differ": (
            (x, torch.zeros(4)),
            {"chunks": 2},
            ValueError,
            r"agree in size .* got 6 \(1st input\), 4 \(2nd input\)",
        ),
        "sizes differ past a constant": (
            (x, 3, torch.zeros(5, 1)),
            {"chunks": 2},
            ValueError,
            r"got 6 \(1st input\), 5 \(3rd input\)",
        ),
        "0-dim input": (
            (x, torch.tensor(2.0)),
            {"chunks": 2},
            ValueError,
            r"the 2nd input has 0 dimension\(s\)",
        ),
        "0-dim input, one chunk": (
            (torch.tensor(2.0),),
            {"chunks": 1},
            ValueError,
            r"the 1st input has 0 dimension\(s\)",
        ),
        "dim out of range": ((x,), {"chunks": 2, "dim": 2}, ValueError, "split along dim 2"),
        "dim a string": ((x,), {"chunks": 2, "dim": "0"}, TypeError, "dim must be an int"),
        "no tensor input": ((3.0, "tag"), {"chunks": 2}, ValueError, "none of xs is a tensor"),
        "no input": ((), {"chunks": 2}, ValueError, "none of xs is a tensor"),
        "numpy integers": (
            (np.arange(6),),
            {"chunks": 2},
            TypeError,
            "numpy array of dtype int64",
        ),
    }[case]


BAD = [
    "chunks=0",
    "chunks=-1",
    "chunks=1.5",
    "chunks=True",
    "chunks='2'",
    "sizes differ",
    "sizes differ past a constant",
    "0-dim input",
    "0-dim input, one chunk",
    "dim out of range",
    "dim a string",
    "no tensor input",
    "no input",
    "numpy integers",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_before_func_runs_and_mutates_nothing(case):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    before = copy.deepcopy(lin.state_dict())
    f = Counted(lambda a, *rest: lin(a))
    args, kwargs, error, pattern = _bad(case)
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    rng = torch.get_rng_state()
    with pytest.raises(error, match=f"^forget: .*{pattern}"):
        forget.chunked(f, *args, **kwargs)
    assert f.calls == 0
    assert all(p.grad is None for p in lin.parameters())
    for (name, a), b in zip(before.items(), lin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(args, copies, strict=True):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("func", [1, None, "head"], ids=["int", "None", "str"])
def test_func_not_callable_is_a_type_error(func):
    x = torch.randn(4, 2)
    with pytest.raises(
        TypeError, match=f"^forget: func must be callable, but got {type(func).__name__}"
    ):
        forget.chunked(func, x, chunks=2)
