"""log_probs_from_hidden: token log-probs and entropy from hidden states, chunked, own backward."""

import pytest
import torch
from memory_helpers import LiveBytes

from ppokit.algo import entropy_from_logits, log_probs_from_hidden, log_probs_from_logits
from ppokit.algo.hidden_log_probs import DEFAULT_CHUNK_ELEMENTS, default_chunk_size

D64 = torch.float64


def _inputs(n=3, T=5, D=6, V=11, seed=0, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, T, D, generator=g, dtype=dtype)
    w = torch.randn(V, D, generator=g, dtype=dtype) * 0.7
    b = torch.randn(V, generator=g, dtype=dtype)
    y = torch.randint(0, V, (n, T), generator=g)
    return h, w, b, y


def _naive(h, w, b, y, temperature):
    """Per-position loop in float64 from explicit logits: (log p(y), entropy)."""
    n, T = y.shape
    lp, ent = torch.empty(n, T, dtype=D64), torch.empty(n, T, dtype=D64)
    for i in range(n):
        for t in range(T):
            z = h[i, t].double() @ w.double().T + (0 if b is None else b.double())
            logp = torch.log_softmax(z / temperature, -1)
            lp[i, t] = logp[y[i, t]]
            ent[i, t] = -sum(logp[v].exp() * logp[v] for v in range(z.shape[0]))
    return lp, ent


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1000])  # 4 and 7 do not divide the 15 positions
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_match_a_loop_and_the_logits_functions(chunk_size, temperature, with_bias):
    h, w, b, y = _inputs()
    b = b if with_bias else None
    lp, ent = log_probs_from_hidden(h, w, y, bias=b, temperature=temperature, entropy=True, chunk_size=chunk_size)
    assert lp.shape == ent.shape == (3, 5) and lp.dtype == ent.dtype == D64
    want_lp, want_ent = _naive(h, w, b, y, temperature)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
    z = (h @ w.T + (0 if b is None else b)) / temperature
    torch.testing.assert_close(lp, log_probs_from_logits(z, y), rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, entropy_from_logits(z), rtol=0, atol=1e-12)
    only_lp, none = log_probs_from_hidden(h, w, y, bias=b, temperature=temperature, chunk_size=chunk_size)
    assert none is None
    torch.testing.assert_close(only_lp, lp, rtol=0, atol=0)


def _autograd_reference(h, w, b, y, temperature, g_lp, g_ent):
    """Gradients by autograd through explicit float64 logits."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    logp = torch.log_softmax((h @ w.T + (0 if b is None else b)) / temperature, -1)
    lp = logp.gather(-1, y[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = (lp * g_lp).sum() + (0 if g_ent is None else (ent * g_ent).sum())
    inputs = [h, w] + ([] if b is None else [b])
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("use_entropy", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gradients_match_autograd_in_float64(chunk_size, temperature, use_entropy, with_bias):
    h, w, b, y = _inputs(seed=3)
    b = b if with_bias else None
    g = torch.Generator().manual_seed(5)
    g_lp = torch.randn(y.shape, generator=g, dtype=D64)
    g_ent = torch.randn(y.shape, generator=g, dtype=D64) if use_entropy else None
    want = _autograd_reference(h, w, b, y, temperature, g_lp, g_ent)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    lp, ent = log_probs_from_hidden(
        hh, ww, y, bias=bb, temperature=temperature, entropy=use_entropy, chunk_size=chunk_size
    )
    loss = (lp * g_lp).sum() + (0 if g_ent is None else (ent * g_ent).sum())
    got = torch.autograd.grad(loss, [hh, ww] + ([] if bb is None else [bb]))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
    torch.autograd.gradcheck(
        lambda h_, w_: log_probs_from_hidden(
            h_, w_, y[:1, :3], temperature=temperature, entropy=True, chunk_size=chunk_size
        ),
        (h[:1, :3].clone().requires_grad_(), w.clone().requires_grad_()),
    )


def test_masked_padding_positions_get_no_gradient():
    """Padding positions (label replaced by a valid id, masked in the loss) get no gradient; the
    rest get autograd's, for a loss on the log-probs and the entropy and on the entropy alone."""
    h, w, _, y = _inputs(n=4, T=6, seed=8)
    mask = torch.ones(4, 6, dtype=D64)
    mask[0, 3:] = 0  # a short response
    mask[2, 1:] = 0
    y = torch.where(mask.bool(), y, torch.zeros_like(y))  # pad id 0, as the batch layout has
    for c_lp, c_ent in ((1.0, 0.3), (0.0, 1.0)):
        hh = h.clone().requires_grad_()
        lp, ent = log_probs_from_hidden(hh, w, y, temperature=0.8, entropy=True, chunk_size=5)
        ((c_lp * lp + c_ent * ent) * mask).sum().backward()
        assert (hh.grad[mask == 0] == 0).all() and (hh.grad[mask == 1] != 0).any()
        (want,) = _autograd_reference(h, w, None, y, 0.8, c_lp * mask, c_ent * mask)[:1]
        torch.testing.assert_close(hh.grad, want, rtol=1e-10, atol=1e-12)


