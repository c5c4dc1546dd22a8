"""An exact test that the RLOO gradient estimator is unbiased, run through the project's own functions.

The toy is a tabular autoregressive policy small enough that every completion can be enumerated:
logits depend on (prompt, position, previous token), the vocabulary is ``{a, b, EOS}`` (by default)
and completions stop at the first EOS or after ``T`` tokens. By summation over all completions we
get the KL-regularised objective of the paper (Ahmadian et al. 2024, Sec. 2.3)

    J(theta) = mean_p ( E_{y ~ pi(.|p)} r(p, y) - beta * KL(pi(.|p) || pi_ref(.|p)) )

(KL of the *sequence* distributions) and its exact gradient by autograd. Separately, many
independent RLOO minibatches are sampled; each one's loss is formed exactly as
``RLOOModule.training_step`` steps 3-6 do, with ``token_logprobs``, ``completion_mask``,
``sequence_kl``, ``leave_one_out_advantages`` and ``policy_loss``; minus the gradient of that loss
is one draw of the estimator. A per-coordinate z-test of the mean of the draws against the exact
gradient, Bonferroni-corrected across coordinates, says whether the estimator is unbiased.

Vectorisation: all minibatches sit in one big batch, minibatch-major and prompt-major inside.
Every project function is row-wise or acts on contiguous groups of ``k`` rows, and ``policy_loss``
is a sum over rows, so with ``num_sequences = B`` (rows per minibatch) the big loss is exactly the
sum of the per-minibatch losses. The logits of every row are a separate leaf tensor, so the
gradient of the big loss w.r.t. the rows of minibatch ``m`` is the gradient of minibatch ``m``'s
loss alone; the chain rule back to the table (a gather) is an explicit ``index_add`` per minibatch.

Shapes: ``P`` prompts, ``T`` max completion length, ``V`` vocabulary (EOS included), ``k``
completions per prompt, ``B = P * k`` rows per minibatch, ``n`` minibatches, ``R = n * B`` rows,
``D = P * T * V * V`` coordinates of the table, ``C`` distinct completions per prompt.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rloo_lightning.objectives import (
    completion_mask,
    leave_one_out_advantages,
    masked_sum,
    policy_loss,
    sequence_kl,
    token_logprobs,
)
from rloo_lightning.variants import (
    MovingAverageBaseline,
    baseline_advantages,
    kl_per_token,
    reward_to_go,
    token_rewards_after_baseline,
)

__all__ = [
    "Toy",
    "ZTest",
    "make_toy",
    "enumerate_completions",
    "completion_probabilities",
    "exact_objective",
    "exact_gradient",
    "kl_placement_target",
    "sample_completions",
    "row_logits",
    "completion_code",
    "minibatch_gradients",
    "z_test",
    "check_estimator",
]

Baseline = Literal["leave_one_out", "none", "moving_average", "group_mean_std", "group_mean", "group_max"]
KLMode = Literal["reward_k1_detached", "loss_k1", "loss_k3", "reward_k1_not_detached", "token_reward_k1",
                 "reward_k2_detached", "reward_k3_detached"]
Aggregation = Literal["sequence_sum", "token_mean"]
ZeroVarianceFilter = Literal["off", "score", "shaped"]


@dataclass(frozen=True)
class Toy:
    """A tabular policy, its reference and a reward table.

    Attributes:
        policy_logits: ``[P, T, V, V]`` float64; ``[p, t, c, v]`` is the logit of token ``v`` at
            position ``t`` after context token ``c``. At ``t = 0`` the context is ``eos_id`` (it
            plays BOS, as in many LMs); afterwards it is the previous token.
        ref_logits: ``[P, T, V, V]`` float64, same layout, for the frozen reference.
        rewards: ``[P, (V + 1) ** T]`` float64, reward of each completion by ``completion_code``.
        temperature: sampling temperature; the sampled distribution is ``softmax(logits / T)``.
        eos_id: the EOS token.
        pad_id: written after the first EOS. It is a real token (not EOS), so a mask that leaks
            past EOS counts its log-prob and the test sees it.
    """

    policy_logits: Tensor
    ref_logits: Tensor
    rewards: Tensor
    temperature: float
    eos_id: int
    pad_id: int

    @property
    def num_prompts(self) -> int:
        return self.policy_logits.shape[0]

    @property
    def max_len(self) -> int:
        return self.policy_logits.shape[1]

    @property
    def vocab(self) -> int:
        return self.policy_logits.shape[-1]


def make_toy(
    num_prompts: int = 3,
    max_len: int = 3,
    vocab: int = 3,
    temperature: float = 0.7,
    logit_scale: float = 0.5,
    ref_noise: float = 0.35,
    rewards: Literal["uniform", "binary"] = "uniform",
    seed: int = 0,
) -> Toy:
    """A random toy. Temperature != 1 on purpose: it exercises ``token_logprobs``'s temperature.

    EOS is the last token id and padding is token 0. Policy logits are ``logit_scale * N(0, 1)``;
    the reference is the policy plus ``ref_noise * N(0, 1)``. The default scale keeps every token
    probability above 2%: a token drawn with probability ~1e-3 makes its coordinate's draws
    rare-event dominated, the sample variance unreliable at n ~ 1e4 and the z-test over-dispersed
    (measured: with scale 1 the family-wise false-alarm rate at alpha = 0.05 was ~25%).

    Args:
        rewards: ``uniform``: i.i.d. U(0, 1) per (prompt, completion), so every prompt has about
            the same mean reward and ties need identical completions. ``binary``: 0/1 with success
            rate ``linspace(0.2, 0.8)`` over the prompts (a verifiable-reward setting: prompts of
            different difficulty, and groups whose rewards are all equal are common).
    """
    if vocab < 2 or max_len < 1:
        raise ValueError(f"need vocab >= 2 and max_len >= 1, got vocab={vocab}, max_len={max_len}")
    g = torch.Generator().manual_seed(seed)
    shape = (num_prompts, max_len, vocab, vocab)
    policy = logit_scale * torch.randn(shape, generator=g, dtype=torch.float64)
    ref = policy + ref_noise * torch.randn(shape, generator=g, dtype=torch.float64)
    table = torch.rand((num_prompts, (vocab + 1) ** max_len), generator=g, dtype=torch.float64)
    if rewards == "binary":
        success = torch.linspace(0.2, 0.8, num_prompts, dtype=torch.float64)[:, None]
        table = (table < success).double()
    elif rewards != "uniform":
        raise ValueError(f"rewards must be 'uniform' or 'binary', got {rewards!r}")
    return Toy(policy, ref, table, temperature, eos_id=vocab - 1, pad_id=0)


# -- exact side (independent of the project's functions) ---------------------------------------
def enumerate_completions(max_len: int, vocab: int, eos_id: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Every distinct completion, padded.

    Returns:
        tokens ``[C, T]`` long (``pad_id`` after the first EOS) and mask ``[C, T]`` float64
        (1 up to and including the first EOS; all ones for a completion truncated at ``T``).
    """
    words = [v for v in range(vocab) if v != eos_id]
    rows: list[list[int]] = []
    lengths: list[int] = []
    for n in range(max_len):  # n ordinary tokens, then EOS
        for prefix in itertools.product(words, repeat=n):
            rows.append([*prefix, eos_id] + [pad_id] * (max_len - n - 1))
            lengths.append(n + 1)
    for prefix in itertools.product(words, repeat=max_len):  # truncated, no EOS
        rows.append(list(prefix))
        lengths.append(max_len)
    tokens = torch.tensor(rows, dtype=torch.long)
    mask = (torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]).double()
    return tokens, mask


