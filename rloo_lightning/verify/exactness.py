"""An exact test that RLOOModule's training step is an unbiased estimator of the RLOO gradient.

The toy is a causal LM small enough that every completion can be enumerated: a table of logits
indexed by (position id, previous token), over a completion alphabet ``{a, b, EOS}``, behind the
Hugging Face ``forward(input_ids, attention_mask, position_ids, use_cache, logits_to_keep)``
signature. Prompts are strings of different lengths, left-padded in a batch, so that a step that
drops the position ids or shifts the logits by one computes other numbers. By summation over all
completions we get the KL-regularised objective of the paper (Ahmadian et al. 2024, Sec. 2.3)

    J(theta) = mean_p ( E_{y ~ pi(.|p)} r(p, y) - beta * KL(pi(.|p) || pi_ref(.|p)) )

and its exact gradient by autograd. The *sampled* side is ``RLOOModule.training_step`` itself:
the module is built with the options under test, the toy policy and reference are attached with
``RLOOModule.attach``, a :class:`TableSampler` engine samples the completions (positions and
temperature computed here, independently of the module), a reward function looks the reward up
in a table, and ``-grad`` of the returned loss is one draw of the estimator. Every function the
step calls (masks, reward scoring and shaping, log-probs, KL, baseline, loss) is the one training
runs. A per-coordinate z-test of the draws' mean against the exact gradient, Bonferroni-corrected
across coordinates, says whether the estimator is unbiased.

Shapes: ``P`` prompts, ``L`` max completion length, ``S`` positions, ``V`` vocabulary of the
tokenizer, ``W = 3`` completion tokens, ``k`` completions per prompt, ``n`` draws,
``D = S * V * W`` coordinates of the table.

Stale rollouts (``rollout.lag`` K >= 1) are checked through the module's own pipeline in
:mod:`rloo_lightning.verify.exactness_stale`, on this module's toy, module and verdict.

Multi-turn episodes (two policy turns around a stochastic reply) are checked the same way in
:mod:`rloo_lightning.verify.exactness_multiturn`, on this module's toy, module and draws.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor
from transformers import GenerationConfig

from rloo_lightning.data import collate_prompts
from rloo_lightning.models import build_char_tokenizer
from rloo_lightning.engines import GenerationEngine

__all__ = [
    "Toy",
    "ZTest",
    "TabularCausalLM",
    "TableSampler",
    "LiveTableSampler",
    "TableReward",
    "make_toy",
    "enumerate_completions",
    "completion_probabilities",
    "exact_objective",
    "exact_gradient",
    "training_step_draws",
    "step_draws",
    "perturbed_table",
    "z_test",
    "check_training_step",
]

ALPHABET = "xyzab"  # prompts over x, y, z; completions over a, b and EOS
MASKED_LOGIT = -1e4  # tokens the toy never emits: probability exactly 0 in fp32


class TabularCausalLM(torch.nn.Module):
    """A causal LM whose next-token logits are ``table[position id, current token]``.

    Only the completion tokens (``emit``) get logits from the table; every other token gets
    ``MASKED_LOGIT``. Without ``position_ids`` the positions are ``0 .. S-1`` whatever the padding,
    as in Hugging Face models: a caller that drops them gets other logits for left-padded rows.
    """

    def __init__(self, table: Tensor, vocab_size: int, emit: list[int], eos_id: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.clone().float())  # [S, V, W]
        self.vocab_size, self.emit = vocab_size, list(emit)
        self.generation_config = GenerationConfig(eos_token_id=eos_id)
        self.config = SimpleNamespace(vocab_size=vocab_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                use_cache: bool = False, logits_to_keep: int = 0, **kwargs) -> SimpleNamespace:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        positions = position_ids.clamp(max=self.table.shape[0] - 1)
        emitted = self.table[positions, input_ids]  # [b, S, W]
        logits = torch.full((*input_ids.shape, self.vocab_size), MASKED_LOGIT, dtype=emitted.dtype,
                            device=input_ids.device)
        logits = logits.index_copy(2, torch.tensor(self.emit, device=input_ids.device), emitted)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


@dataclass(frozen=True)
class Toy:
    """Prompts, the policy and reference tables, and a reward table.

    Attributes:
        tokenizer: a character tokenizer (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the alphabet).
        prompts: ``P`` prompt strings of different lengths.
        policy_table, ref_table: ``[S, V, W]`` float64 logits of the ``W`` completion tokens.
        rewards: ``[P, (W + 1) ** L]`` float64, the reward of each completion by :func:`completion_code`.
        emit: the ``W`` completion token ids (``a``, ``b``, EOS).
        max_len: ``L``, the completion budget.
        temperature: sampling temperature (the module must use it in its log-probs too).
    """

    tokenizer: object
    prompts: tuple[str, ...]
    policy_table: Tensor
    ref_table: Tensor
    rewards: Tensor
    emit: tuple[int, ...]
    max_len: int
    temperature: float

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in self.prompts]


def make_toy(prompts: tuple[str, ...] = ("x", "yz", "zxy"), max_len: int = 3, temperature: float = 0.7,
             logit_scale: float = 0.5, ref_noise: float = 0.35, seed: int = 0) -> Toy:
    """A random toy. Temperature != 1 on purpose: it exercises the log-probs' temperature.

    Policy logits are ``logit_scale * N(0, 1)`` (every completion token keeps a probability above a
    few percent, so that the z-test's sample variances are reliable); the reference is the policy
    plus ``ref_noise * N(0, 1)``; rewards are i.i.d. U(0, 1) per (prompt, completion).
    """
    tokenizer = build_char_tokenizer(ALPHABET)
    emit = (tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b"), tokenizer.eos_token_id)
    g = torch.Generator().manual_seed(seed)
    positions = max(len(p) for p in prompts) + max_len
    shape = (positions, len(tokenizer), len(emit))
    policy = logit_scale * torch.randn(shape, generator=g, dtype=torch.float64)
    ref = policy + ref_noise * torch.randn(shape, generator=g, dtype=torch.float64)
    rewards = torch.rand((len(prompts), (len(emit) + 1) ** max_len), generator=g, dtype=torch.float64)
    return Toy(tokenizer, tuple(prompts), policy, ref, rewards, emit, max_len, temperature)


def completion_code(tokens: list[int], emit: tuple[int, ...]) -> int:
    """Index of a completion (token ids up to and including EOS) in the reward table: base-``(W+1)`` digits."""
    return sum((emit.index(t) + 1) * (len(emit) + 1) ** j for j, t in enumerate(tokens))


# -- exact side (independent of the module) ---------------------------------------------------------
def enumerate_completions(toy: Toy) -> list[list[int]]:
    """Every distinct completion: ``n`` ordinary tokens then EOS (``n < L``), or ``L`` ordinary tokens."""
    words, eos = toy.emit[:-1], toy.eos_id
    out = [[*prefix, eos] for n in range(toy.max_len) for prefix in itertools.product(words, repeat=n)]
    return out + [list(prefix) for prefix in itertools.product(words, repeat=toy.max_len)]


def _sequence_logprob(table: Tensor, toy: Toy, p: int, completion: list[int]) -> Tensor:
    """``log pi(y | prompt p)`` at the toy's temperature, by the toy's own indexing (float64)."""
    ids = toy.tokenizer(toy.prompts[p], add_special_tokens=False)["input_ids"]
    prev, total = ids[-1], torch.zeros((), dtype=table.dtype)
    for j, token in enumerate(completion):
        logits = table[len(ids) - 1 + j, prev] / toy.temperature  # the output at the previous token
        total = total + torch.log_softmax(logits, -1)[toy.emit.index(token)]
        prev = token
    return total


def completion_probabilities(toy: Toy) -> Tensor:
    """``[P, C]`` exact probabilities of the completions of :func:`enumerate_completions` (rows sum to 1)."""
    completions = enumerate_completions(toy)
    return torch.stack([torch.stack([_sequence_logprob(toy.policy_table, toy, p, y).exp() for y in completions])
                        for p in range(len(toy.prompts))])


def exact_objective(toy: Toy, beta: float, policy_table: Tensor | None = None) -> Tensor:
    """``J = mean_p sum_y pi(y|p) * (r(p, y) - beta * log(pi(y|p) / pi_ref(y|p)))`` by enumeration (float64)."""
    theta = toy.policy_table if policy_table is None else policy_table
    per_prompt = []
    for p in range(len(toy.prompts)):
        terms = []
        for y in enumerate_completions(toy):
            logp = _sequence_logprob(theta, toy, p, y)
            ref = _sequence_logprob(toy.ref_table, toy, p, y)
            terms.append(logp.exp() * (toy.rewards[p, completion_code(y, toy.emit)] - beta * (logp - ref)))
        per_prompt.append(torch.stack(terms).sum())
    return torch.stack(per_prompt).mean()


def exact_gradient(toy: Toy, beta: float) -> Tensor:
    """``[D]`` float64: the exact gradient of :func:`exact_objective` w.r.t. the policy table."""
    theta = toy.policy_table.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(exact_objective(toy, beta, theta), theta)
    return grad.reshape(-1)


# -- sampled side: the module's own training step -------------------------------------------------
class TableSampler(GenerationEngine):
    """Samples completions from the toy policy's table, with positions and temperature computed here.

    Independent of the module's log-prob path: a step that computes its log-probs at other positions
    or another temperature than the ones sampled is then measurably biased. Each call draws a fresh
    stream (``seed`` and a call counter): without a trainer the module's step seed does not advance.

    With ``sampler_table`` it samples from that table instead (a sampler pi_s that differs from pi_theta
    by a known perturbation, as a reduced-precision engine would) and returns ``(ids, log pi_s)``.
    """

    def __init__(self, toy: Toy, seed: int = 0, sampler_table: Tensor | None = None) -> None:
        self.toy, self.seed, self.calls, self.sampler_table = toy, seed, 0, sampler_table

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        table = self.toy.policy_table if self.sampler_table is None else self.sampler_table
        out, logp = self._draw(table, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        return out if self.sampler_table is None else (out, logp)

    def _draw(self, table: Tensor, tokenizer, prompt_ids, prompt_mask, generation_config,
              seed) -> tuple[Tensor, Tensor]:
        """``(ids [B, L], log pi_s [B, L])`` sampled from ``table`` ``[S, V, W]`` (a fresh stream per call)."""
        toy, self.calls = self.toy, self.calls + 1
        g = torch.Generator().manual_seed(hash((self.seed, seed, self.calls)) & (2**62 - 1))
        temperature = generation_config.temperature
        lengths, prev = prompt_mask.sum(1), prompt_ids[:, -1]
        emit = torch.tensor(toy.emit)
        out = torch.full((prompt_ids.shape[0], toy.max_len), tokenizer.pad_token_id, dtype=torch.long)
        logp = torch.zeros(out.shape, dtype=torch.float32)
        alive = torch.ones(prompt_ids.shape[0], dtype=torch.bool)
        for j in range(min(toy.max_len, generation_config.max_new_tokens)):
            logits = table[lengths - 1 + j, prev] / temperature  # [B, W]
            choice = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            token = emit[choice.squeeze(1)]
            out[:, j] = torch.where(alive, token, out[:, j])
            logp[:, j] = torch.where(alive, torch.log_softmax(logits, -1).gather(1, choice).squeeze(1).float(), 0.0)
            alive &= token != toy.eos_id
            prev = token
        return out, logp


class LiveTableSampler(TableSampler):
    """A :class:`TableSampler` that samples from the table of the ``model`` it is given, as that table is at the
    call, and reports its log-probs: an engine with the policy's weights of the moment, as the default engine is.

    Under ``rollout.lag`` K the module submits a rollout K steps ahead (``GenerationEngine.submit``, whose
    default samples at once): the samples then come from the weights at submission, whatever the policy holds when
    the step that trains on them computes its loss. Positions and temperature are still computed here.
    """

    reports_logprobs = True

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        table = model.table.detach().double()  # float32 in the policy: these are the weights it holds now
        return self._draw(table, tokenizer, prompt_ids, prompt_mask, generation_config, seed)


class TableReward:
    """The reward function: the toy's reward table looked up by (prompt, completion ids)."""

    __name__ = "table_reward"

    def __init__(self, toy: Toy) -> None:
        self.toy, self.index = toy, {p: i for i, p in enumerate(toy.prompts)}

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float]:
        # Only the completion alphabet counts, as a decoded text would: a mask that runs past EOS
        # must show up in the log-probs, not as a reward the table does not have.
        emit = self.toy.emit
        return [float(self.toy.rewards[self.index[p], completion_code([t for t in ids if t in emit], emit)])
                for p, ids in zip(prompts, completion_ids)]