def test_float32_and_bf16_autocast_agree_with_the_plain_computation():
    """fp32 inputs: close to float64; under bf16 autocast the matmuls are bf16 (as lm_head's are),
    and the result is close to the plain path under the same autocast (head -> logits -> log-probs)."""
    h, w, b, y = _inputs(n=4, T=9, D=32, V=50, seed=11, dtype=torch.float32)
    lp, ent = log_probs_from_hidden(h, w, y, temperature=0.7, entropy=True, chunk_size=8)
    assert lp.dtype == torch.float32
    want_lp, want_ent = _naive(h, w, None, y, 0.7)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=1e-5)

    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_b, ent_b = log_probs_from_hidden(hb, wb, y, temperature=0.7, entropy=True, chunk_size=8)
        logits = torch.nn.functional.linear(hp, wp) / 0.7  # (n, T, V) bf16, as the plain path had them
        lp_p, ent_p = log_probs_from_logits(logits, y), entropy_from_logits(logits)
    assert lp_b.dtype == torch.float32
    # bf16 rounds the logits (about 4e-3 of their size; the plain path rounds once more dividing them)
    torch.testing.assert_close(lp_b, lp_p, rtol=0.02, atol=0.02)
    torch.testing.assert_close(ent_b, ent_p, rtol=0.02, atol=0.02)
    torch.testing.assert_close(lp_b.double(), want_lp, rtol=0.02, atol=0.02)
    (lp_b.sum() + ent_b.sum()).backward()
    (lp_p.sum() + ent_p.sum()).backward()
    assert hb.grad.dtype == torch.float32 and wb.grad.dtype == torch.float32
    for a, e in ((hb.grad, hp.grad), (wb.grad, wp.grad)):
        assert (a - e).norm() <= 0.05 * e.norm(), ((a - e).norm(), e.norm())
    # a bf16 hidden state and weight (a frozen bf16 lm_head) outside autocast: bf16 matmuls, float32 result
    lp16, _ = log_probs_from_hidden(h.bfloat16(), w.bfloat16(), y, temperature=0.7)
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, lp_b.detach(), rtol=0.02, atol=0.02)


def test_same_result_whatever_the_chunk_size_in_float32():
    h, w, b, y = _inputs(n=5, T=7, D=16, V=40, seed=2, dtype=torch.float32)
    ref, ref_ent = log_probs_from_hidden(h, w, y, bias=b, entropy=True, chunk_size=35)
    for c in (1, 3, 8, 34, 36):
        lp, ent = log_probs_from_hidden(h, w, y, bias=b, entropy=True, chunk_size=c)
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-6)


