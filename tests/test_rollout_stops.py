"""The end of a completion: the EOS ids (shipped, several, explicit) and stop strings, in the rollout's masks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from rloo_lightning.models import build_char_tokenizer, build_tiny_llama, load_causal_lm, load_tokenizer
from rloo_lightning.module import RLOOModule
from rloo_lightning.algo.logprobs import completion_mask
from rloo_lightning.rollout import default_eos_ids, generate_rollout, sampling_config, stop_string_ends
from module_helpers import REWARD, answer_batch as _batch, loaded_module as _module


ALPHABET = "abcdefgh="


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer(ALPHABET, model_max_length=32)


def _tokens(tok, row):
    return tok.convert_ids_to_tokens(row)


# ---------------------------------------------------------------------------------------------
# EOS ids
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shipped", "expected"),
    [
        (None, [2]),
        (GenerationConfig(), [2]),  # no eos_token_id in the shipped config
        (GenerationConfig(eos_token_id=7), [2, 7]),
        (GenerationConfig(eos_token_id=2), [2]),  # the same id once
        (GenerationConfig(eos_token_id=[2, 7]), [2, 7]),
        (GenerationConfig(eos_token_id=[9, 7, 2, 9]), [2, 9, 7]),  # de-duplicated, first occurrence order
    ],
)
def test_default_eos_ids(shipped, expected):
    assert default_eos_ids(SimpleNamespace(eos_token_id=2), shipped) == expected


@pytest.fixture(scope="module")
def two_eos_dir(tmp_path_factory, char_tok):
    """A tiny model whose shipped generation_config ends at ``<eos>`` or at ``h`` (a chat end-of-turn)."""
    directory = tmp_path_factory.mktemp("tiny_two_eos")
    model = build_tiny_llama(char_tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32)
    model.generation_config.eos_token_id = [char_tok.eos_token_id, char_tok.convert_tokens_to_ids("h")]
    model.save_pretrained(directory)
    char_tok.save_pretrained(directory)
    return str(directory)


def test_module_ends_completions_at_any_shipped_eos(two_eos_dir):
    module = _module(two_eos_dir, sampling={"max_new_tokens": 10})
    tok = module.tokenizer
    eos, h = tok.eos_token_id, tok.convert_tokens_to_ids("h")
    assert load_causal_lm(two_eos_dir).generation_config.eos_token_id == [eos, h]  # guard: really shipped
    assert module.eos_token_ids == [eos, h]
    assert list(module.generation_config.eos_token_id) == [eos, h]
    assert list(module.greedy_config.eos_token_id) == [eos, h]

    r = module.sample(_batch(tok, ["abc=", "gfed="]), 32, seed=5)
    ends = {"eos": 0, "h": 0}
    for i, row in enumerate(r.completion_ids.tolist()):
        first = next((t for t, x in enumerate(row) if x in (eos, h)), None)
        n = int(r.completion_mask[i].sum())
        assert r.completion_mask[i].tolist() == [1.0] * n + [0.0] * (len(row) - n)
        if first is None:
            assert n == len(row) and r.truncated[i]
            continue
        ends["eos" if row[first] == eos else "h"] += 1
        assert n == first + 1 and not r.truncated[i], (_tokens(tok, row), n)
        # generation itself stopped there: only padding follows
        assert all(x == tok.pad_token_id for x in row[first + 1 :]), _tokens(tok, row)
    assert ends["eos"] > 0 and ends["h"] > 0, ends


def test_explicit_eos_token_ids_override_the_default(tiny_model_dir):
    module = _module(tiny_model_dir, sampling={"eos_token_ids": [5, 6]})
    assert module.eos_token_ids == [5, 6]
    assert list(module.generation_config.eos_token_id) == [5, 6]


def test_completion_mask_stops_at_first_of_several_eos():
    ids = torch.tensor([[4, 9, 5, 2, 9], [4, 4, 4, 4, 4], [2, 9, 9, 9, 9]])
    assert completion_mask(ids, [2, 9]).tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------
# stop strings
# ---------------------------------------------------------------------------------------------
def _ends(tok, texts, stops, lengths=None):
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    lengths = lengths or [len(r) for r in rows]
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    return stop_string_ends(tok, ids, mask, stops).tolist()


def test_stop_string_ends_on_hand_built_ids(char_tok):
    assert _ends(char_tok, ["abccd"], ["cc"]) == [4]  # includes the token completing it
    assert _ends(char_tok, ["abccd"], ["x"]) == [-1]
    assert _ends(char_tok, ["abccd"], ["cc"], lengths=[3]) == [-1]  # only beyond the mask
    assert _ends(char_tok, ["abccd"], ["cc"], lengths=[4]) == [4]  # the mask's last token completes it
    assert _ends(char_tok, ["ccaccb"], ["cc"]) == [2]  # the first occurrence
    assert _ends(char_tok, ["abccd"], ["d", "bc"]) == [3]  # whichever string ends first
    assert _ends(char_tok, ["cab"], ["c"]) == [1]
    assert _ends(char_tok, ["abc", "hgf", "aabcc"], ["bc"]) == [3, -1, 4]  # per row
    # a stop string spanning a special token's text is found in the decoded (special-kept) text
    assert _ends(char_tok, ["ab<eos>c"], ["b<eos>"]) == [3]


def _check_stopped_rollout(tok, r, stops):
    """Each row: mask ends at the first stop string (or EOS); stopped rows end their text with it."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    stopped = 0
    for i, row in enumerate(r.completion_ids.tolist()):
        toks = _tokens(tok, row)
        eos_end = next((t + 1 for t, x in enumerate(row) if x == eos), len(row))
        # character offsets of each token's end in the raw (special-kept) text
        ends, text = [], ""
        for s in toks[:eos_end]:
            text += s
            ends.append(len(text))
        hits = [text.find(s) + len(s) for s in stops if s in text]
        n = int(r.completion_mask[i].sum())
        assert r.completion_mask[i].tolist() == [1.0] * n + [0.0] * (len(row) - n)
        if not hits:
            assert n == eos_end, toks
            assert bool(r.truncated[i]) == (eos_end == len(row) and row[-1] != eos), toks
            continue
        stopped += 1
        end_token = next(t + 1 for t, e in enumerate(ends) if e >= min(hits))
        assert n == end_token, (toks, n, end_token)
        assert not r.truncated[i], toks
        assert any(r.completions[i].endswith(s) for s in stops), (r.completions[i], toks)
        assert all(x == pad for x in row[n:]), toks  # generate stopped there too
    return stopped