def toy_module(toy: Toy, options: dict | None = None, seed: int = 0, callbacks: list | None = None,
               sampler_table: Tensor | None = None, engine: GenerationEngine | None = None):
    """An :class:`~rloo_lightning.RLOOModule` on the toy: ``options`` are its option groups as dicts.

    The sampling temperature and budget are the toy's; ``options["kl"]["beta"]`` defaults to 0.1, and the
    rewards to the toy's table (:class:`TableReward`; ``options["rewards"]`` replaces them).
    ``sampler_table``: the engine samples from it and reports its log-probs (see :class:`TableSampler`).
    ``engine``: this engine instead of a :class:`TableSampler` (e.g. :class:`LiveTableSampler`).
    """
    from rloo_lightning.module import RLOOModule

    options = {group: dict(values) for group, values in (options or {}).items()}
    options.setdefault("sampling", {}).update(temperature=toy.temperature, max_new_tokens=toy.max_len)
    options.setdefault("kl", {}).setdefault("beta", 0.1)
    options.setdefault("validation", {}).setdefault("at_start", False)
    options.setdefault("rewards", {"funcs": [TableReward(toy)]})
    module = RLOOModule("toy", generation_engine=engine or TableSampler(toy, seed, sampler_table), **options)
    vocab = len(toy.tokenizer)
    policy = TabularCausalLM(toy.policy_table, vocab, list(toy.emit), toy.eos_id)
    reference = TabularCausalLM(toy.ref_table, vocab, list(toy.emit), toy.eos_id)
    module.attach(policy, toy.tokenizer, reference)
    return module


