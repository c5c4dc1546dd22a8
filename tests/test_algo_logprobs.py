"""``rloo_lightning.algo.logprobs`` against small hand-computed tensors (expected values are literals worked out by
hand) and naive references: token log-probs (temperature, chunks, gradients), entropy, the completion mask and
the masked sums.
"""

from __future__ import annotations

import math

import pytest
import torch

from rloo_lightning.algo.logprobs import completion_mask, masked_sum, token_entropy, token_logprobs
from rloo_lightning.algo.losses import aggregate_token_loss


nan = float("nan")


# ---------------------------------------------------------------------------------------------
# token_logprobs
# ---------------------------------------------------------------------------------------------
def _naive_logprobs(logits, tokens, temperature):
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_token_logprobs_hand_example():
    # row 0: logits [0, 0]        -> p = [1/2, 1/2],        token 1 -> ln(1/2)
    # row 1: logits [0, ln 3]     -> p = [1/4, 3/4],        token 1 -> ln(3/4), token 0 -> ln(1/4)
    # with T = 0.5, row 1 becomes [0, 2 ln 3] -> p = [1/10, 9/10]: token 1 -> ln(0.9)
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    tokens = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(
        token_logprobs(logits, tokens), torch.tensor([[math.log(0.5), math.log(0.75), math.log(0.25)]])
    )
    torch.testing.assert_close(
        token_logprobs(logits, tokens, temperature=0.5),
        torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.1)]]),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_matches_naive(temperature, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 17, generator=g) * 4).to(dtype)
    tokens = torch.randint(0, 17, (3, 5), generator=g)
    out = token_logprobs(logits, tokens, temperature)
    assert out.dtype == torch.float32
    assert out.shape == (3, 5)
    # the reference upcasts the (bf16) values to fp32 before the softmax
    torch.testing.assert_close(out, _naive_logprobs(logits, tokens, temperature), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_gradient_matches_naive(temperature, dtype):
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(2, 6, 13, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 13, (2, 6), generator=g)
    weights = torch.randn(2, 6, generator=g)

    a = base.clone().requires_grad_(True)
    (token_logprobs(a, tokens, temperature) * weights).sum().backward()
    b = base.clone().requires_grad_(True)
    (_naive_logprobs(b, tokens, temperature) * weights).sum().backward()
    assert a.grad.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(a.grad, b.grad, **tol)
    assert a.grad.abs().sum() > 0


def test_token_logprobs_gradient_float64_input():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    # Compare against autograd of the naive float64 function (token_logprobs computes in fp32).
    out = token_logprobs(logits, tokens, 0.7)
    grad = torch.autograd.grad(out.sum(), logits)[0]
    naive = torch.autograd.grad(
        torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None]).sum(), logits
    )[0]
    torch.testing.assert_close(grad, naive, rtol=1e-5, atol=1e-6)


def test_token_logprobs_chunking_and_noncontiguous_input():
    g = torch.Generator().manual_seed(4)
    full = torch.randn(3, 8, 11, generator=g) * 2
    logits = full[:, :-1]  # a non-contiguous view, as completion_logits returns
    assert not logits.is_contiguous()
    tokens = torch.randint(0, 11, (3, 7), generator=g)
    w = torch.randn(3, 7, generator=g)

    ref_in = logits.detach().clone().requires_grad_(True)
    ref = token_logprobs(ref_in, tokens, 0.7, chunk_size=1024)
    (ref * w).sum().backward()
    for chunk in (1, 3, 5, 21):  # 21 rows in total
        x = full.detach().clone().requires_grad_(True)
        out = token_logprobs(x[:, :-1], tokens, 0.7, chunk_size=chunk)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        (out * w).sum().backward()
        torch.testing.assert_close(x.grad[:, :-1], ref_in.grad, rtol=0, atol=1e-6)
        assert torch.all(x.grad[:, -1] == 0)
    torch.testing.assert_close(ref, _naive_logprobs(logits, tokens, 0.7))


@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_token_logprobs_nonpositive_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature)


