"""A reward model as a reward function (``rloo_lightning.rewards.model.RewardModel``): the last real token's score
whatever the padding, its options and errors, never a submodule of the policy.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from rloo_lightning.rewards import RewardSet
from rloo_lightning.rewards.model import RewardModel


# -- reward model ------------------------------------------------------------------------------
RM_ALPHABET = "=hgfedcba:|ua"  # a different vocabulary (and order) from the policy's "abcdefgh="
TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}{{ eos_token }}"


def _save_rm(directory: Path, template: str | None, pad_is_eos: bool = False, num_labels: int = 1) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rloo_lightning.models import build_char_tokenizer

    tok = build_char_tokenizer(RM_ALPHABET, model_max_length=64)
    if template is not None:
        tok.chat_template = template
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_labels=num_labels)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, so 1e-5 means something
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return {
        "chat": _save_rm(root / "chat", TEMPLATE),
        "chat_pad_eos": _save_rm(root / "chat_pad_eos", TEMPLATE, pad_is_eos=True),
        "plain": _save_rm(root / "plain", None),
        "two_labels": _save_rm(root / "two_labels", None, num_labels=2),
    }


PROMPTS = ["abc=", "hgfed=", "a=", "bad=", "cafe="]
COMPLETIONS = ["cba", "defgh", "", "dab", "efacbdh"]


def _policy_ids():
    """Completion ids in the *policy's* vocabulary: the reward model must not read them."""
    from rloo_lightning.models import build_char_tokenizer

    policy_tok = build_char_tokenizer("abcdefgh=")
    return [policy_tok(c, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id] for c in COMPLETIONS]


@torch.no_grad()
def _reference_score(rm: RewardModel, ids: list[int]) -> float:
    """By hand: the backbone on the unpadded sequence, the head on its last hidden state."""
    hidden = rm.model.model(input_ids=torch.tensor([ids])).last_hidden_state
    return float(rm.model.score(hidden[0, -1]))


@pytest.mark.parametrize("which", ["chat", "chat_pad_eos", "plain"])
def test_reward_model_scores_the_last_real_token_whatever_the_padding(rm_dirs, which):
    rm = RewardModel(rm_dirs[which], batch_size=3, device="cpu")
    scores = rm(PROMPTS, COMPLETIONS, _policy_ids())
    seqs = [rm.encode(p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    if which != "plain":  # formatted with the reward model's own template, ending with its EOS
        assert rm.tokenizer.decode(seqs[0]) == "u:abc=|a:cba|<eos>" and seqs[0][-1] == rm.tokenizer.eos_token_id
    else:
        assert rm.tokenizer.decode(seqs[0]) == "abc=cba"
    expected = [_reference_score(rm, s) for s in seqs]
    assert len({len(s) for s in seqs}) > 1  # the batches really are padded
    for side in ("left", "right"):
        torch.testing.assert_close(torch.tensor(rm.score_ids(seqs, padding_side=side)), torch.tensor(expected),
                                   atol=1e-5, rtol=0)
    alone = RewardModel(rm_dirs[which], batch_size=1, device="cpu")
    torch.testing.assert_close(torch.tensor(alone(PROMPTS, COMPLETIONS, _policy_ids())), torch.tensor(expected),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-5, rtol=0)
    if which == "chat_pad_eos":
        # Hugging Face's pad-id pooling reads the token before the final EOS here: not the score.
        hf = float(rm.model(input_ids=torch.tensor([seqs[0]])).logits[0, 0])
        assert abs(hf - expected[0]) > 1e-3


def test_reward_model_options_and_errors(rm_dirs):
    plain = RewardModel(rm_dirs["chat"], use_chat_template=False, device="cpu")
    assert plain.tokenizer is None  # nothing is loaded before the first call
    assert plain.encode("abc=", "cba") == plain.tokenizer("abc=cba")["input_ids"]
    with pytest.raises(ValueError, match="no chat template"):
        RewardModel(rm_dirs["plain"], use_chat_template=True).load()
    with pytest.raises(ValueError, match=r"two_labels.*num_labels=2"):
        RewardModel(rm_dirs["two_labels"])(["a="], ["a"], [[1]])
    with pytest.raises(ValueError, match="dtype"):
        RewardModel(rm_dirs["plain"], dtype="float8")
    with pytest.warns(UserWarning, match="max_length=4"):
        assert len(RewardModel(rm_dirs["plain"], max_length=4).encode("abc=", "cba")) == 4


def test_reward_model_in_a_reward_set_is_never_a_submodule(rm_dirs):
    from rloo_lightning.module import RLOOModule

    spec = {"class_path": "rloo_lightning.rewards.model.RewardModel",
            "init_args": {"model_name_or_path": rm_dirs["chat_pad_eos"], "device": "cpu"}}
    module = RLOOModule(model_name_or_path="unused",
                        rewards={"funcs": [spec, "reward_helpers.length_reward"], "weights": [1.0, 0.0]},
                        kl={"beta": 0.0})
    total, per = module.rewards.score(PROMPTS, COMPLETIONS, _policy_ids(), {})
    rm = module.rewards.funcs[0]
    assert rm.model is not None and module.rewards.names == ["RewardModel", "length_reward"]
    torch.testing.assert_close(total, torch.tensor(rm(PROMPTS, COMPLETIONS, None)), atol=1e-5, rtol=0)
    rm_params = {id(p) for p in rm.model.parameters()}
    assert not rm_params & {id(p) for p in module.parameters()}
    assert not any(m is rm.model for m in module.modules())
    assert not any(k.startswith("score") or ".score." in k for k in module.state_dict())
    assert pickle.loads(pickle.dumps(module.rewards)).funcs[0].model is None  # copies do not carry weights
    # With workers on, the reward model still runs here; the rule function goes to a worker.
    with RewardSet.from_specs([spec, "reward_helpers.pid"], num_workers=1) as rs:
        assert rs._remote == [False, True]
        _, per = rs.score(PROMPTS, COMPLETIONS, _policy_ids(), {})
        assert os.getpid() not in set(per["pid"].tolist())