def completion_code(tokens: Tensor, mask: Tensor, vocab: int) -> Tensor:
    """Index of a completion in the reward table: base-``(V+1)`` digits, 0 for masked positions.

    Args:
        tokens: ``[R, T]`` long; mask: ``[R, T]`` 0/1 (the true completion mask).

    Returns:
        ``[R]`` long, distinct for distinct completions.
    """
    digits = torch.where(mask.bool(), tokens + 1, torch.zeros_like(tokens))
    powers = (vocab + 1) ** torch.arange(tokens.shape[1])
    return (digits * powers).sum(1)


def _contexts(tokens: Tensor, eos_id: int) -> Tensor:
    """``[R, T]`` context token of each position: ``eos_id`` (as BOS) then the previous token."""
    bos = torch.full_like(tokens[:, :1], eos_id)
    return torch.cat([bos, tokens[:, :-1]], dim=1)


def row_logits(table: Tensor, prompts: Tensor, tokens: Tensor, eos_id: int) -> Tensor:
    """Gather ``[R, T, V]`` logits for padded completions from a ``[P, T, V, V]`` table."""
    positions = torch.arange(tokens.shape[1])[None, :]
    return table[prompts[:, None], positions, _contexts(tokens, eos_id)]


def _token_logprob(table: Tensor, prompts: Tensor, tokens: Tensor, mask: Tensor, toy: Toy) -> Tensor:
    """Exact per-token ``log pi(y_t | p, y_<t)`` in float64 with a plain ``log_softmax``, 0 where
    masked: ``[R, T]``."""
    lp = torch.log_softmax(row_logits(table, prompts, tokens, toy.eos_id) / toy.temperature, dim=-1)
    lp = lp.gather(-1, tokens[..., None]).squeeze(-1)
    return torch.where(mask.bool(), lp, torch.zeros_like(lp))


