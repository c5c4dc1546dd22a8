"""Multi-turn episodes, token in and token out: the turn markers, the episode loop, the transcript masks."""

from __future__ import annotations

import pytest
import torch

from rloo_lightning.environments import EnvStep, Environment, Message
from rloo_lightning.environments.calls import EpisodeError
from rloo_lightning.environments.episodes import LiveEpisode, assemble_transcripts, run_episodes
from rloo_lightning.environments.turns import TurnFormat
from rloo_lightning.models.tiny import build_char_tokenizer

CHAT = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}<e>{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}")
# Rewrites earlier assistant turns, as reasoning templates do: only the text after the last '|' survives.
REWRITING = ("{% for m in messages %}<{{ m['role'][0] }}>{% if m['role'] == 'assistant' and not loop.last %}"
             "{{ m['content'].split('|')[-1] }}{% else %}{{ m['content'] }}{% endif %}<e>{% endfor %}"
             "{% if add_generation_prompt %}<a>{% endif %}")


def _tokenizer(template=CHAT):
    tok = build_char_tokenizer("abcdefgh|=0123456789QXASITNOBERVUT")
    tok.add_special_tokens({"additional_special_tokens": ["<u>", "<a>", "<t>", "<e>", "<x>"]})
    tok.chat_template = template
    return tok


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_turn_format_reads_the_templates_markers_and_leaves_out_the_policys_end_token():
    tok = _tokenizer()
    fmt = TurnFormat.from_tokenizer(tok)
    # after the assistant's "<e>" (sampled by the policy): "<u>" content "<e>" then the generation prompt "<a>"
    assert fmt.reply_ids(Message("user", "ab"), "<e>") == _ids(tok, "<u>ab<e><a>")
    assert fmt.reply_ids(Message("tool", "12"), "<e>") == _ids(tok, "<t>12<e><a>")
    # without the stripping, the end token would be appended twice
    assert TurnFormat.from_tokenizer(tok).reply_ids(Message("user", "ab")) == _ids(tok, "<e><u>ab<e><a>")
    # a turn ended by another end token ("<x>"): the template's closing "<e>" still follows it
    assert fmt.reply_ids(Message("user", "ab"), "<x>") == _ids(tok, "<e><u>ab<e><a>")


def test_without_a_chat_template_the_plain_pattern_is_used():
    tok = build_char_tokenizer("abc=:")
    fmt = TurnFormat.from_tokenizer(tok, plain="={content}:")
    assert fmt.reply_ids(Message("user", "ab")) == _ids(tok, "=ab:")


class Scripted(Environment):
    """Replies "<n>" (the turn number as a digit) and ends after ``turns`` turns, with reward 1 per turn."""

    def __init__(self, turns=2, fail_at=None):
        self.turns, self.fail_at = turns, fail_at
        self.seen = []

    def reset(self, row, seed):
        self.row, self.seed = row, seed

    def step(self, turn):
        self.seen.append(turn)
        if turn.index == self.fail_at:
            raise KeyError("boom")
        if turn.index + 1 >= self.turns:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(observation=Message("user", str(turn.index)), reward=1.0)


def _scripted_generate(tok, turns_text, calls):
    """``generate`` answering row j at turn t with ``turns_text[t][j]`` (texts may carry "<e>")."""

    def generate(ids, mask, turn):
        calls.append((ids.clone(), mask.clone(), turn))
        rows = [_ids(tok, t) for t in turns_text[turn][: ids.shape[0]]]
        width = max(map(len, rows))
        return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])

    return generate


