"""Environments that misbehave: what they return is checked, every call is guarded and timed, failures are counted in
one line per step, episodes carry why they were cut, and oversized replies are cut. A policy under RL finds every
crack, so none of this may stop a run unannounced."""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings

import pytest
import torch
from test_environments_episodes import _prompts, _scripted_generate, _tokenizer
from test_module_multiturn import GUESS, _guess_batch, _module

from rloo_lightning import RLOOModule
from rloo_lightning.environments import EnvironmentConfigError, EnvStep, Environment, Message
from rloo_lightning.environments.calls import EnvCalls, EpisodeError
from rloo_lightning.environments.episodes import LiveEpisode, run_episodes
from rloo_lightning.environments.sampler import EpisodeWarning
from rloo_lightning.environments.turns import TurnFormat
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

HERE = "test_environments_hostile"


class Returns(Environment):
    """Its step returns ``answer`` at turn ``at`` (else a user reply 'a'), and ends after ``turns`` turns."""

    calls: list = []

    def __init__(self, answer=None, at=0, turns=2, final=0.0, metrics=None, fail_reset=False):
        self.answer, self.at, self.turns, self.final = answer, at, turns, final
        self.metric_values, self.fail_reset = metrics, fail_reset

    metric_names = ("m",)

    def reset(self, row, seed):
        Returns.calls.append(("reset", row["sample_index"]))
        if self.fail_reset and row["sample_index"] == 0:
            raise ConnectionError("the sandbox did not start")

    def step(self, turn):
        Returns.calls.append(("step", turn.index))
        if turn.index == self.at and self.answer != "default":
            return self.answer
        if turn.index + 1 >= self.turns:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(observation=Message("user", "a"))

    def final_reward(self, truncated):
        Returns.calls.append(("final_reward", truncated))
        return self.final

    def metrics(self):
        Returns.calls.append(("metrics",))
        return {"m": 1.0} if self.metric_values is None else self.metric_values

    def close(self):
        Returns.calls.append(("close",))


def _play(env, turns_text=(("a<e>",), ("b<e>",), ("c<e>",)), max_turns=3, max_new_tokens=8, **kwargs):
    tok = _tokenizer()
    prompt_ids, prompt_mask = _prompts(tok, ["ab="])
    episode = LiveEpisode(env)
    run_episodes(_scripted_generate(tok, [list(t) for t in turns_text], []), tok, prompt_ids, prompt_mask, [episode],
                 TurnFormat.from_tokenizer(tok), [tok.convert_tokens_to_ids("<e>")], max_new_tokens, max_turns, None,
                 ["data.jsonl row 3, sample 1"], **kwargs)
    return episode


# -- 5. what an environment returns is checked ---------------------------------------------------------------------
@pytest.mark.parametrize("answer,message", [
    (EnvStep(observation="no, try again"), r"returned an observation of type str .*; it must be a Message"),
    (EnvStep(observation=Message("user", 42)), r"returned a message whose content is int"),
    (EnvStep(observation=Message("<|im_end|>", "x")), r"returned a message with role '<\|im_end\|>'"),
    (EnvStep(reward="1.0"), r"returned a reward of type str"),
    (EnvStep(reward=None), r"returned a reward of type NoneType"),
    (EnvStep(reward=math.nan), r"returned the reward nan .*; a reward must be finite"),
    (EnvStep(done="yes"), r"returned done='yes'"),
])
def test_a_malformed_step_names_the_environment_the_row_the_sample_and_the_turn(answer, message):
    with pytest.raises(EpisodeError, match=r"environment Returns.step " + message) as err:
        _play(Returns(answer, at=1))
    assert "on data.jsonl row 3, sample 1, turn 1" in str(err.value)
    scored = []
    episode = _play(Returns(answer, at=1), on_error=lambda ep, i, e: scored.append(e))
    assert episode.failed and episode.done and len(scored) == 1 and scored[0].how == "malformed"


def _tiny(max_position_embeddings=64):
    tok = build_char_tokenizer("ab?=-|", model_max_length=max_position_embeddings)
    return tok, build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                                 max_position_embeddings=max_position_embeddings, seed=3)


def _returns(tok_model, on_error="none", k=2, **init_args):
    tok, model = tok_model
    return _module(model, tok, {"class_path": f"{HERE}.Returns", "init_args": init_args, "max_turns": 3,
                                "reply_format": "|{content}=", "on_error": on_error},
                   sampling={"k": k, "max_new_tokens": 6, "eos_token_ids": [2, 8, 9]})


