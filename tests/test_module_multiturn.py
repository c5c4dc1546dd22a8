"""Multi-turn episodes in RLOOModule: the rollout, the masks of the loss and the KL, rewards, errors, options.

In-process tests on tiny random models (the CLI runs, with DDP / FSDP2 and resume, are in
``test_cli_multiturn.py``). The environments are in ``multiturn_helpers.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from module_helpers import prompt_batch, retain_policy_logprobs

from rloo_lightning import RLOOModule
from rloo_lightning.callbacks import SampleLogger
from rloo_lightning.data import collate_prompts
from rloo_lightning.environments.calls import EpisodeError
from rloo_lightning.environments.episodes import LiveEpisode, run_episodes
from rloo_lightning.environments.sampler import EpisodeWarning
from rloo_lightning.environments.turns import TurnFormat
from rloo_lightning.rollout import concat_groups, derive_seed
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

GUESS = "rloo_lightning.environments.guess.GuessEnvironment"
NOISY = "multiturn_helpers.Noisy"
REVERSE = "rloo_lightning.tasks.reverse.reward"


@pytest.fixture(scope="module")
def guess_model():
    """A random tiny Llama on the guess task's alphabet (no warm start: the tests need tokens, not skill)."""
    tok = build_char_tokenizer("ab?=-|", model_max_length=48)
    return tok, build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=48, seed=3)


def _module(model, tok, environment, reference=None, **groups):
    # A random model: three end ids and 10 tokens, so that nearly every turn ends (only 3% run to the budget).
    groups.setdefault("sampling", {"k": 4, "max_new_tokens": 10, "eos_token_ids": [2, 8, 9]})
    groups.setdefault("validation", {"at_start": False})
    m = RLOOModule("x", rewards=groups.pop("rewards", {}), environment=environment, **groups)
    m.attach(copy.deepcopy(model), tok, reference)
    m.log = lambda *a, **kw: None
    return m


def _guess_batch(tok, secrets=("abab", "bbaa", "aaab")):
    rows = [{"input_ids": tok("?" * len(s) + "=", add_special_tokens=False)["input_ids"], "prompt": "?" * len(s) + "=",
             "columns": {"secret": s}, "row": 10 + i} for i, s in enumerate(secrets)]
    return collate_prompts(rows, tok.pad_token_id)


GUESS_ENV = {"class_path": GUESS, "max_turns": 2, "reply_format": "|{content}="}