def test_token_logprobs_shape_mismatch_raises():
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# token_entropy
# ---------------------------------------------------------------------------------------------
def test_token_entropy_hand_values():
    # uniform over 4 -> ln 4; [0, ln 3] -> p = [1/4, 3/4] -> H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])
    h = token_entropy(logits)
    expected = torch.tensor([[math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    torch.testing.assert_close(h, expected)
    # a (near) one-hot distribution has entropy ~0
    assert token_entropy(torch.tensor([[[50.0, 0.0, 0.0]]])).item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_entropy_matches_naive_and_non_negative(temperature, dtype):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 6, 19, generator=g) * 8).to(dtype)
    h = token_entropy(logits, temperature, chunk_size=5)
    logp = torch.log_softmax(logits.float() / temperature, -1)
    naive = -(logp.exp() * logp).sum(-1)
    assert h.dtype == torch.float32 and h.shape == (4, 6)
    torch.testing.assert_close(h, naive, rtol=1e-5, atol=1e-6)
    assert (h >= 0).all()
    assert (h <= math.log(19) + 1e-5).all()


# ---------------------------------------------------------------------------------------------
# completion_mask
# ---------------------------------------------------------------------------------------------
def test_completion_mask_up_to_and_including_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 8],
                        [2, 5, 5, 5, 5],
                        [5, 5, 5, 5, 2],
                        [5, 2, 6, 2, 6]])
    expected = torch.tensor([[1, 1, 1, 0, 0],
                             [1, 0, 0, 0, 0],
                             [1, 1, 1, 1, 1],
                             [1, 1, 0, 0, 0]], dtype=torch.float32)
    m = completion_mask(ids, [2])
    assert m.dtype.is_floating_point
    torch.testing.assert_close(m, expected)
    torch.testing.assert_close(completion_mask(ids, torch.tensor([2])), expected)


def test_completion_mask_multiple_eos_ids():
    ids = torch.tensor([[5, 9, 6, 2, 7],
                        [5, 6, 2, 9, 7],
                        [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 1]], dtype=torch.float32)
    torch.testing.assert_close(completion_mask(ids, [2, 9]), expected)


def test_completion_mask_no_eos_is_all_ones():
    ids = torch.tensor([[4, 5, 6], [7, 8, 4]])
    torch.testing.assert_close(completion_mask(ids, [2]), torch.ones(2, 3))


def test_completion_mask_pad_equals_eos_keeps_exactly_the_first_eos():
    # pad == eos == 2: generate pads finished rows with 2 after the real EOS
    ids = torch.tensor([[5, 6, 2, 2, 2, 2],
                        [5, 2, 2, 2, 2, 2],
                        [5, 6, 7, 8, 9, 2]])
    m = completion_mask(ids, [2])
    torch.testing.assert_close(
        m, torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    )
    # exactly one EOS inside each mask
    assert ((ids == 2).float() * m).sum(1).tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# masked_sum / the token means of the loss / the sequence KL / the policy loss
# ---------------------------------------------------------------------------------------------
def test_masked_sum_and_mean_ignore_nan_and_inf_at_masked_positions():
    inf = float("inf")
    values = torch.tensor([[1.0, 2.0, nan], [inf, 3.0, -inf], [nan, inf, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # row sums: 1+2 = 3, 3, (none) 0
    torch.testing.assert_close(masked_sum(values, mask), torch.tensor([3.0, 3.0, 0.0]))
    # the loss's masked means (masked_mean's job): row means 3/2, 3/1, 0 (no valid entry -> 0, not NaN),
    # averaged over the 3 rows (seq_mean_token_mean): 1.5; global mean (token_mean): (1 + 2 + 3) / 3 = 2
    assert aggregate_token_loss(values, mask, "seq_mean_token_mean").item() == pytest.approx(4.5 / 3)
    torch.testing.assert_close(aggregate_token_loss(values, mask, "token_mean"), torch.tensor(2.0))
    # column sums (dim=0): [1, 2+3, 0]
    torch.testing.assert_close(masked_sum(values, mask, dim=0), torch.tensor([1.0, 5.0, 0.0]))
    assert aggregate_token_loss(values, torch.zeros_like(mask), "token_mean").item() == 0.0
    assert aggregate_token_loss(values, torch.zeros_like(mask), "seq_mean_token_mean").item() == 0.0


def test_masked_sum_gradient_is_finite_with_nan_in_masked_positions():
    values = torch.tensor([[1.0, nan, 2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    (masked_sum(values, mask) * 3).sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[3.0, 0.0, 3.0]]))


def test_default_chunks_are_bounded_by_elements_not_rows(monkeypatch):
    """The default chunk holds CHUNK_ELEMENTS fp32 values whatever the vocabulary; results and gradients are
    those of the unchunked computation."""
    from rloo_lightning.algo import logprobs

    assert logprobs._chunk_rows(None, 49152) == (1 << 24) // 49152 == 341
    assert logprobs._chunk_rows(None, 151936) == 110 and logprobs._chunk_rows(None, 1 << 30) == 1
    assert logprobs._chunk_rows(7, 49152) == 7
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 12)  # V = 5: 2 rows a chunk, 8 positions -> 4 chunks
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 4), generator=g)
    logp = token_logprobs(logits, tokens, temperature=0.7)
    naive = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(logp, naive.float(), rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    (naive_grad,) = torch.autograd.grad(naive.sum(), logits)
    torch.testing.assert_close(grad, naive_grad, rtol=1e-5, atol=1e-6)
    p = torch.softmax(logits.detach() / 0.7, -1)
    torch.testing.assert_close(token_entropy(logits.detach(), 0.7), -(p * p.log()).sum(-1).float(),
                               rtol=1e-6, atol=1e-6)