def test_every_call_is_guarded_and_on_error_applies_to_all(caplog):
    model = _tiny()
    # reset raises on sample 0: its episode is scored by on_error and never stepped, scored or measured
    Returns.calls = []
    m = _returns(model, on_error=-2.0, fail_reset=True, answer="default")
    with pytest.warns(EpisodeWarning, match=r"3 of 6 episodes failed \(reset raised: 3\); the first: environment "
                                            r"Returns.reset failed on prompt row \d+ .*sample 0, at reset: "
                                            r"ConnectionError: the sandbox did not start"):
        rollout = m.sample(_guess_batch(tok := model[0]), 2, seed=0)
    assert rollout.episodes.rewards.tolist()[::2] == [-2.0] * 3 and rollout.episodes.turns.tolist()[::2] == [0] * 3
    assert sum(c[0] == "metrics" for c in Returns.calls) == 3  # the three that did not fail
    assert torch.isnan(rollout.episodes.metrics["m"][::2]).all() and (rollout.episodes.metrics["m"][1::2] == 1).all()
    assert sum(c[0] == "close" for c in Returns.calls) == 6  # every episode is closed
    # final_reward NaN, metrics of the wrong kind: errors under on_error, never silent
    for init_args, pattern in [({"final": math.nan}, r"Returns.final_reward returned nan on .*after turn 1; a reward "
                                                     r"must be finite"),
                               ({"final": "1"}, r"Returns.final_reward returned str"),
                               ({"metrics": {"m": "high"}}, r"Returns.metrics returned m='high'"),
                               ({"metrics": [1.0]}, r"Returns.metrics returned list")]:
        m = _returns(model, on_error="none", answer="default", **init_args)
        with pytest.warns(EpisodeWarning, match=pattern):
            rollout = m.sample(_guess_batch(tok), 2, seed=0)
        assert torch.isnan(rollout.episodes.rewards).all()
        with pytest.raises(EpisodeError, match=pattern):
            _returns(model, on_error="raise", answer="default", **init_args).sample(_guess_batch(tok), 2, seed=0)


def test_one_warning_line_per_step_and_every_failure_in_the_log(caplog):
    tok, model = _tiny()
    m = _returns((tok, model), on_error="none", k=4, answer=EnvStep(reward=math.nan), at=0)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING, logger="rloo_lightning"):
        warnings.simplefilter("always")
        rollout = m.sample(_guess_batch(tok), 4, seed=0)
    lines = [w for w in seen if issubclass(w.category, EpisodeWarning)]
    assert len(lines) == 1 and "12 of 12 episodes failed (step malformed: 12)" in str(lines[0].message)
    records = [r for r in caplog.records if r.name.startswith("rloo_lightning") and "Returns.step" in r.getMessage()]
    assert len(records) == 12 and {r.getMessage().split(", turn")[0][-8:] for r in records} == {
        f"sample {j}" for j in range(4)}
    assert torch.isnan(rollout.episodes.rewards).all()


# -- 3. truncation defined once: cut_by ----------------------------------------------------------------------------
def test_a_turn_cut_by_max_new_tokens_is_flagged_even_when_the_environment_ends_the_episode_on_it():
    episode = _play(Returns("default", turns=1), turns_text=[["abcdefgh"]], max_new_tokens=8)
    assert episode.cut_by == "max_new_tokens" and episode.truncated and episode.done


def test_an_episode_cut_by_max_turns_has_its_end_tokens_and_no_missing_eos_penalty():
    from rloo_lightning.metrics import train_metric_sums

    tok, model = _tiny()
    m = _module(model, tok, {"class_path": f"{HERE}.Returns", "init_args": {"answer": "default", "turns": 9},
                             "max_turns": 2, "reply_format": "|{content}="},
                sampling={"k": 2, "max_new_tokens": 6, "eos_token_ids": list(range(2, 10))},
                shaping={"missing_eos_penalty": 1.0})
    rollout = m.sample(_guess_batch(tok), 2, seed=0)
    rollout.scores, rollout.rewards = m.score(rollout)
    cut = [c for c in rollout.episodes.cut_by]
    assert set(cut) <= {"max_turns", "max_new_tokens"} and "max_turns" in cut
    by_turns = torch.tensor([c == "max_turns" for c in cut])
    assert rollout.truncated.all() and not rollout.missing_eos[by_turns].any()
    unshaped = rollout.scores["environment"]
    assert torch.equal(rollout.rewards[by_turns], unshaped[by_turns])  # no penalty for an episode with its EOS
    assert torch.equal(rollout.rewards[~by_turns], unshaped[~by_turns] - 1.0)
    loss, entropy = m.rollout_loss(rollout)
    sums = train_metric_sums(rollout, entropy, loss)
    mean = {name: float(s) / float(n) for name, (s, n) in sums.items()}
    assert mean["train/cut/max_turns"] == by_turns.float().mean().item()
    assert mean["train/clipped_ratio"] == mean["train/cut/max_new_tokens"] == 1 - by_turns.float().mean().item()
    assert mean["train/cut/context"] == 0.0 and mean["train/truncated_episodes"] == 1.0