def test_a_one_turn_environment_trains_exactly_as_the_single_turn_step(tiny_model_dir):
    """The multi-turn path adds nothing to a one-turn episode: the same tokens, rewards, loss and gradient."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = prompt_batch(tok)
    batch["columns"] = {"answer": [p[:-1][::-1] for p in batch["prompt"]]}
    single = RLOOModule("x", rewards={"funcs": [REVERSE]}, sampling={"k": 3, "max_new_tokens": 6},
                        validation={"at_start": False})
    multi = RLOOModule("x", rewards={}, environment={"class_path": "multiturn_helpers.OneShot", "max_turns": 1},
                       sampling={"k": 3, "max_new_tokens": 6}, validation={"at_start": False})
    grads = []
    for m in (single, multi):
        m.attach(copy.deepcopy(model), tok)
        m.log = lambda *a, **kw: None
        loss = m.training_step(batch, 0)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.policy.parameters()]))
        m.last_loss = loss.detach()
    assert torch.equal(single.last_loss, multi.last_loss)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_the_transcript_is_the_completion_and_only_policy_tokens_are_in_the_mask(guess_model):
    tok, model = guess_model
    m = _module(model, tok, GUESS_ENV)
    rollout = m.sample(_guess_batch(tok), 4, seed=5)
    rollout.scores, rollout.rewards = m.score(rollout)
    env_tokens = rollout.episodes.context_mask - rollout.completion_mask
    assert (env_tokens >= 0).all() and env_tokens.sum() > 0 and (rollout.episodes.turns == 2).sum() >= 6
    for i in range(12):
        transcript = rollout.columns["transcript"][i]
        if rollout.episodes.turns[i] == 1:  # the random model wrote 6 tokens without EOS: the episode was cut
            assert rollout.truncated[i] and len(transcript) == 1 and env_tokens[i].sum() == 0
            continue
        assert [t["role"] for t in transcript] == ["assistant", "user", "assistant"]
        ids = rollout.completion_ids[i][rollout.episodes.context_mask[i].bool()].tolist()
        policy = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        reply = tok(f"|{transcript[1]['content']}=", add_special_tokens=False)["input_ids"]
        first = policy[:len(policy) - len(rollout.episodes.final_turn_ids[i])]
        assert ids == first + reply + list(rollout.episodes.final_turn_ids[i])  # nothing re-rendered or re-tokenized
        assert rollout.completions[i] == transcript[-1]["content"]
        secret = rollout.columns["secret"][i]
        assert rollout.rewards[i] == pytest.approx(sum(a == b for a, b in zip(rollout.completions[i], secret))
                                                   / max(len(secret), len(rollout.completions[i])))
    assert set(rollout.scores) == {"environment"}


def test_environment_tokens_get_exactly_zero_gradient(guess_model, monkeypatch):
    tok, model = guess_model
    m = _module(model, tok, GUESS_ENV, kl={"beta": 0.1})
    kept = retain_policy_logprobs(m, monkeypatch)
    loss = m.training_step(_guess_batch(tok), 0)
    loss.backward()
    grad, rollout = kept["logp"].grad, kept["rollout"]
    env_tokens = (rollout.episodes.context_mask - rollout.completion_mask).bool()
    assert env_tokens.any() and (grad[env_tokens] == 0).all()  # exactly zero, not small
    assert (grad[rollout.completion_mask.bool()] != 0).any()


def test_the_kl_counts_policy_tokens_only(guess_model):
    tok, model = guess_model
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m = _module(model, tok, GUESS_ENV, reference=reference, kl={"beta": 0.1})
    rollout = m.sample(_guess_batch(tok), 4, seed=5)
    rollout.scores, rollout.rewards = m.score(rollout)
    m.rollout_loss(rollout)
    with torch.no_grad():
        logp, _ = m.logprobs(m.policy, rollout)
        ref, _ = m.logprobs(m.reference, rollout)
    per_token = logp - ref
    torch.testing.assert_close(rollout.kl, (per_token * rollout.completion_mask).sum(1))
    env_part = (per_token * (rollout.episodes.context_mask - rollout.completion_mask)).sum(1)
    assert env_part.abs().max() > 1e-3  # counting the environment's tokens would have given other numbers


def test_reward_functions_score_the_last_turn_and_see_the_transcript(guess_model):
    tok, model = guess_model
    seen = {}

    def reward(prompts, completions, completion_ids, transcript, secret):
        seen.update(completions=completions, completion_ids=completion_ids, transcript=transcript, secret=secret)
        return [1.0] * len(prompts)

    m = _module(model, tok, GUESS_ENV, rewards={"funcs": [reward]})
    rollout = m.sample(_guess_batch(tok), 4, seed=5)
    rollout.scores, rollout.rewards = m.score(rollout)
    assert seen["completions"] == [t[-1]["content"] for t in seen["transcript"]]
    assert seen["completion_ids"] == [list(ids) for ids in rollout.episodes.final_turn_ids]
    assert seen["secret"] == rollout.columns["secret"]
    torch.testing.assert_close(rollout.rewards, 1.0 + rollout.scores["environment"])
    assert set(rollout.scores) == {"reward", "environment"}


def test_episodes_are_seeded_by_row_and_sample_and_replay_exactly(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    m = _module(model, tok, {"class_path": NOISY, "max_turns": 3}, sampling={"k": 2, "max_new_tokens": 4})
    batch = prompt_batch(tok)
    batch["row_index"] = torch.tensor([7, 3, 9, 1])
    seeds = []
    original = m.episodes.new_environment

    def recording():
        env = original()
        reset = env.reset
        env.reset = lambda row, seed: (seeds.append((row["row_index"], row["sample_index"], seed)), reset(row, seed))
        return env

    m.episodes.new_environment = recording
    first = m.sample(batch, 2, seed=11)
    assert seeds == [(r, j, derive_seed(11, "env", r, j)) for r in (7, 3, 9, 1) for j in (0, 1)]
    again = m.sample(batch, 2, seed=11)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert first.columns["transcript"] == again.columns["transcript"]
    other = m.sample(batch, 2, seed=12)
    assert other.columns["transcript"] != first.columns["transcript"]


@pytest.mark.parametrize("on_error", ["raise", "none", -1.0])
def test_an_environment_error_names_the_environment_and_the_prompt_or_is_scored(tiny_model_dir, on_error):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    env = {"class_path": NOISY, "init_args": {"fail_at": 1}, "max_turns": 3, "on_error": on_error}
    m = _module(model, tok, env, sampling={"k": 2, "max_new_tokens": 4})
    batch = prompt_batch(tok)
    batch["row_index"] = torch.tensor([4, 5, 6, 7])
    if on_error == "raise":
        with pytest.raises(EpisodeError, match=r"environment Noisy failed on prompt row [4-7] \('[a-h]+='\), sample "
                                               r"[01], turn 1: ValueError: the simulator crashed"):
            m.sample(batch, 2, seed=1)
        return
    with pytest.warns(EpisodeWarning, match=r"environment Noisy failed on prompt row \d .*environment.on_error"):
        rollout = m.sample(batch, 2, seed=1)
    rollout.scores, rollout.rewards = m.score(rollout)
    rewards = rollout.rewards
    ended_early = rollout.episodes.turns == 2  # the episodes that reached the failing turn
    assert ended_early.any()
    if on_error == "none":
        assert torch.isnan(rewards[ended_early]).all() and not torch.isnan(rewards[~ended_early]).any()
        m.rollout_loss(rollout)
        assert (rollout.advantages[ended_early] == 0).all()  # missing: out of the loss and the baseline
    else:
        assert (rewards[ended_early] == -1.0).all()


@pytest.mark.parametrize("environment,groups,message", [
    ({"class_path": "no_such_module.Env"}, {}, r"environment.class_path 'no_such_module.Env' cannot be imported"),
    ({"class_path": "rloo_lightning.tasks.reverse.reward"}, {}, r"is not a subclass of .*Environment"),
    ({"class_path": GUESS, "max_turns": 0}, {}, r"environment.max_turns must be >= 1"),
    ({"class_path": GUESS, "reply_format": "|{role}="}, {}, r"environment.reply_format must contain \{content\}"),
    ({"class_path": GUESS, "on_error": "retry"}, {}, r"environment.on_error must be"),
    ({"class_path": GUESS}, {"sampling": {"stop_strings": ["\n"]}}, r"sampling.stop_strings are not supported"),
    ({"class_path": GUESS}, {"shaping": {"overlong_buffer": 2}}, r"shaping.overlong_buffer"),
    ({"class_path": GUESS, "init_args": {"feedback": "lots"}}, {}, None),
], ids=["missing", "not-an-environment", "max-turns", "reply-format", "on-error", "stop-strings", "overlong",
        "bad-init-args"])
def test_bad_environment_options_fail_before_any_model_is_loaded(environment, groups, message, guess_model):
    if message is None:  # the class's own check fails when the first episode is made, naming the class
        tok, model = guess_model
        m = _module(model, tok, environment)
        with pytest.raises(ValueError, match=r"GuessEnvironment\(\*\*\{'feedback': 'lots'\}\) raised ValueError"):
            m.sample(_guess_batch(tok), 4, seed=0)
        return
    with pytest.raises(ValueError, match=message):
        RLOOModule("x", rewards={}, environment=environment, **groups)


def test_a_data_column_named_transcript_is_refused(guess_model):
    tok, model = guess_model
    m = _module(model, tok, GUESS_ENV)
    batch = _guess_batch(tok)
    batch["columns"]["transcript"] = ["x"] * 3
    with pytest.raises(ValueError, match="column 'transcript'"):
        m.sample(batch, 4, seed=0)


def test_without_rewards_or_an_environment_fit_is_refused():
    m = RLOOModule("x", rewards={})
    with pytest.raises(ValueError, match="rewards.funcs must name at least one reward function"):
        m.setup("fit")
    RLOOModule("x", rewards={}, environment=GUESS_ENV).setup("fit")  # the environment gives the rewards


def test_cut_episodes_are_flagged_and_can_be_left_out_of_the_loss(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    env = {"class_path": NOISY, "init_args": {"turns": 5}, "max_turns": 2}
    m = _module(model, tok, env, sampling={"k": 2, "max_new_tokens": 4},
                shaping={"mask_truncated_completions": True})
    rollout = m.sample(prompt_batch(tok), 2, seed=3)
    rollout.scores, rollout.rewards = m.score(rollout)
    assert rollout.truncated.all()  # every episode wanted 5 turns: max_turns (or a turn's budget) cut it
    m.rollout_loss(rollout)
    assert not rollout.keep.any() and (rollout.advantages == 0).all()
    budget = _module(model, tok, {**env, "max_turns": 5, "max_context_tokens": 16},
                     sampling={"k": 2, "max_new_tokens": 4})
    rollout = budget.sample(prompt_batch(tok), 2, seed=3)
    lengths = rollout.prompt_mask.sum(1) + rollout.episodes.context_mask.sum(1)
    assert (lengths <= 16).all() and rollout.truncated.all()


def test_ranks_that_share_every_forward_take_part_in_every_turn():
    """synced_gpus (ZeRO-3 left partitioned): while any rank has a live episode, every rank generates."""
    tok = build_char_tokenizer("ab")
    calls = []

    def generate(ids, mask, turn):
        calls.append((turn, ids.shape[0]))
        return torch.tensor([[tok.eos_token_id]] * ids.shape[0])

    from multiturn_helpers import Noisy

    episodes = [LiveEpisode(Noisy(turns=1)) for _ in range(2)]
    for ep in episodes:
        ep.env.reset({}, 0)
    others = iter([True, True, True, False])  # another rank plays 3 turns
    run_episodes(generate, tok, torch.tensor([[4, 5], [5, 4]]), torch.ones(2, 2, dtype=torch.long), episodes,
                 TurnFormat.from_tokenizer(tok, plain="{content}"), [tok.eos_token_id], 2, 5, None, ["r0", "r1"],
                 keep_going=lambda live: live or next(others))
    assert calls == [(0, 2), (1, 1), (2, 1), (3, 1)]  # turn 0 for real, then one throw-away row per turn
    assert [ep.turns for ep in episodes] == [1, 1]


def test_train_metrics_and_the_sample_table_show_the_episodes(guess_model):
    from rloo_lightning.metrics import train_metric_sums

    tok, model = guess_model
    m = _module(model, tok, GUESS_ENV)
    rollout = m.sample(_guess_batch(tok), 4, seed=5)
    rollout.scores, rollout.rewards = m.score(rollout)
    loss, entropy = m.rollout_loss(rollout)
    sums = train_metric_sums(rollout, entropy, loss)
    mean = {name: float(s) / float(n) for name, (s, n) in sums.items()}
    two = (rollout.episodes.turns == 2).float()
    assert two.sum() >= 6 and mean["train/turns"] == pytest.approx(1 + two.mean().item())
    assert mean["train/truncated_episodes"] == pytest.approx(rollout.truncated.float().mean().item())
    assert mean["train/policy_tokens"] == pytest.approx(rollout.completion_mask.sum(1).mean().item())
    assert mean["train/env_tokens"] == pytest.approx(6.0 * two.mean().item())  # "|" + 4 letters + "=" per reply
    table = SampleLogger(num_rows=2).table(rollout)
    assert "[assistant] " in table and "[user] " in table


def test_dynamic_sampling_keeps_the_episode_fields(guess_model):
    tok, model = guess_model
    m = _module(model, tok, GUESS_ENV)
    a, b = (m.sample(_guess_batch(tok), 4, seed=s) for s in (1, 2))
    for r in (a, b):
        r.scores, r.rewards = m.score(r)
    joined = concat_groups([(a, [0, 2]), (b, [1])], tok.pad_token_id)
    assert joined.episodes.context_mask.shape == joined.completion_ids.shape
    assert len(joined.episodes.final_turn_ids) == 12
    expected = torch.cat([a.episodes.rewards[:4], a.episodes.rewards[8:], b.episodes.rewards[4:8]])
    torch.testing.assert_close(joined.episodes.rewards, expected)
    assert joined.columns["transcript"][4] == a.columns["transcript"][8]


def test_an_engine_that_reports_log_probs_gives_them_for_the_policy_tokens(guess_model):
    from rloo_lightning.engines.decode import DecodeLoopEngine

    tok, model = guess_model
    m = RLOOModule("x", rewards={}, environment=GUESS_ENV, sampling={"k": 4, "max_new_tokens": 6},
                   generation_engine=DecodeLoopEngine(return_logprobs=True))
    m.attach(copy.deepcopy(model), tok)
    rollout = m.sample(_guess_batch(tok), 4, seed=5)
    with torch.no_grad():
        logp, _ = m.logprobs(m.policy, rollout)
    mask = rollout.completion_mask
    assert (rollout.sampler_logp[~mask.bool()] == 0).all()
    torch.testing.assert_close(rollout.sampler_logp * mask, logp * mask, atol=1e-4, rtol=0)


def test_the_readme_environment_runs_as_written(tiny_model_dir, tmp_path, monkeypatch):
    """README's ``my_env.py``, verbatim, given by class path to a module that samples and scores with it."""
    import re
    import sys

    from cli_harness import REPO
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (block,) = [b for b in re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
                if b.startswith("# my_env.py")]
    (tmp_path / "my_env.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_env", None)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    m = _module(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok,
                {"class_path": "my_env.Hint", "reply_format": "={content}=",
                 "max_context_tokens": 64},  # the tiny model's own context (32) would cut the second turn
                rewards={"funcs": [REVERSE]})
    batch = prompt_batch(tok)
    batch["columns"] = {"answer": [p[:-1][::-1] for p in batch["prompt"]]}
    rollout = m.sample(batch, 4, seed=0)
    rollout.scores, rollout.rewards = m.score(rollout)
    assert set(rollout.scores) == {"reward", "environment"} and rollout.episodes.turns.max() == 2