def _sequence_logprob(table: Tensor, prompts: Tensor, tokens: Tensor, mask: Tensor, toy: Toy) -> Tensor:
    """Exact ``log pi(y | p)``: ``[R]``."""
    return _token_logprob(table, prompts, tokens, mask, toy).sum(1)


def _enumerated(toy: Toy) -> tuple[Tensor, Tensor, Tensor]:
    """All (prompt, completion) pairs: prompts ``[P*C]``, tokens ``[P*C, T]``, mask ``[P*C, T]``."""
    tokens, mask = enumerate_completions(toy.max_len, toy.vocab, toy.eos_id, toy.pad_id)
    c = tokens.shape[0]
    prompts = torch.arange(toy.num_prompts).repeat_interleave(c)
    return prompts, tokens.repeat(toy.num_prompts, 1), mask.repeat(toy.num_prompts, 1)


def completion_probabilities(toy: Toy) -> Tensor:
    """``[P, C]`` exact probabilities of the completions of ``enumerate_completions`` (rows sum to 1)."""
    prompts, tokens, mask = _enumerated(toy)
    logp = _sequence_logprob(toy.policy_logits, prompts, tokens, mask, toy)
    return logp.exp().view(toy.num_prompts, -1)


def exact_objective(toy: Toy, beta: float, policy_logits: Tensor | None = None) -> Tensor:
    """``J = mean_p sum_y pi(y|p) * (r(p, y) - beta * log(pi(y|p) / pi_ref(y|p)))`` by enumeration.

    The reference log-probs use the sampling temperature too, as the module does (step 3).

    Args:
        policy_logits: ``[P, T, V, V]`` to evaluate at (default ``toy.policy_logits``); pass a
            tensor that requires grad to differentiate.

    Returns:
        scalar float64.
    """
    theta = toy.policy_logits if policy_logits is None else policy_logits
    prompts, tokens, mask = _enumerated(toy)
    logp = _sequence_logprob(theta, prompts, tokens, mask, toy)
    ref = _sequence_logprob(toy.ref_logits, prompts, tokens, mask, toy)
    r = toy.rewards[prompts, completion_code(tokens, mask, toy.vocab)]
    per_prompt = (logp.exp() * (r - beta * (logp - ref))).view(toy.num_prompts, -1).sum(1)
    return per_prompt.mean()


def exact_gradient(toy: Toy, beta: float) -> Tensor:
    """``[D]`` float64: the exact gradient of ``exact_objective`` w.r.t. the policy table."""
    theta = toy.policy_logits.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(exact_objective(toy, beta, theta), theta)
    return grad.reshape(-1)