def toy_batch(toy: Toy, repeats: int) -> dict:
    """Every prompt ``repeats`` times, tokenized and left-padded as the data module does."""
    rows = [{"input_ids": toy.tokenizer(p, add_special_tokens=False)["input_ids"], "prompt": p, "columns": {}}
            for p in toy.prompts for _ in range(repeats)]
    return collate_prompts(rows, toy.tokenizer.pad_token_id)


def training_step_draws(toy: Toy, num_draws: int, repeats: int = 16, options: dict | None = None,
                        seed: int = 0, sampler_table: Tensor | None = None) -> Tensor:
    """``[n, D]`` float64: ``-grad`` of ``RLOOModule.training_step``'s loss on ``n`` independent batches.

    Each batch holds every prompt ``repeats`` times (``k`` samples each), so each draw estimates
    ``grad J`` averaged over the prompts, as :func:`exact_objective` is.
    """
    return step_draws(toy_module(toy, options, seed, sampler_table=sampler_table), toy_batch(toy, repeats),
                       num_draws)


def step_draws(module, batch: dict, num_draws: int, fresh_rows: bool = False) -> Tensor:
    """``[n, D]``: ``-grad`` of ``module.training_step``'s loss on ``batch``, ``n`` times. ``fresh_rows``: each
    draw gives the batch rows of its own (``row_index``), so that its episodes are seeded afresh."""
    draws = []
    for i in range(num_draws):
        if fresh_rows:
            batch["row_index"] = torch.arange(i * len(batch["prompt"]), (i + 1) * len(batch["prompt"]))
        loss = module.training_step(batch, i)
        module.policy.table.grad = None
        module.on_before_backward(loss)  # as Lightning's backward does: earlier micro-batches' gradients join
        loss.backward()
        draws.append(-module.policy.table.grad.reshape(-1).double())
    return torch.stack(draws)


def perturbed_table(toy: Toy, scale: float = 0.5, seed: int = 1) -> Tensor:
    """A sampler's table: the policy's logits plus ``scale * N(0, 1)`` (a known, material mismatch)."""
    g = torch.Generator().manual_seed(seed)
    return toy.policy_table + scale * torch.randn(toy.policy_table.shape, generator=g, dtype=torch.float64)


def check_training_step(toy: Toy, num_draws: int = 200, repeats: int = 16, options: dict | None = None,
                        seed: int = 0, alpha: float = 1e-3, sampler_table: Tensor | None = None) -> ZTest:
    """Draw ``num_draws`` estimates from the module's training step and z-test their mean against ``grad J``.

    ``sampler_table``: completions come from this table's pi_s (reported to the module), not from pi_theta,
    while ``grad J`` stays the gradient under pi_theta: only a correct importance correction is unbiased.
    """
    beta = float(((options or {}).get("kl") or {}).get("beta", 0.1))
    draws = training_step_draws(toy, num_draws, repeats, options, seed, sampler_table)
    return z_test(draws, exact_gradient(toy, beta), alpha)


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