def test_mask_truncated_completions_drops_every_cut_episode():
    tok, model = _tiny()
    m = _module(model, tok, {"class_path": f"{HERE}.Returns", "init_args": {"answer": "default", "turns": 2},
                             "max_turns": 2, "reply_format": "|{content}="},
                sampling={"k": 4, "max_new_tokens": 3, "eos_token_ids": [2, 8]},
                shaping={"mask_truncated_completions": True})
    rollout = m.sample(_guess_batch(tok), 4, seed=1)
    rollout.scores, rollout.rewards = m.score(rollout)
    m.rollout_loss(rollout)
    cut = torch.tensor([c != "none" for c in rollout.episodes.cut_by])
    assert cut.any() and (~cut).any()
    assert torch.equal(rollout.keep, ~cut) and (rollout.advantages[cut] == 0).all()


# -- 6. timeouts and concurrency -----------------------------------------------------------------------------------
def test_sixteen_hanging_calls_all_start_before_the_first_one_times_out():
    release, started = threading.Event(), []

    def hang():
        started.append(time.monotonic())
        release.wait(60)

    calls = EnvCalls(timeout=2.0, workers=16)
    begin = time.monotonic()
    try:
        results = calls.run([hang] * 16)
    finally:
        release.set()
    assert [status for status, _ in results] == ["timeout"] * 16 and calls.abandoned == 16
    assert len(started) == 16 and max(started) < begin + 2.0  # each started before any deadline
    assert time.monotonic() - begin < 10  # together: one timeout, not sixteen


def test_a_call_past_the_timeout_is_abandoned_and_its_environment_never_called_again():
    release = threading.Event()

    class Hangs(Returns):
        def step(self, turn):
            Returns.calls.append(("step", turn.index))
            release.wait(30)
            return EnvStep(done=True)

    Returns.calls = []
    scored = []
    try:
        episode = _play(Hangs(), calls=EnvCalls(timeout=0.3), on_error=lambda ep, i, e: scored.append(e))
    finally:
        release.set()
    assert episode.failed and episode.abandoned and scored[0].how == "timed out"
    assert "environment Hangs.step did not return within 0.3 s on data.jsonl row 3, sample 1, turn 0" in str(scored[0])
    assert Returns.calls == [("step", 0)]


class HangsOnStep(Environment):
    """A service that stopped answering: every step waits until the test releases it."""

    release = threading.Event()

    def step(self, turn):
        HangsOnStep.release.wait(60)
        return EnvStep(done=True)


TIMEOUT = 0.5  # environment.timeout of the hanging runs: 16 calls one after another would take 8 s


def _hanging(on_error, calls=None):
    """A module whose 16 episodes (4 prompts x k=4) hang at their first step, with workers: 1."""
    tok, model = _tiny()
    m = _module(model, tok, {"class_path": f"{HERE}.HangsOnStep", "max_turns": 2, "reply_format": "|{content}=",
                             "timeout": TIMEOUT, "workers": 1, "on_error": on_error})
    if calls is not None:
        m.episodes.calls = calls
    return m, _guess_batch(tok, ("abab", "bbaa", "aaab", "baba"))


def _timed_sample(m, batch):
    begin = time.monotonic()
    try:
        return m.sample(batch, 4, seed=0)
    finally:
        _timed_sample.seconds = time.monotonic() - begin


@pytest.fixture
def hang():
    HangsOnStep.release = threading.Event()
    yield
    HangsOnStep.release.set()  # the abandoned calls return and their threads end


def test_with_on_error_raise_the_first_timeout_ends_the_step_at_once(hang):
    m, batch = _hanging("raise")
    with pytest.raises(EpisodeError, match=rf"environment HangsOnStep.step did not return within {TIMEOUT} s .*"
                                           r"sample \d, turn 0 \(environment.timeout\)"):
        _timed_sample(m, batch)
    # one timeout (and a tiny model's turn), not sixteen in a row; a wide margin for a loaded machine
    assert _timed_sample.seconds < 16 * TIMEOUT / 2
    assert m.episodes.calls.hung == 1  # only the call that timed out runs on; the others never started