def kl_placement_target(toy: Toy, beta: float, kl_mode: KLMode) -> Tensor:
    """``[D]``: the gradient that ``kl_mode`` (LOO baseline, sequence sum) is unbiased for, by enumeration.

    With ``sg`` = stop-gradient and ``pi = pi(y|p)``, per prompt (then averaged over prompts):

    - ``reward_k1_detached``: ``grad J`` (the paper's placement).
    - ``loss_k1``: ``grad E[r]``. The k1 loss term's expected gradient is
      ``sum_y pi grad log pi = grad sum_y pi = 0``: differentiating the sampled log-ratio without
      the score term loses the whole KL gradient.
    - ``loss_k3``: ``grad E[r] - beta * grad sum_y sg(pi) sum_t m_t k3_t``; per position this is
      ``grad KL(pi_ref,t || pi_t)`` (the *reverse* KL; ``E_pi[grad k3] = -sum_v ref_v grad log pi_v``),
      with the prefix distribution held fixed.
    - ``reward_k1_not_detached`` (loss without the detach): ``grad J - beta * grad sum_y sg(pi) (log pi)^2 / 2``;
      the extra term is ``E[log pi(y_i) grad A_i]``, where only ``A_i``'s own KL carries a
      non-zero expected gradient (the others' ``grad log pi(y_j)`` are independent of ``y_i``, mean 0).
    """
    theta = toy.policy_logits.detach().clone().requires_grad_(True)
    prompts, tokens, mask = _enumerated(toy)
    lp_tok = _token_logprob(theta, prompts, tokens, mask, toy)
    ref_tok = _token_logprob(toy.ref_logits, prompts, tokens, mask, toy)
    pi = lp_tok.sum(1).exp().detach()
    if kl_mode == "reward_k1_detached":
        target = exact_objective(toy, beta, theta)
    elif kl_mode == "loss_k1":
        target = exact_objective(toy, 0.0, theta)
    elif kl_mode == "loss_k3":
        delta = ref_tok - lp_tok  # 0 where masked, and so is k3 = e^0 - 0 - 1
        k3 = (delta.exp() - delta - 1.0).sum(1)
        target = exact_objective(toy, 0.0, theta) - beta * (pi * k3).sum() / toy.num_prompts
    elif kl_mode == "reward_k1_not_detached":
        extra = (pi * lp_tok.sum(1) ** 2 / 2).sum() / toy.num_prompts
        target = exact_objective(toy, beta, theta) - beta * extra
    else:
        raise ValueError(f"unknown kl_mode {kl_mode!r}")
    (grad,) = torch.autograd.grad(target, theta)
    return grad.reshape(-1)


# -- sampled side (through the project's functions) --------------------------------------------
def sample_completions(toy: Toy, prompts: Tensor, generator: torch.Generator) -> Tensor:
    """Sample one completion per row from ``pi_theta`` autoregressively (inverse-CDF, float64).

    Args:
        prompts: ``[R]`` long prompt ids.

    Returns:
        ``[R, T]`` long tokens, ``pad_id`` after the first EOS.
    """
    probs = torch.softmax(toy.policy_logits / toy.temperature, dim=-1)
    rows = prompts.shape[0]
    out = torch.full((rows, toy.max_len), toy.pad_id, dtype=torch.long)
    context = torch.full((rows,), toy.eos_id, dtype=torch.long)
    alive = torch.ones(rows, dtype=torch.bool)
    for t in range(toy.max_len):
        cdf = probs[prompts, t, context].cumsum(-1)
        u = torch.rand((rows, 1), generator=generator, dtype=torch.float64)
        token = (cdf < u).sum(-1).clamp(max=toy.vocab - 1)
        out[:, t] = torch.where(alive, token, torch.full_like(token, toy.pad_id))
        alive &= token != toy.eos_id
        context = token
    return out


def _leak_one_pad(mask: Tensor) -> Tensor:
    """Deliberate bug: the classic off-by-one that also keeps the first padding token after EOS."""
    shifted = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    return torch.maximum(mask, shifted)


def _moving_average_baseline(rewards: Tensor, batch: int, decay: float) -> Tensor:
    """``[n]`` baseline of each minibatch: ``variants.MovingAverageBaseline`` stepped once per minibatch.

    The baseline of minibatch ``m`` is the bias-corrected EMA of minibatches ``< m``' mean reward
    (0 for the first); those are independent of it, so it adds no bias, and successive draws stay
    uncorrelated (a martingale-difference sequence), so the z-test's variance estimate remains valid.
    """
    ema = MovingAverageBaseline(decay)
    out = []
    for chunk in rewards.detach().view(-1, batch):
        out.append(ema.value)
        ema.update(chunk)
    return torch.tensor(out, dtype=rewards.dtype)


