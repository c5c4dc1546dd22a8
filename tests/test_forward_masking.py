"""Masking, offsets, temperature and the gradient of the loss, on a tiny random Llama.

Every check builds the loss exactly as ``RLOOModule.training_step`` does (``completion_logits`` ->
``token_logprobs`` -> ``aggregate_token_loss(-A * logp, mask, "seq_sum")``, the default loss), or calls
``training_step`` itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rloo_lightning.data import collate_prompts
from rloo_lightning.module import RLOOModule
from rloo_lightning import forward
from rloo_lightning.algo.logprobs import completion_mask, mask_positions, token_logprobs
from rloo_lightning.algo.losses import aggregate_token_loss
from rloo_lightning.engines import HFGenerateEngine
from rloo_lightning.rollout import Rollout

REWARD = "rloo_lightning.tasks.reverse.reward"


def _module(path, **groups) -> RLOOModule:
    module = RLOOModule(model_name_or_path=path, rewards={"funcs": [REWARD], **groups.pop("rewards", {})},
                        kl={"beta": 0.0, **groups.pop("kl", {})},
                        sampling={"max_new_tokens": 6, **groups.pop("sampling", {})}, **groups)
    module.configure_model()
    return module


def completion_logits(model, rollout: Rollout) -> torch.Tensor:
    """The training path's logits ``[B, T', V]`` predicting the completion tokens of ``rollout``."""
    return forward.completion_logits(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.completion_mask)


def policy_loss(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The default loss of the update: ``-1/B sum_i A_i sum_t m_t logp_t``."""
    return aggregate_token_loss(-advantages.detach()[:, None] * logp, mask, "seq_sum")