def test_hanging_calls_cost_a_rollout_about_two_timeouts_however_many_hang(hang):
    m, batch = _hanging(-1.0)
    with pytest.warns(EpisodeWarning, match=r"16 of 16 episodes failed \(step not started: 14, step timed out: 2\); "
                                            r"the first: environment HangsOnStep.step did not return within"):
        rollout = _timed_sample(m, batch)
    assert rollout.episodes.rewards.tolist() == [-1.0] * 16  # every hung episode scored by on_error
    # The first call times out after one timeout; the second runs in the rollout's one more timeout and is cut at
    # its end; the other fourteen are failed without starting. 2 timeouts, where one after another took 16.
    assert _timed_sample.seconds < 16 * TIMEOUT / 2
    assert m.episodes.calls.hung == 2


def test_the_threads_of_abandoned_calls_are_bounded_and_a_call_past_the_bound_is_not_started(hang, caplog):
    m, batch = _hanging("none", calls=EnvCalls(TIMEOUT, 1, max_hung=3))
    with pytest.warns(EpisodeWarning, match=r"step timed out: 2"):
        _timed_sample(m, batch)  # two calls abandoned, their threads still running
    threads = {t for t in threading.enumerate() if t.name == "rloo-env-call"}
    with pytest.warns(EpisodeWarning, match=r"16 of 16 episodes failed \(step not started: 15, step timed out: 1\)"), \
            caplog.at_level(logging.WARNING, logger="rloo_lightning"):
        rollout = _timed_sample(m, batch)
    assert torch.isnan(rollout.episodes.rewards).all() and _timed_sample.seconds < 16 * TIMEOUT / 2
    assert m.episodes.calls.hung == 3  # the bound: the third hung call, then no more start
    assert len({t for t in threading.enumerate() if t.name == "rloo-env-call"} - threads) == 1  # its replacement
    assert any("HangsOnStep.step was not started" in r.getMessage() and "3 abandoned environment calls are still "
               "running" in r.getMessage() for r in caplog.records)
    HangsOnStep.release.set()
    deadline = time.monotonic() + 30
    while m.episodes.calls.hung and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.episodes.calls.hung == 0  # a call that returns ends its thread and frees its place


class Slow(Environment):
    """Replies with letters drawn from the episode's seed after a short sleep: concurrency shows in the time only."""

    def reset(self, row, seed):
        import random

        self.rng = random.Random(seed)

    def step(self, turn):
        time.sleep(0.01)
        if turn.index >= 2:
            return EnvStep(reward=self.rng.random(), done=True)
        return EnvStep(observation=Message("user", self.rng.choice("ab") * 2), reward=self.rng.random())


def test_concurrent_calls_give_transcripts_bit_identical_to_a_serial_run():
    tok, model = _tiny()
    runs = []
    for timeout, workers in [(None, 1), (30.0, 1), (30.0, 8)]:
        m = _module(model, tok, {"class_path": f"{HERE}.Slow", "max_turns": 3, "reply_format": "|{content}=",
                                 "timeout": timeout, "workers": workers})
        runs.append(m.sample(_guess_batch(tok), 4, seed=7))
    for other in runs[1:]:
        assert torch.equal(runs[0].completion_ids, other.completion_ids)
        assert torch.equal(runs[0].episodes.rewards, other.episodes.rewards)
        assert runs[0].columns["transcript"] == other.columns["transcript"]


# -- 7. sizes: the context budget and the replies --------------------------------------------------------------------
class Floods(Environment):
    def step(self, turn):
        if turn.index:
            return EnvStep(done=True)
        return EnvStep(observation=Message("user", "ab" * 50_000))


def test_the_context_budget_defaults_to_the_models_context_and_a_huge_reply_is_cut():
    tok, model = _tiny(max_position_embeddings=40)
    m = _module(model, tok, {"class_path": f"{HERE}.Floods", "max_turns": 2, "reply_format": "|{content}=",
                             "max_reply_tokens": 8}, sampling={"k": 2, "max_new_tokens": 6, "eos_token_ids": [2, 8, 9]})
    rollout = m.sample(_guess_batch(tok), 2, seed=0)
    replies = [t[1]["content"] for t in rollout.columns["transcript"] if len(t) > 1]
    assert replies and all(r == "abababab" for r in replies)
    assert rollout.episodes.metrics["replies_cut"].max() == 1
    assert rollout.prompt_mask.sum(1).max() + rollout.episodes.context_mask.sum(1).max() <= 40
    # with a budget under the second turn, every episode that got past its first is cut by the model's context
    small = _module(*reversed(_tiny(max_position_embeddings=16)), {
        "class_path": f"{HERE}.Floods", "max_turns": 2, "reply_format": "|{content}=", "max_reply_tokens": 8},
        sampling={"k": 2, "max_new_tokens": 6, "eos_token_ids": [2, 8, 9]})
    cut = small.sample(_guess_batch(tok), 2, seed=0)
    assert "context" in cut.episodes.cut_by and cut.episodes.turns.max() == 1