def _prompts(tok, texts):
    rows = [[tok.bos_token_id] + _ids(tok, t) for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    return ids, (ids != tok.pad_token_id).long()


@pytest.mark.parametrize("template", [CHAT, REWRITING], ids=["plain-template", "rewriting-template"])
def test_policy_tokens_are_kept_exactly_and_only_markers_and_replies_are_appended(template):
    tok = _tokenizer(template)
    eos = tok.convert_tokens_to_ids("<e>")
    fmt = TurnFormat.from_tokenizer(tok)
    prompt_ids, prompt_mask = _prompts(tok, ["ab=", "c="])
    turn0 = ["h|ab<e>", "cd<e>"]  # row 0 writes a reasoning part that REWRITING would drop on re-render
    turn1 = ["ba<e>", "dc<e>"]
    calls = []
    episodes = [LiveEpisode(Scripted(turns=2)) for _ in range(2)]
    run_episodes(_scripted_generate(tok, [turn0, turn1], calls), tok, prompt_ids, prompt_mask, episodes, fmt,
                 [eos], max_new_tokens=8, max_turns=4, max_context=None, where=["row 0", "row 1"])
    # Turn 1's context: the prompt, turn 0 exactly as sampled, then the reply's ids; nothing re-rendered.
    ctx, mask, turn = calls[1]
    assert turn == 1
    for j in range(2):
        got = ctx[j][mask[j].bool()].tolist()
        expected = prompt_ids[j][prompt_mask[j].bool()].tolist() + _ids(tok, turn0[j]) + _ids(tok, "<u>0<e><a>")
        assert got == expected
    ids, policy, context = assemble_transcripts(episodes, tok.pad_token_id)
    for j, ep in enumerate(episodes):
        expected = _ids(tok, turn0[j]) + _ids(tok, "<u>0<e><a>") + _ids(tok, turn1[j])
        n = len(expected)
        assert ids[j, :n].tolist() == expected and context[j].sum() == n
        n0, nr = len(_ids(tok, turn0[j])), len(_ids(tok, "<u>0<e><a>"))
        assert policy[j, :n].tolist() == [1.0] * n0 + [0.0] * nr + [1.0] * (n - n0 - nr)
        assert ep.turns == 2 and ep.env_reward == 2.0 and not ep.truncated
        assert [m["role"] for m in ep.messages] == ["assistant", "user", "assistant"]


def test_a_turn_ended_by_a_second_end_token_gets_the_templates_closing_after_it():
    tok = _tokenizer()
    eos = [tok.convert_tokens_to_ids("<e>"), tok.convert_tokens_to_ids("<x>")]
    fmt = TurnFormat.from_tokenizer(tok)
    prompt_ids, prompt_mask = _prompts(tok, ["ab=", "ab="])
    calls = []
    episodes = [LiveEpisode(Scripted(turns=2)) for _ in range(2)]
    run_episodes(_scripted_generate(tok, [["a<x>", "b<e>"], ["c<e>", "d<e>"]], calls), tok, prompt_ids, prompt_mask,
                 episodes, fmt, eos, max_new_tokens=8, max_turns=4, max_context=None, where=["row 0", "row 1"])
    ctx, mask, _ = calls[1]
    tails = [ctx[j][mask[j].bool()].tolist()[prompt_mask[j].sum():] for j in range(2)]
    # the sampled "<x>" is kept and the template's "<e>" closes the turn; a sampled "<e>" is not doubled
    assert tails == [_ids(tok, "a<x><e><u>0<e><a>"), _ids(tok, "b<e><u>0<e><a>")]


def test_max_turns_context_and_max_new_tokens_cut_episodes_with_a_flag():
    tok = _tokenizer()
    eos = tok.convert_tokens_to_ids("<e>")
    fmt = TurnFormat.from_tokenizer(tok)
    prompt_ids, prompt_mask = _prompts(tok, ["ab=", "ab=", "ab="])
    turns = [["a<e>", "abcdefgh", "a<e>"], ["b<e>", "b<e>", "b<e>"], ["c<e>"] * 3]
    calls = []
    episodes = [LiveEpisode(Scripted(turns=10)) for _ in range(3)]
    # row 2's context budget: prompt 4 + turn 2 + reply 4 + 8 new tokens > 17 before its second turn
    run_episodes(_scripted_generate(tok, turns, calls), tok, prompt_ids, prompt_mask, episodes, fmt, [eos],
                 max_new_tokens=8, max_turns=2, max_context=18, where=["r0", "r1", "r2"])
    assert [(ep.truncated, ep.cut_by, ep.turns) for ep in episodes] == [
        (True, "max_turns", 2), (True, "max_new_tokens", 1), (True, "max_turns", 2)]
    # the last turn's reply is not appended: nothing follows it
    assert episodes[0].segments[-1][1] is True
    budget = [LiveEpisode(Scripted(turns=10))]
    run_episodes(_scripted_generate(tok, turns, []), tok, prompt_ids[:1], prompt_mask[:1], budget, fmt, [eos],
                 max_new_tokens=8, max_turns=5, max_context=17, where=["r0"])
    assert (budget[0].truncated, budget[0].cut_by, budget[0].turns) == (True, "context", 1)


def test_finished_episodes_drop_out_of_the_next_turn():
    tok = _tokenizer()
    eos = tok.convert_tokens_to_ids("<e>")
    fmt = TurnFormat.from_tokenizer(tok)
    prompt_ids, prompt_mask = _prompts(tok, ["ab=", "c=", "d="])
    calls = []
    episodes = [LiveEpisode(Scripted(turns=n)) for n in (1, 3, 2)]
    run_episodes(_scripted_generate(tok, [["a<e>"] * 3] * 3, calls), tok, prompt_ids, prompt_mask, episodes, fmt,
                 [eos], max_new_tokens=4, max_turns=5, max_context=None, where=["r0", "r1", "r2"])
    assert [c[0].shape[0] for c in calls] == [3, 2, 1]
    assert [ep.turns for ep in episodes] == [1, 3, 2] and not any(ep.truncated for ep in episodes)


def test_an_environment_error_names_the_environment_the_row_and_the_turn():
    tok = _tokenizer()
    eos = tok.convert_tokens_to_ids("<e>")
    prompt_ids, prompt_mask = _prompts(tok, ["ab="])
    fmt = TurnFormat.from_tokenizer(tok)
    with pytest.raises(RuntimeError, match=r"environment Scripted failed on data.jsonl row 7, turn 1: KeyError"):
        run_episodes(_scripted_generate(tok, [["a<e>"]] * 3, []), tok, prompt_ids, prompt_mask,
                     [LiveEpisode(Scripted(turns=3, fail_at=1))], fmt, [eos], 4, 3, None, ["data.jsonl row 7"])

    class Wrong(Scripted):
        def step(self, turn):
            return 1.0

    with pytest.raises(EpisodeError, match=r"Wrong.step returned float on r0, turn 0; it must return an EnvStep"):
        run_episodes(_scripted_generate(tok, [["a<e>"]], []), tok, prompt_ids, prompt_mask, [LiveEpisode(Wrong())], fmt,
                     [eos], 4, 1, None, ["r0"])


def test_a_transcripts_log_probs_reach_its_last_policy_token_past_the_environments_tokens():
    from rloo_lightning.algo.logprobs import mask_width
    from rloo_lightning.forward import completion_logits
    from rloo_lightning.models.tiny import build_tiny_llama

    assert mask_width(torch.tensor([[1.0, 1, 0, 0, 0], [1, 0, 0, 1, 0]])) == 4
    assert mask_width(torch.zeros(2, 3)) == 1
    tok = build_char_tokenizer("abcdefgh=")
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32, seed=0).eval()
    prompt = torch.tensor([[1, 5, 6, 12]])
    transcript = torch.tensor([[7, 8, 2, 9, 10, 11, 2, 0]])
    policy = torch.tensor([[1.0, 1, 1, 0, 0, 1, 1, 0]])  # tokens 3-4 are the environment's
    logits = completion_logits(model, prompt, torch.ones_like(prompt), transcript, policy)
    full = model(input_ids=torch.cat([prompt, transcript[:, :7]], 1)).logits[:, prompt.shape[1] - 1:]
    assert logits.shape[1] == 7 and torch.allclose(logits, full[:, :7], atol=1e-5)