@pytest.fixture(scope="module")
def module(tiny_model_dir):
    return _module(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    """A tiny GPT-2: absolute position embeddings, so wrong position ids under left padding show.

    (Llama's RoPE is invariant to a constant position shift, so it cannot catch that mistake.)
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from rloo_lightning.models import build_char_tokenizer

    directory = tmp_path_factory.mktemp("tiny_gpt2")
    tok = build_char_tokenizer("abcdefgh=", model_max_length=32)
    config = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
    # larger position embeddings than the default init, so that a shift is clearly visible
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0, 0.5)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture(params=["llama", "gpt2"])
def model_dir(request, tiny_model_dir, tiny_gpt2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_gpt2_dir


def _ids(tok, text):
    return tok(text, add_special_tokens=True)["input_ids"]


def make_rollout(tok, prompts, completions, k, extra_pad=0, eos_ids=None) -> Rollout:
    """A hand-built rollout: ``prompts`` (N strings), ``completions`` (N*k lists of token ids)."""
    eos_ids = eos_ids or [tok.eos_token_id]
    enc = [_ids(tok, p) for p in prompts]
    width = max(map(len, enc)) + extra_pad
    pad = tok.pad_token_id
    p_ids = torch.full((len(enc), width), pad, dtype=torch.long)
    p_mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        p_ids[i, width - len(e):] = torch.tensor(e)
        p_mask[i, width - len(e):] = 1
    T = max(map(len, completions))
    c_ids = torch.full((len(completions), T), pad, dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
    mask = completion_mask(c_ids, eos_ids)
    return Rollout(
        k=k,
        prompt_ids=p_ids.repeat_interleave(k, 0),
        prompt_mask=p_mask.repeat_interleave(k, 0),
        completion_ids=c_ids,
        completion_mask=mask,
        truncated=~torch.isin(c_ids, torch.tensor(eos_ids)).any(1),
        prompts=[p for p in prompts for _ in range(k)],
        completions=[""] * len(completions),
    )


def _params(module):
    return [p for p in module.policy.parameters() if p.requires_grad]


def loss_and_grads(module, rollout, adv, model=None, edit_logits=None, temperature=1.0):
    logits = completion_logits(model if model is not None else module.policy, rollout)
    if edit_logits is not None:
        logits = edit_logits(logits)
    logp = token_logprobs(logits, rollout.completion_ids, temperature)
    loss = policy_loss(adv, logp, rollout.completion_mask)
    grads = torch.autograd.grad(loss, _params(module))
    return loss.detach(), grads


def assert_same(a, b, atol=1e-6):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=atol)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.isfinite(ga).all()
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=atol)


@pytest.fixture()
def rollout(module):
    tok = module.tokenizer
    a, b, c, d, e, f, g, h = (tok.convert_tokens_to_ids(ch) for ch in "abcdefgh")
    eos = tok.eos_token_id
    # 2 prompts of different lengths (so the short one is left-padded), k = 2.
    completions = [
        [a, b, c, eos],  # pad after EOS
        [d, eos],
        [e, f, g, h, a, b],  # truncated, no EOS
        [eos],
    ]
    return make_rollout(tok, ["abc=", "hgfedcb="], completions, k=2)


ADV = torch.tensor([1.0, -0.5, 2.0, -1.5])


def test_rollout_fixture_has_padding_everywhere(rollout):
    # sanity of the setup the following tests rely on
    assert (rollout.prompt_mask == 0).any()
    assert rollout.completion_mask.tolist() == [
        [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]
    ]


def test_prompt_padding_tokens_do_not_change_loss_or_gradient(module, rollout):
    ref = loss_and_grads(module, rollout, ADV)
    g = torch.Generator().manual_seed(0)
    ids = rollout.prompt_ids.clone()
    noise = torch.randint(3, len(module.tokenizer), ids.shape, generator=g)
    pad = rollout.prompt_mask == 0
    ids[pad] = noise[pad]
    changed = Rollout(**{**rollout.__dict__, "prompt_ids": ids})
    assert not torch.equal(changed.prompt_ids, rollout.prompt_ids)
    assert_same(ref, loss_and_grads(module, changed, ADV))


def test_tokens_after_first_eos_do_not_change_loss_or_gradient(module, rollout):
    ref = loss_and_grads(module, rollout, ADV)
    g = torch.Generator().manual_seed(1)
    ids = rollout.completion_ids.clone()
    noise = torch.randint(3, len(module.tokenizer), ids.shape, generator=g)
    after = rollout.completion_mask == 0
    ids[after] = noise[after]
    changed = Rollout(**{**rollout.__dict__, "completion_ids": ids})
    assert not torch.equal(changed.completion_ids, rollout.completion_ids)
    # the mask is the rollout's (built at sampling time), so it is unchanged
    assert_same(ref, loss_and_grads(module, changed, ADV))


def test_logits_at_masked_completion_positions_do_not_change_loss_or_gradient(module, rollout):
    ref = loss_and_grads(module, rollout, ADV)
    g = torch.Generator().manual_seed(2)
    off = (rollout.completion_mask == 0)[..., None]

    def perturb(logits):
        noise = torch.randn(logits.shape, generator=g) * 50
        return logits + noise * off

    assert_same(ref, loss_and_grads(module, rollout, ADV, edit_logits=perturb))


class _NoisyNonCompletionLogits(torch.nn.Module):
    """Wraps the policy; adds large noise to every logit that does not predict a completion token."""

    def __init__(self, model, completion_len):
        super().__init__()
        self.model = model
        self.T = completion_len
        self.g = torch.Generator().manual_seed(3)

    def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep=0):
        full = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits
        L = full.shape[1]
        P = L - self.T
        predicts_completion = torch.zeros(L, dtype=torch.bool)
        predicts_completion[P - 1 : L - 1] = True
        noise = torch.randn(full.shape, generator=self.g) * 50
        full = torch.where(predicts_completion[None, :, None], full, full + noise)
        return SimpleNamespace(logits=full[:, -logits_to_keep:] if logits_to_keep else full)


def test_logits_at_prompt_positions_do_not_change_loss_or_gradient(module, rollout):
    ref = loss_and_grads(module, rollout, ADV)
    wrapper = _NoisyNonCompletionLogits(module.policy, rollout.completion_ids.shape[1])
    assert_same(ref, loss_and_grads(module, rollout, ADV, model=wrapper), atol=1e-5)


def test_completion_logits_offset_matches_unpadded_naive_forward(module, rollout):
    logp = token_logprobs(completion_logits(module.policy, rollout), rollout.completion_ids)
    with torch.no_grad():
        for i in range(rollout.completion_ids.shape[0]):
            p = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
            c = rollout.completion_ids[i]
            full = module.policy(input_ids=torch.cat([p, c])[None]).logits[0]
            # logits at position P-1+t predict completion token t
            expected = torch.log_softmax(full[len(p) - 1 : len(p) - 1 + len(c)], -1).gather(1, c[:, None])[:, 0]
            m = rollout.completion_mask[i].bool()
            torch.testing.assert_close(logp[i][m], expected[m], rtol=1e-5, atol=1e-5)


def test_tokens_after_first_eos_carry_no_gradient(module, rollout):
    logits = completion_logits(module.policy, rollout).detach().requires_grad_(True)
    logp = token_logprobs(logits, rollout.completion_ids)
    logp.retain_grad()
    policy_loss(ADV, logp, rollout.completion_mask).backward()
    off = rollout.completion_mask == 0
    assert torch.all(logits.grad[off] == 0)
    assert torch.all(logp.grad[off] == 0)
    assert torch.all(logits.grad[~off].abs().sum(-1) > 0)


def test_left_padding_amount_does_not_change_completion_logprobs(model_dir):
    module = _module(model_dir)
    tok = module.tokenizer
    a, b, eos = (tok.convert_tokens_to_ids(x) for x in ("a", "b", tok.eos_token))
    completions = [[b, a, eos], [a, a, b]]
    results = []
    for extra in (0, 3, 9):
        # A second, longer prompt pads the first by ``extra`` (padding common to every row would be cut).
        r = make_rollout(tok, ["cab=", "h" * extra + "cab="], completions * 2, k=2)
        assert int((r.prompt_mask == 0).sum(1)[0]) == extra
        with torch.no_grad():
            results.append(token_logprobs(completion_logits(module.policy, r), r.completion_ids, 0.7)[:2])
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-5)


def test_logprobs_under_temperature_equal_the_sampled_distribution(model_dir):
    T = 0.7
    module = _module(model_dir, sampling={"temperature": T, "max_new_tokens": 6})
    module.engine = HFGenerateEngine()  # generate's own samples (the default engine's: tests/test_engines_decode.py)
    tok = module.tokenizer
    rows = [{"input_ids": _ids(tok, p), "prompt": p, "columns": {}} for p in ("abc=", "hgfedcb=")]
    batch = collate_prompts(rows, tok.pad_token_id)
    k, seed = 3, 1234
    rollout = module.sample(batch, k, seed)

    prompt_ids = batch["input_ids"].repeat_interleave(k, 0)
    prompt_mask = batch["attention_mask"].repeat_interleave(k, 0)
    module.policy.eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = module.policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                     generation_config=module.generation_config,
                                     output_scores=True, return_dict_in_generate=True)
    module.policy.train()
    # same config and seed -> the very same samples as the module's rollout
    assert torch.equal(out.sequences[:, prompt_ids.shape[1]:], rollout.completion_ids)

    scores = torch.stack(out.scores, 1).float()  # [B, T, V], after the temperature warper
    mask = rollout.completion_mask.bool()
    ids = rollout.completion_ids
    assert torch.isfinite(scores[mask]).all()  # nothing truncated (no top-k / top-p / min-p)
    sampled = torch.log_softmax(scores, -1).gather(-1, ids[..., None])[..., 0]
    with torch.no_grad():
        logits = completion_logits(module.policy, rollout)
        logp = token_logprobs(logits, ids, T)
        logp_wrong_t = token_logprobs(logits, ids, 1.0)
    torch.testing.assert_close(logp[mask], sampled[mask], rtol=1e-4, atol=1e-4)
    # the comparison is sharp enough to tell temperatures apart
    assert (logp_wrong_t[mask] - sampled[mask]).abs().max() > 1e-2
    # the whole sampling distribution matches, not only the sampled token
    torch.testing.assert_close(torch.log_softmax(logits / T, -1)[mask], torch.log_softmax(scores, -1)[mask],
                               rtol=1e-4, atol=1e-4)


def _position_reward(prompts, completions, completion_ids, **columns):
    """Distinct rewards inside every group: 0.25 * length + 0.1 * (index mod 3)."""
    return [0.25 * len(c) + 0.1 * (i % 3) for i, c in enumerate(completions)]


def test_training_step_gradient_equals_hand_computed_reinforce(tiny_model_dir, monkeypatch):
    from lightning.pytorch import Trainer

    N, k, beta, T = 2, 3, 0.1, 0.7
    module = _module(tiny_model_dir, sampling={"k": k, "temperature": T, "max_new_tokens": 6}, kl={"beta": beta},
                     rewards={"funcs": [_position_reward]})
    assert module.reference is not None
    # move the policy away from the reference so that the KL term is not 0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        for p in module.policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    module.trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
    monkeypatch.setattr(module, "log", lambda *a, **kw: None)
    recorded = {}
    original = module.sample

    def recording_sample(*args, **kwargs):
        recorded["rollout"] = original(*args, **kwargs)
        return recorded["rollout"]

    monkeypatch.setattr(module, "sample", recording_sample)

    tok = module.tokenizer
    rows = [{"input_ids": _ids(tok, p), "prompt": p, "columns": {}} for p in ("abc=", "hgfedcb=")]
    batch = collate_prompts(rows, tok.pad_token_id)
    params = _params(module)
    loss = module.training_step(batch, 0)
    grads = torch.autograd.grad(loss, params)
    r = recorded["rollout"]
    assert r.completion_ids.shape[0] == N * k

    # By hand, one sequence at a time, without any padding: log pi(y_i), its gradient, KL_i.
    seq_lp, seq_grads, kls = [], [], []
    for i in range(N * k):
        p = r.prompt_ids[i][r.prompt_mask[i].bool()]
        n = int(r.completion_mask[i].sum())
        c = r.completion_ids[i, :n]
        ids = torch.cat([p, c])[None]
        lp = torch.log_softmax(module.policy(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + n] / T, -1)
        lp = lp.gather(1, c[:, None]).sum()
        seq_grads.append(torch.autograd.grad(lp, params))
        with torch.no_grad():
            ref = torch.log_softmax(module.reference(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + n] / T, -1)
            kls.append(lp.item() - ref.gather(1, c[:, None]).sum().item())
        seq_lp.append(lp.item())
    rewards = [0.25 * len(s) + 0.1 * (i % 3) for i, s in enumerate(r.completions)]
    shaped = [rw - beta * kl for rw, kl in zip(rewards, kls)]
    adv = []
    for i in range(N * k):
        g0 = (i // k) * k
        others = [shaped[j] for j in range(g0, g0 + k) if j != i]
        adv.append(shaped[i] - sum(others) / (k - 1))

    assert any(abs(x) > 1e-3 for x in kls)
    assert any(abs(a) > 1e-3 for a in adv)
    torch.testing.assert_close(r.rewards, torch.tensor(rewards))
    torch.testing.assert_close(r.kl, torch.tensor(kls), rtol=1e-4, atol=1e-4)
    expected_loss = -sum(a * lp for a, lp in zip(adv, seq_lp)) / (N * k)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-4, abs=1e-5)
    for j, g in enumerate(grads):
        expected = -sum(adv[i] * seq_grads[i][j] for i in range(N * k)) / (N * k)
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# pad == eos
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def module_pad_eos(tiny_model_dir_pad_eos):
    return _module(tiny_model_dir_pad_eos)


def test_pad_eos_eos_is_in_the_mask_and_in_the_loss(module_pad_eos):
    module = module_pad_eos
    tok = module.tokenizer
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos and module.eos_token_ids == [eos]
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    r = make_rollout(tok, ["abc=", "ab="], [[a, b, eos], [b, eos], [eos], [a, a, a, a]], k=2,
                     eos_ids=module.eos_token_ids)
    # completion ids are padded with eos (== pad) after the real EOS; only the first one is kept
    assert r.completion_ids[1].tolist() == [b, eos, eos, eos]
    assert r.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]

    adv = torch.tensor([1.0, -2.0, 0.5, 0.5])
    logits = completion_logits(module.policy, r).detach().requires_grad_(True)
    logp = token_logprobs(logits, r.completion_ids)
    loss = policy_loss(adv, logp, r.completion_mask)
    loss.backward()
    # the EOS's log-prob is in the loss: -sum_i A_i sum_{t <= first eos} logp_it / B
    lp = logp.detach()
    expected = -(1.0 * lp[0, :3].sum() - 2.0 * lp[1, :2].sum() + 0.5 * lp[2, :1].sum() + 0.5 * lp[3].sum()) / 4
    torch.testing.assert_close(loss.detach(), expected)
    for row, pos in ((0, 2), (1, 1), (2, 0)):
        assert logits.grad[row, pos].abs().sum() > 0  # the EOS position carries gradient
        assert torch.all(logits.grad[row, pos + 1:] == 0)  # the pads (also eos) do not
    # raising the EOS logit where A > 0 lowers the loss
    bumped = logits.detach().clone()
    bumped[0, 2, eos] += 1.0
    assert policy_loss(adv, token_logprobs(bumped, r.completion_ids), r.completion_mask) < loss


def test_pad_eos_sampled_rollout_keeps_the_eos(module_pad_eos):
    module = module_pad_eos
    tok = module.tokenizer
    eos = tok.eos_token_id
    rows = [{"input_ids": _ids(tok, p), "prompt": p, "columns": {}} for p in ("abc=", "hgfedcb=")]
    batch = collate_prompts(rows, tok.pad_token_id)
    r = module.sample(batch, 8, seed=5)
    ids, mask = r.completion_ids, r.completion_mask
    ended = ~r.truncated
    assert ended.any()
    for i in range(ids.shape[0]):
        if ended[i]:
            first = int((ids[i] == eos).nonzero()[0])
            assert mask[i].tolist() == [1.0] * (first + 1) + [0.0] * (ids.shape[1] - first - 1)
            assert r.completion_token_lists()[i][-1] == eos
            assert tok.eos_token not in r.completions[i]
        else:
            assert mask[i].sum() == ids.shape[1]


def test_mask_positions_count_real_tokens_from_zero_whatever_the_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert mask_positions(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 2, 2], [0, 0, 0, 0, 0]]
    assert mask_positions(mask.long()).dtype == torch.long