def test_a_stored_rollout_round_trips():
    # A checkpoint taken between two updates on one rollout stores its fields (dataclasses.asdict, as RolloutReuse
    # stores them): a multi-turn rollout's episodes and a single-turn one's None both come back.
    import dataclasses

    from rloo_lightning.rollout import Episodes, Rollout

    ids = torch.tensor([[5, 6], [7, 8]])
    common = dict(k=2, prompt_ids=ids, prompt_mask=torch.ones(2, 2), completion_ids=ids,
                  completion_mask=torch.ones(2, 2), truncated=torch.tensor([False, True]), prompts=["p", "p"],
                  completions=["a", "b"], baseline_rewards=torch.tensor([0.5, 1.0]))
    episodes = Episodes(context_mask=torch.ones(2, 2), final_turn_ids=[[6], [8]], rewards=torch.tensor([1.0, 0.0]),
                        turns=torch.tensor([1, 2]), metrics={}, cut_by=["none", "max_turns"])
    rollout = Rollout.from_state(dataclasses.asdict(Rollout(**common, episodes=episodes)))
    assert isinstance(rollout.episodes, Episodes) and rollout.baseline_rewards.tolist() == [0.5, 1.0]
    assert rollout.episodes.cut_by == ["none", "max_turns"] and torch.equal(rollout.episodes.turns, episodes.turns)
    assert rollout.episodes.rewards.tolist() == [1.0, 0.0] and rollout.completion_token_lists() == [[6], [8]]
    single = Rollout.from_state(dataclasses.asdict(Rollout(**common)))
    assert single.episodes is None and single.missing_eos.tolist() == [False, True]
