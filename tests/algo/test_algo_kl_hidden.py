"""kl_full_from_hidden: exact vocabulary KL from hidden states, chunked, with its own backward."""

import pytest
import torch
from memory_helpers import LiveBytes

from ppokit.algo import kl_full, kl_full_from_hidden

D64 = torch.float64


def _inputs(n=3, T=5, D=6, V=11, D_ref=None, seed=0, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, T, D, generator=g, dtype=dtype)
    rh = torch.randn(n, T, D_ref or D, generator=g, dtype=dtype)
    w = torch.randn(V, D, generator=g, dtype=dtype) * 0.7
    rw = torch.randn(V, D_ref or D, generator=g, dtype=dtype) * 0.7
    b = torch.randn(V, generator=g, dtype=dtype)
    rb = torch.randn(V, generator=g, dtype=dtype)
    return h, rh, w, rw, b, rb


def _naive(h, rh, w, rw, b, rb, temperature):
    """Per-position loop in float64: KL_t = sum_v p_v (log p_v - log q_v) from explicit logits."""
    n, T = h.shape[:2]
    out = torch.empty(n, T, dtype=D64)
    for i in range(n):
        for t in range(T):
            z = h[i, t].double() @ w.double().T + (0 if b is None else b.double())
            zr = rh[i, t].double() @ rw.double().T + (0 if rb is None else rb.double())
            logp = torch.log_softmax(z / temperature, -1)
            logq = torch.log_softmax(zr / temperature, -1)
            out[i, t] = sum(logp[v].exp() * (logp[v] - logq[v]) for v in range(z.shape[0]))
    return out


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 15, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_value_matches_a_loop_and_kl_full(chunk_size, temperature):
    h, rh, w, rw, b, rb = _inputs()
    # shared output layer (the LoRA case), no bias
    out = kl_full_from_hidden(h, rh, w, temperature=temperature, chunk_size=chunk_size)
    assert out.shape == (3, 5) and out.dtype == D64
    torch.testing.assert_close(out, _naive(h, rh, w, w, None, None, temperature), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, kl_full(h @ w.T / temperature, rh @ w.T / temperature), rtol=0, atol=1e-12)
    # a shared output layer shares its bias too
    shared = kl_full_from_hidden(h, rh, w, bias=b, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(shared, _naive(h, rh, w, w, b, b, temperature), rtol=0, atol=1e-12)
    # the reference's own weight: no bias unless ref_bias is given
    own = kl_full_from_hidden(h, rh, w, rw, bias=b, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(own, _naive(h, rh, w, rw, b, None, temperature), rtol=0, atol=1e-12)
    # identical distributions: zero up to rounding; KL is never negative beyond it
    assert kl_full_from_hidden(h, h, w, bias=b, chunk_size=chunk_size).abs().max() < 1e-13
    assert (out > -1e-13).all() and (shared > -1e-13).all()
    # separate reference weights of another hidden size, and biases
    h, rh, w, rw, b, rb = _inputs(D=6, D_ref=4, seed=1)
    out = kl_full_from_hidden(h, rh, w, rw, bias=b, ref_bias=rb, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(out, _naive(h, rh, w, rw, b, rb, temperature), rtol=0, atol=1e-12)


def _autograd_reference(h, rh, w, rw, b, rb, temperature, weights):
    """Gradients by autograd through explicit logits; the reference side is a constant."""
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    z = h @ w.T + (0 if b is None else b)
    with torch.no_grad():
        zr = rh @ rw.T + (0 if rb is None else rb)
    out = kl_full(z / temperature, zr / temperature)
    inputs = [h, w] + ([] if b is None else [b])
    return out, torch.autograd.grad((out * weights).sum(), inputs)


@pytest.mark.parametrize("chunk_size", [1, 4, 15])
def test_gradients_match_autograd_through_full_logits(chunk_size):
    h, rh, w, rw, b, rb = _inputs(D=5, D_ref=3, seed=2)
    weights = torch.randn(3, 5, dtype=D64, generator=torch.Generator().manual_seed(9))  # upstream dL/dKL
    ref_out, ref_grads = _autograd_reference(h, rh, w, rw, b, rb, 0.8, weights)
    hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
    out = kl_full_from_hidden(hh, rh, ww, rw, bias=bb, ref_bias=rb, temperature=0.8, chunk_size=chunk_size)
    grads = torch.autograd.grad((out * weights).sum(), (hh, ww, bb))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck(temperature):
    h, rh, w, rw, b, rb = _inputs(n=2, T=3, D=4, V=6, D_ref=5, seed=3)
    h.requires_grad_()
    # only the hidden states train, the reference shares the frozen weight (the LoRA case)
    assert torch.autograd.gradcheck(
        lambda h: kl_full_from_hidden(h, rh[..., :4], w, temperature=temperature, chunk_size=4), (h,)
    )
    # hidden, weight and bias train; the reference has its own weight and bias
    w.requires_grad_()
    b.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w, b: kl_full_from_hidden(h, rh, w, rw, bias=b, ref_bias=rb, temperature=temperature, chunk_size=5),
        (h, w, b),
    )
    # chunk of one row, weight without bias
    assert torch.autograd.gradcheck(lambda h, w: kl_full_from_hidden(h, rh, w, rw, chunk_size=1), (h, w))


def test_shared_trainable_weight_gets_the_policy_side_gradient_only():
    h, rh, w, _, b, _ = _inputs(seed=4)
    h.requires_grad_()
    rh.requires_grad_()
    w1 = w.clone().requires_grad_()
    w2 = w.clone().requires_grad_()
    kl_full_from_hidden(h, rh, w1, chunk_size=4).sum().backward()
    expected = torch.autograd.grad(kl_full_from_hidden(h, rh, w2, w.clone(), chunk_size=4).sum(), w2)[0]
    torch.testing.assert_close(w1.grad, expected, rtol=0, atol=0)
    assert rh.grad is None  # the reference is a constant


def test_bf16_inputs_compute_in_float32():
    h, rh, w, _, b, _ = _inputs(n=2, T=4, D=16, V=50, seed=5)
    hb, rhb, wb, bb = (x.bfloat16() for x in (h, rh, w, b))
    hb.requires_grad_()
    out = kl_full_from_hidden(hb, rhb, wb, bias=bb, chunk_size=3)  # the reference shares weight and bias
    assert out.dtype == torch.float32
    # the same bf16 values, computed in float64
    want = kl_full(hb.double() @ wb.double().T + bb.double(), rhb.double() @ wb.double().T + bb.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and torch.isfinite(hb.grad.float()).all()
    h64 = hb.detach().double().requires_grad_()
    kl_full(h64 @ wb.double().T + bb.double(), rhb.double() @ wb.double().T + bb.double()).sum().backward()
    torch.testing.assert_close(hb.grad.double(), h64.grad, rtol=2e-2, atol=2e-2)


def test_banned_tokens_contribute_nothing():
    h, rh, w, _, b, _ = _inputs(seed=6)
    b = b.clone()
    b[[0, 4]] = float("-inf")  # both models can never emit tokens 0 and 4
    h.requires_grad_()
    out = kl_full_from_hidden(h, rh, w, bias=b, chunk_size=2)
    keep = [v for v in range(w.shape[0]) if v not in (0, 4)]
    want = kl_full(h.detach() @ w[keep].T + b[keep], rh @ w[keep].T + b[keep])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    out.sum().backward()
    assert torch.isfinite(h.grad).all()


# ----------------------------------------------------------------------------- memory


def test_peak_memory_is_bounded_by_the_chunk():
    n, T, D, V = 3, 4, 2, 8192
    N = n * T
    g = torch.Generator().manual_seed(7)
    h = torch.randn(n, T, D, generator=g, requires_grad=True)
    rh = torch.randn(n, T, D, generator=g)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    row = V * 4  # bytes of one float32 logits row
    weight_bytes = V * D * 4  # the float32 gradient accumulator of a trainable weight

    def measure(fn):
        h.grad = w.grad = None
        mode = LiveBytes([h, rh, w], V)
        with mode:
            fn().sum().backward()
        return mode

    peaks = {}
    for c in (1, 3, N):
        mode = measure(lambda: kl_full_from_hidden(h, rh, w, chunk_size=c))
        assert mode.max_rows_of_v <= c, c  # no logits buffer ever holds more than a chunk of rows
        # at most: two float32 log-prob chunks, one logsumexp temporary, one bool mask, (V, D) gradient
        assert mode.peak <= 3.25 * c * row + 2 * weight_bytes + 4096, (c, mode.peak)
        assert mode.peak >= 2 * c * row, (c, mode.peak)  # the tracker sees the chunk buffers
        peaks[c] = mode.peak
    assert peaks[1] < peaks[3] < peaks[N]
    assert peaks[1] < N * row  # less than one full float32 logits tensor
    full = measure(lambda: kl_full(h @ w.T, rh @ w.T))
    assert full.max_rows_of_v == N and full.peak > 4 * N * row  # what the chunking avoids


def test_validation():
    h, rh, w, rw, b, _ = _inputs(D=6, D_ref=4)
    with pytest.raises(ValueError, match="weight shape"):
        kl_full_from_hidden(h, rh, w[:, :5])
    with pytest.raises(ValueError, match=r"ref_weight must be \(V, D_ref\) = \(11, 4\)"):
        kl_full_from_hidden(h, rh, w)  # the reference's hidden size differs: it needs its own weight
    with pytest.raises(ValueError, match="ref_hidden shape"):
        kl_full_from_hidden(h, rh[:, :4], w, rw)
    with pytest.raises(ValueError, match="bias must be None or shape"):
        kl_full_from_hidden(h, rh, w, rw, bias=b[:3])
    for t in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            kl_full_from_hidden(h, rh, w, rw, temperature=t)
    for c in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            kl_full_from_hidden(h, rh, w, rw, chunk_size=c)
    with pytest.raises(ValueError, match="hidden must be a floating-point"):
        kl_full_from_hidden(h.long(), rh, w, rw)