def _advantages(rewards: Tensor, k: int, batch: int, baseline: Baseline, ema_decay: float, eps: float) -> Tensor:
    """``[R]`` advantages from shaped rewards ``[R]`` (groups of ``k`` contiguous rows)."""
    if baseline == "leave_one_out":
        return leave_one_out_advantages(rewards, k)  # the project's function (paper Eq. 4), patchable here
    if baseline == "moving_average":
        return rewards - _moving_average_baseline(rewards, batch, ema_decay).repeat_interleave(batch)
    if baseline == "group_max":  # deliberate bug: a baseline that depends on y_i non-linearly
        groups = rewards.view(-1, k)
        return (groups - groups.max(1, keepdim=True).values).reshape(-1)
    # The project's variants: none, group_mean_std (GRPO: Bessel std), group_mean (self-inclusive
    # mean, no rescale: (k-1)/k times the LOO advantage).
    return baseline_advantages(rewards, k, baseline, eps=eps)


def minibatch_gradients(
    toy: Toy,
    k: int,
    beta: float,
    num_minibatches: int,
    seed: int = 0,
    baseline: Baseline = "leave_one_out",
    kl_mode: KLMode = "reward_k1_detached",
    aggregation: Aggregation = "sequence_sum",
    mask_leak: bool = False,
    zero_variance_filter: ZeroVarianceFilter = "off",
    ema_decay: float = 0.9,
    grpo_eps: float = 1e-4,
) -> Tensor:
    """Independent draws of the estimator of ``grad J``: minus the gradient of each minibatch's loss.

    Each minibatch holds every prompt with ``k`` sampled completions, prompt-major as in the module.
    The default arguments are the module's algorithm (``training_step`` steps 3-6).

    Args:
        baseline: ``leave_one_out`` (default, paper Eq. 4), ``none``, ``moving_average`` (global
            EMA of earlier minibatches' mean shaped reward, decay ``ema_decay``), ``group_mean_std``
            (GRPO, eps ``grpo_eps``), ``group_mean`` (self-inclusive, unscaled), ``group_max`` (bug).
        kl_mode: ``reward_k1_detached`` (default: ``R = r - beta * k1``, detached, paper Sec. 2.3),
            ``loss_k1`` / ``loss_k3`` (``beta * mean_i sum_t m_t k_t`` added to the loss, with
            gradient; no KL in the reward), ``reward_k1_not_detached`` (the KL keeps its gradient
            through the advantage *and* the loss does not detach the advantage: ``policy_loss``
            detaches, so this variant forms the same formula without the detach, which is what a
            hand-written loss that forgets it computes); ``token_reward_k1`` (OpenRLHF, the module's
            ``kl_placement=token_reward``: leave-one-out on r alone, then ``-beta * k1_t`` per token
            and the advantage at the last token, summed to go); ``reward_k2_detached`` /
            ``reward_k3_detached`` (the module's ``kl_estimator=k2/k3``: ``R = r - beta * sum_t k_t``,
            detached, before the baseline).
        aggregation: ``sequence_sum`` (``policy_loss``: ``-1/B sum_i A_i sum_t m_t logp_t``) or
            ``token_mean`` (``-sum_i A_i sum_t m_t logp_t / sum of the minibatch's mask``).
        mask_leak: deliberate bug: the mask also keeps the first padding token after EOS (in the
            KL and the loss; the reward still sees the true completion).
        zero_variance_filter: what the module does with ``callbacks.ZeroVarianceFilter``: groups
            whose task rewards (``score``, the callback's default) or shaped rewards (``shaped``)
            are all equal are dropped: their rewards become NaN before ``leave_one_out_advantages``
            and the loss divides by the number of kept rows (``num_sequences=num_kept``) instead of
            ``B``. ``off`` keeps every row. Leave-one-out baseline only.

    Returns:
        ``[n, D]`` float64.
    """
    if k < 2 and baseline not in ("none", "moving_average"):
        raise ValueError(f"baseline {baseline!r} needs k >= 2, got k={k}")
    if zero_variance_filter not in ("off", "score", "shaped"):
        raise ValueError(f"unknown zero_variance_filter {zero_variance_filter!r}")
    if zero_variance_filter != "off" and baseline != "leave_one_out":
        raise ValueError("zero_variance_filter is the module's NaN path: baseline must be leave_one_out")
    num_p, max_len, vocab, n = toy.num_prompts, toy.max_len, toy.vocab, num_minibatches
    batch = num_p * k
    prompts = torch.arange(num_p).repeat_interleave(k).repeat(n)
    tokens = sample_completions(toy, prompts, torch.Generator().manual_seed(seed))
    # One leaf per row: its gradient is exactly that row's minibatch's loss gradient.
    logits = row_logits(toy.policy_logits, prompts, tokens, toy.eos_id).detach().requires_grad_(True)
    ref_logits = row_logits(toy.ref_logits, prompts, tokens, toy.eos_id)

    # 3. per-token log-probs, policy with grad, reference without, same temperature.
    logp = token_logprobs(logits, tokens, toy.temperature)
    with torch.no_grad():
        ref_logp = token_logprobs(ref_logits, tokens, toy.temperature)
    true_mask = completion_mask(tokens, [toy.eos_id])
    mask = _leak_one_pad(true_mask) if mask_leak else true_mask
    r = toy.rewards[prompts, completion_code(tokens, true_mask, vocab)].float()

    # 4. KL placement.
    if kl_mode == "reward_k1_detached":
        shaped = r - beta * sequence_kl(logp.detach(), ref_logp, mask)
    elif kl_mode == "reward_k1_not_detached":
        shaped = r - beta * sequence_kl(logp, ref_logp, mask)
    elif kl_mode in ("reward_k2_detached", "reward_k3_detached"):
        estimator = kl_mode.split("_")[1]
        shaped = r - beta * masked_sum(kl_per_token(logp.detach(), ref_logp, estimator), mask)
    elif kl_mode in ("loss_k1", "loss_k3", "token_reward_k1"):
        shaped = r
    else:
        raise ValueError(f"unknown kl_mode {kl_mode!r}")

    # 5. advantages (dropped groups: NaN rewards, as the module's step 5 does).
    keep = torch.ones_like(shaped, dtype=torch.bool)
    if zero_variance_filter != "off":
        groups = (r if zero_variance_filter == "score" else shaped.detach()).view(-1, k)
        keep = (groups.max(1).values > groups.min(1).values).repeat_interleave(k)
        shaped = torch.where(keep, shaped, torch.full_like(shaped, torch.nan))
    adv = _advantages(shaped, k, batch, baseline, ema_decay, grpo_eps)

    # 6. loss: the sum over minibatches of each minibatch's loss.
    if aggregation == "sequence_sum":
        per_row = keep.float()
    elif aggregation == "token_mean":
        per_row = keep.float() * mask.sum(1)
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    divisor = per_row.view(n, batch).sum(1).clamp(min=1).repeat_interleave(batch)
    if kl_mode == "token_reward_k1":
        token_kl = kl_per_token(logp.detach(), ref_logp, "k1") * mask
        token_adv = reward_to_go(token_rewards_after_baseline(adv, token_kl, mask, beta), mask)
        loss = -(masked_sum(token_adv * logp, mask) / divisor).sum()
    elif kl_mode == "reward_k1_not_detached":
        loss = -(adv / divisor * masked_sum(logp, mask)).sum()
    elif aggregation == "sequence_sum" and zero_variance_filter == "off":
        loss = policy_loss(adv, logp, mask, num_sequences=batch)  # exactly the module's call
    else:
        # A per-minibatch divisor, folded into the advantages; policy_loss sums rows.
        loss = policy_loss(adv / divisor, logp, mask, num_sequences=1)
    if kl_mode == "loss_k1":
        loss = loss + beta * sequence_kl(logp, ref_logp, mask).sum() / batch
    elif kl_mode == "loss_k3":
        delta = ref_logp - logp
        loss = loss + beta * masked_sum(delta.exp() - delta - 1.0, mask).sum() / batch
    loss.backward()

    # Chain rule of the gather, per minibatch: row logits -> table entry (p, t, context).
    minibatch = torch.arange(prompts.shape[0]) // batch
    cell = ((minibatch * num_p + prompts)[:, None] * max_len + torch.arange(max_len)) * vocab
    cell = cell + _contexts(tokens, toy.eos_id)
    grads = torch.zeros(n * num_p * max_len * vocab, vocab, dtype=torch.float64)
    grads.index_add_(0, cell.reshape(-1), -logits.grad.reshape(-1, vocab).double())
    return grads.view(n, -1)