# -- 8. checked early -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("environment,message", [
    ({"class_path": "no_such_module.Env"}, r"environment.class_path 'no_such_module.Env' cannot be imported"),
    ({"class_path": GUESS, "init_args": {"guesess": 2}}, r"environment.init_args .* do not fit GuessEnvironment"),
    ({"class_path": f"{HERE}.Returns", "init_args": {}, "timeout": 0}, r"environment.timeout must be"),
    ({"class_path": f"{HERE}.Returns", "workers": 0}, r"environment.workers must be"),
    ({"class_path": f"{HERE}.Returns", "max_reply_tokens": 0}, r"environment.max_reply_tokens must be"),
])
def test_a_wrong_environment_fails_at_construction_as_its_own_kind(environment, message):
    from rloo_lightning.rewards.protocol import RewardError

    with pytest.raises(ValueError, match=message) as err:
        RLOOModule("x", rewards={}, environment=environment)
    assert not isinstance(err.value, RewardError)
    if "init_args" in message or "imported" in message:
        assert isinstance(err.value, EnvironmentConfigError)


CALC = "rloo_lightning.environments.tools.calculator"
TOOLS = "rloo_lightning.environments.tools.ToolEnvironment"


def test_a_tool_that_cannot_be_imported_fails_at_construction_as_an_environment_error():
    from rloo_lightning.rewards.protocol import RewardError

    for init_args, message in [({"tools": [CALC, "no_such_module.tool"]}, r"environment.init_args: tool "
                                r"'no_such_module.tool' cannot be imported"),
                               ({"tools": [CALC], "timeout": 0}, r"environment.init_args: timeout must be > 0"),
                               ({"tools": [CALC], "max_calls": "3"}, r"max_calls must be an integer"),
                               ({"tools": [CALC], "retries": 3}, r"do not fit ToolEnvironment")]:
        with pytest.raises(EnvironmentConfigError, match=message) as err:
            RLOOModule("x", rewards={}, environment={"class_path": TOOLS, "init_args": init_args})
        assert not isinstance(err.value, RewardError)


def test_data_tools_that_differ_from_the_environments_tools_are_refused_before_the_model_loads():
    from types import SimpleNamespace

    from rloo_lightning.data import PromptDataModule

    m = RLOOModule("x", rewards={}, environment={"class_path": TOOLS, "init_args": {"tools": [CALC]}})
    trainer = lambda dm: SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")),  # noqa: E731
                                         datamodule=dm)
    other = PromptDataModule(task="arithmetic", tools=["tool_helpers.total"])
    m._trainer = trainer(other)
    with pytest.raises(EnvironmentConfigError, match=r"data.tools \['tool_helpers.total'\] differs from "
                                                     r"environment.init_args.tools \['rloo_lightning.environments"):
        m.setup("fit")
    for same in (PromptDataModule(task="arithmetic", tools=[CALC]), PromptDataModule(task="arithmetic")):
        m._trainer = trainer(same)
        m.setup("fit")  # the same tools, or none shown: accepted


@pytest.mark.slow
def test_tool_calls_of_concurrent_episodes_share_the_worker_safely():
    """environment.workers = 4 with a tool worker process: the calls queue for the one worker; transcripts are
    those of a serial run."""
    from test_environments_tools import _call, _tool_module

    turns = [_call("calculator", expression="6*7"), _call("calculator", expression="2**10"), "42"]
    runs = []
    for workers in (1, 4):
        m, tok, batch = _tool_module(turns)
        m.episodes.args = type(m.episodes.args)(**{**m.episodes.args.__dict__, "workers": workers,
                                                   "init_args": {"tools": [CALC], "timeout": 10.0}})
        m.episodes.calls = EnvCalls(60.0, workers)
        runs.append(m.sample(batch, 4, seed=0))
    assert runs[0].columns["transcript"] == runs[1].columns["transcript"]
    assert [t[1]["content"] for t in runs[1].columns["transcript"]] == ["42"] * 4
    assert (runs[1].episodes.metrics["tool_calls"] == 2).all() and (runs[1].episodes.metrics["tool_errors"] == 0).all()