def test_single_position_and_empty_input():
    h, w, b, y = _inputs(n=1, T=1)
    lp, ent = log_probs_from_hidden(h, w, y, entropy=True)
    want_lp, want_ent = _naive(h, w, None, y, 1.0)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
    e = torch.zeros(2, 0, 6, dtype=D64, requires_grad=True)
    lp, ent = log_probs_from_hidden(e, w, torch.zeros(2, 0, dtype=torch.long), entropy=True)
    assert lp.shape == ent.shape == (2, 0)
    (lp.sum() + ent.sum()).backward()
    assert e.grad.shape == e.shape


def test_no_gradient_for_inputs_that_need_none():
    h, w, _, y = _inputs()
    hh = h.clone().requires_grad_()
    lp, _ = log_probs_from_hidden(hh, w, y)  # a frozen weight: only the hidden states get a gradient
    lp.sum().backward()
    assert hh.grad is not None and w.grad is None
    with torch.no_grad():
        lp, ent = log_probs_from_hidden(hh, w, y, entropy=True)
    assert not lp.requires_grad and not ent.requires_grad


def test_default_chunk_size_keeps_a_chunk_within_the_element_budget():
    assert default_chunk_size(152_064) * 152_064 <= DEFAULT_CHUNK_ELEMENTS
    assert default_chunk_size(152_064) == DEFAULT_CHUNK_ELEMENTS // 152_064
    assert default_chunk_size(56) >= 1_000_000  # a tiny vocabulary: the whole micro-batch at once
    assert default_chunk_size(10**9) == 1


# ----------------------------------------------------------------------------- memory


def test_peak_memory_is_bounded_by_the_chunk():
    n, T, D, V = 3, 4, 2, 8192
    N = n * T
    g = torch.Generator().manual_seed(7)
    h = torch.randn(n, T, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    y = torch.randint(0, V, (n, T), generator=g)
    row = V * 4  # bytes of one float32 logits row
    weight_bytes = V * D * 4  # the float32 gradient accumulator of a trainable weight

    def measure(fn):
        h.grad = w.grad = None
        mode = LiveBytes([h, w, y], V)
        with mode:
            lp, ent = fn()
            (lp.sum() + ent.sum()).backward()
        return mode

    peaks = {}
    for c in (1, 3, N):
        mode = measure(lambda: log_probs_from_hidden(h, w, y, temperature=0.9, entropy=True, chunk_size=c))
        assert mode.max_rows_of_v <= c, c  # no logits buffer ever holds more than a chunk of rows
        # at most: the log-softmax chunk, its logsumexp temporary, the probabilities, the (V, D) gradient
        assert mode.peak <= 3.25 * c * row + 2 * weight_bytes + 4096, (c, mode.peak)
        assert mode.peak >= 2 * c * row, (c, mode.peak)  # the tracker sees the chunk buffers
        peaks[c] = mode.peak
    assert peaks[1] < peaks[3] < peaks[N]
    assert peaks[1] < N * row  # less than one full float32 logits tensor
    full = measure(lambda: (log_probs_from_logits(h @ w.T / 0.9, y), entropy_from_logits(h @ w.T / 0.9)))
    assert full.max_rows_of_v == N and full.peak > 2 * N * row  # what the chunking avoids


def test_validation():
    h, w, b, y = _inputs()
    with pytest.raises(ValueError, match="hidden must be"):
        log_probs_from_hidden(h, w[:, :5], y)
    with pytest.raises(ValueError, match="labels shape"):
        log_probs_from_hidden(h, w, y[:, :4])
    with pytest.raises(ValueError, match="labels must be an integer"):
        log_probs_from_hidden(h, w, y.double())
    with pytest.raises(ValueError, match="bias must be None or shape"):
        log_probs_from_hidden(h, w, y, bias=b[:3])
    for t in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="temperature"):
            log_probs_from_hidden(h, w, y, temperature=t)
    for c in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            log_probs_from_hidden(h, w, y, chunk_size=c)
    with pytest.raises(ValueError, match="hidden must be a floating-point"):
        log_probs_from_hidden(h.long(), w, y)