# -- the verdict ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZTest:
    """Per-coordinate z-test of ``mean(draws) == exact`` with a Bonferroni family-wise level.

    Attributes:
        n: number of independent draws.
        num_coords: coordinates tested (those not identically zero in both the draws and exact).
        alpha: family-wise false-alarm rate; each coordinate is tested at ``alpha / num_coords``.
        z_crit: two-sided threshold ``Phi^-1(1 - alpha / (2 num_coords))``.
        max_abs_z, num_rejected: the largest ``|z|`` and how many coordinates exceed ``z_crit``.
        unbiased: ``num_rejected == 0``.
        variance_trace: trace of the draws' covariance (sum of per-coordinate variances).
        relative_bias: ``|mean - exact| / |exact|`` (Euclidean norms).
        scale: least-squares ``c`` in ``mean ~ c * exact``; 1 for an unbiased estimator.
        max_abs_z_scaled: max ``|z|`` of ``mean - c * exact``: small when the bias is a pure scale.
    """

    n: int
    num_coords: int
    alpha: float
    z_crit: float
    max_abs_z: float
    num_rejected: int
    unbiased: bool
    variance_trace: float
    relative_bias: float
    scale: float
    max_abs_z_scaled: float


def _z(diff: Tensor, se: Tensor) -> Tensor:
    """``diff / se``; where ``se == 0`` the draws are constant: 0 if they match, else inf."""
    exact_match = diff.abs() <= 1e-12
    safe = torch.where(se > 0, se, torch.ones_like(se))
    degenerate = torch.where(exact_match, torch.zeros_like(diff), torch.full_like(diff, math.inf))
    return torch.where(se > 0, diff / safe, degenerate)