def test_generate_rollout_ends_masks_at_stop_strings(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    # Stops that cannot straddle the prompt (all prompts end with "=").
    stops = ["cd", "g"]
    batch = _batch(tok, ["abc=", "hgfe="])
    config = sampling_config(12, [tok.eos_token_id], tok.pad_token_id, stop_strings=stops)
    r = generate_rollout(model, tok, batch["input_ids"], batch["attention_mask"], batch["prompt"],
                         batch["columns"], 24, config, seed=0)
    stopped = _check_stopped_rollout(tok, r, stops)
    assert stopped >= 5, stopped
    assert any(c.endswith("cd") for c in r.completions) and any(c.endswith("g") for c in r.completions)
    assert r.truncated.shape == (48,) and r.completion_mask.shape == r.completion_ids.shape

    # Without stop strings the same seed samples past those points: the stops really cut.
    plain = generate_rollout(model, tok, batch["input_ids"], batch["attention_mask"], batch["prompt"],
                             batch["columns"], 24, sampling_config(12, [tok.eos_token_id], tok.pad_token_id),
                             seed=0)
    assert plain.completion_mask.sum() > r.completion_mask.sum()


def test_stop_strings_with_pad_equal_to_eos(tiny_model_dir_pad_eos):
    # After a stop string generate pads with pad == eos: the mask must still end at the stop.
    tok = load_tokenizer(tiny_model_dir_pad_eos)
    model = load_causal_lm(tiny_model_dir_pad_eos)
    stops = ["cd", "g"]
    batch = _batch(tok, ["abc=", "hgfe="])
    config = sampling_config(12, [tok.eos_token_id], tok.pad_token_id, stop_strings=stops)
    r = generate_rollout(model, tok, batch["input_ids"], batch["attention_mask"], batch["prompt"],
                         batch["columns"], 16, config, seed=1)
    assert _check_stopped_rollout(tok, r, stops) >= 3


def test_module_with_stop_strings_uses_them(tiny_model_dir):
    module = _module(tiny_model_dir, sampling={"stop_strings": ["cd", "g"], "max_new_tokens": 12})
    assert list(module.generation_config.stop_strings) == ["cd", "g"]
    assert list(module.greedy_config.stop_strings) == ["cd", "g"]
    r = module.sample(_batch(module.tokenizer, ["abc=", "hgfe="]), 16, seed=module.sampling_seed("train", 0))
    assert _check_stopped_rollout(module.tokenizer, r, ["cd", "g"]) >= 3
    # a module without stop strings has none in either config
    plain = _module(tiny_model_dir)
    assert not plain.generation_config.stop_strings and not plain.greedy_config.stop_strings


# transformers' StopStringCriteria matches stop strings on the whole sequence, prompt included: a
# stop string that begins in the prompt's tail ends the completion, and the mask must end there too
# (not cover the padding generated afterwards as if it had been sampled).
def test_stop_string_straddling_the_prompt_ends_the_completion(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    eq = tok.convert_tokens_to_ids("=")
    batch = _batch(tok, ["abc="])
    config = sampling_config(8, [tok.eos_token_id], tok.pad_token_id, stop_strings=["=="])
    r = generate_rollout(model, tok, batch["input_ids"], batch["attention_mask"], batch["prompt"],
                         batch["columns"], 32, config, seed=0)
    starts_eq = [i for i, row in enumerate(r.completion_ids.tolist()) if row[0] == eq]
    assert starts_eq  # guard: the case occurs with this seed
    for i in starts_eq:
        row = r.completion_ids[i].tolist()
        assert all(x == tok.pad_token_id for x in row[1:]), _tokens(tok, row)  # generate did stop
        assert int(r.completion_mask[i].sum()) == 1 and not r.truncated[i], (
            _tokens(tok, row), r.completion_mask[i].tolist(), bool(r.truncated[i]))


@pytest.mark.parametrize("stops", [[], [""], ["cd", ""]])
def test_empty_stop_strings_raise(stops):
    with pytest.raises(ValueError, match=r"sampling\.stop_strings must be non-empty strings"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": [REWARD]}, sampling={"stop_strings": stops})