def z_test(draws: Tensor, exact: Tensor, alpha: float = 1e-3) -> ZTest:
    """Compare the mean of ``draws`` ``[n, D]`` with ``exact`` ``[D]``.

    Under unbiasedness each ``z`` is asymptotically N(0, 1) (the draws are i.i.d. and bounded);
    Bonferroni keeps ``P(any false rejection) <= alpha`` whatever the dependence between
    coordinates (they are dependent: each softmax row's gradient sums to zero).
    """
    n = draws.shape[0]
    mean, var = draws.mean(0), draws.var(0)
    tested = (var > 0) | (exact != 0) | (mean != 0)
    num_coords = int(tested.sum())
    se = (var / n).sqrt()
    z = _z(mean - exact, se)[tested]
    z_crit = float(torch.special.ndtri(torch.tensor(1.0 - alpha / (2 * max(num_coords, 1)), dtype=torch.float64)))
    scale = float(mean @ exact / (exact @ exact)) if float(exact @ exact) > 0 else math.nan
    z_scaled = _z(mean - scale * exact, se)[tested] if not math.isnan(scale) else z
    max_abs_z = float(z.abs().max()) if num_coords else 0.0
    num_rejected = int((z.abs() > z_crit).sum())
    return ZTest(
        n=n,
        num_coords=num_coords,
        alpha=alpha,
        z_crit=z_crit,
        max_abs_z=max_abs_z,
        num_rejected=num_rejected,
        unbiased=num_rejected == 0,
        variance_trace=float(var.sum()),
        relative_bias=float((mean - exact).norm() / exact.norm().clamp(min=1e-300)),
        scale=scale,
        max_abs_z_scaled=float(z_scaled.abs().max()) if num_coords else 0.0,
    )


def check_estimator(
    toy: Toy,
    k: int,
    beta: float,
    num_minibatches: int,
    seed: int = 0,
    alpha: float = 1e-3,
    **variant: object,
) -> ZTest:
    """Draw ``num_minibatches`` estimates (``variant``: keyword arguments of ``minibatch_gradients``)
    and z-test their mean against the exact ``grad J`` at ``beta``."""
    draws = minibatch_gradients(toy, k, beta, num_minibatches, seed, **variant)  # type: ignore[arg-type]
    return z_test(draws, exact_gradient(toy, beta), alpha)
