"""Rewards: specs, protocol errors, built-ins, shaping, timeouts and workers, the reward model."""

from __future__ import annotations

import os
import pickle
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

# Workers rebuild test reward functions from "reward_helpers.<name>": they inherit sys.path, so
# tests/ must be on it before the first worker starts (pytest's importlib mode does not add it).
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import reward_helpers  # noqa: E402

from rloo_lightning.rewards import (  # noqa: E402
    RewardError,
    RewardSet,
    RewardTimeoutError,
    RewardWarning,
    resolve_reward,
    to_floats,
)
from rloo_lightning.rewards.builtin import ExactAnswer, LengthPenalty, RegexMatch, parse_number  # noqa: E402
from rloo_lightning.rewards.model import RewardModel  # noqa: E402
from rloo_lightning.algo.shaping import clip_rewards, missing_eos_penalty, overlong_penalty  # noqa: E402

NAN = float("nan")


def batch(completions, prompts=None, **columns):
    """Arguments of RewardSet.score for these completions."""
    prompts = prompts or [f"p{i}" for i in range(len(completions))]
    ids = [[3] * len(c) for c in completions]
    return prompts, list(completions), ids, columns


def assert_close(actual, expected):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.tensor(expected, dtype=torch.float32), equal_nan=True)


# -- specs, weights, None ----------------------------------------------------------------------
def test_import_path_class_spec_and_weights():
    rs = RewardSet.from_specs(
        [
            "reward_helpers.length_reward",
            {"class_path": "reward_helpers.Scaled", "init_args": {"factor": 2.0}},
            {"class_path": "rloo_lightning.rewards.builtin.ExactAnswer", "init_args": {"column": "answer"},
             "name": "accuracy"},
        ],
        [1.0, 0.5, 3.0],
    )
    assert rs.names == ["length_reward", "Scaled", "accuracy"]
    total, per = rs.score(*batch(["x 4", "12345"], answer=["4", "5"]))
    assert_close(per["length_reward"], [3, 5])
    assert_close(per["Scaled"], [6, 10])
    assert_close(per["accuracy"], [1, 0])
    assert_close(total, [3 + 3 + 3, 5 + 5 + 0])


def test_callables_and_same_names_logged_apart():
    rs = RewardSet.from_specs([reward_helpers.Scaled(1.0), reward_helpers.Scaled(-1.0)])
    assert rs.names == ["Scaled_0", "Scaled_1"]
    total, _ = rs.score(*batch(["ab"]))
    assert_close(total, [0.0])
    # resolve_reward keeps its (name, callable) contract.
    name, fn = resolve_reward("reward_helpers.length_reward")
    assert name == "length_reward" and fn is reward_helpers.length_reward


def test_none_is_nan_in_per_func_and_total():
    rs = RewardSet.from_specs(["reward_helpers.none_for_empty", "reward_helpers.length_reward"])
    total, per = rs.score(*batch(["", "abc"]))
    assert_close(per["none_for_empty"], [NAN, 1.0])
    assert_close(per["length_reward"], [0.0, 3.0])
    assert_close(total, [NAN, 4.0])


def test_signature_decides_what_is_passed():
    rs = RewardSet.from_specs(["reward_helpers.answer_match", "reward_helpers.trl_style"])
    # answer_match has no **kwargs: only "answer" is passed, "id" is not.
    _, per = rs.score(*batch(["a", "b"], answer=["a", "c"], id=[1, 2]))
    assert_close(per["answer_match"], [1.0, 0.0])
    assert_close(per["trl_style"], [2.0, 2.0])  # called with keywords, TRL's convention


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, message",
    [
        ("reward_helpers.does_not_exist", r"'reward_helpers\.does_not_exist' cannot be imported"),
        ("no_such_package.reward", r"'no_such_package\.reward' cannot be imported"),
        ("justaname", r"expected an import path"),
        ("reward_helpers.NOT_CALLABLE", r"'reward_helpers\.NOT_CALLABLE' is not callable"),
        ("reward_helpers.NeedsArgs", r"NeedsArgs.*init_args"),
        ({"class_path": "reward_helpers.Scaled", "init_arg": {}}, r"unknown: \['init_arg'\]"),
        ({"class_path": "reward_helpers.Scaled", "init_args": {"factr": 1}}, r"Scaled.*factr"),
        (42, r"expected a callable"),
        ("reward_helpers.two_args", r"'two_args'.*\(prompts, completions, completion_ids, \*\*columns\)"),
    ],
)
def test_bad_specs_fail_at_construction(spec, message):
    with pytest.raises(ValueError, match=message):
        RewardSet.from_specs([spec])


@pytest.mark.parametrize(
    "spec, meant",
    [
        ("ExactAnswer", "rloo_lightning.rewards.builtin.ExactAnswer"),  # a built-in's bare name
        ("exact_answer", "rloo_lightning.rewards.builtin.ExactAnswer"),
        ("rloo_lightning.rewards.ExactAnswer", "rloo_lightning.rewards.builtin.ExactAnswer"),  # the wrong module
        ("rewards.RegexMatch", "rloo_lightning.rewards.builtin.RegexMatch"),  # no such module
        ({"class_path": "rloo_lightning.rewards.builtin.LengthPenalt"}, "rloo_lightning.rewards.builtin.LengthPenalty"),
        ("reward_helpers.answer_matsh", "reward_helpers.answer_match"),  # a name in the user's module
        ("rloo_lightning.tasks.revrse.reward", "rloo_lightning.tasks.reverse.reward"),  # a package's submodule
    ],
)
def test_an_unknown_reward_function_names_the_closest_one(spec, meant):
    from rloo_lightning.cli_errors import error_line

    with pytest.raises(ValueError) as err:
        RewardSet.from_specs([spec])
    line = error_line(err.value)
    assert line.startswith("error: RewardError: reward function ") and line.endswith(f"; did you mean {meant!r}?"), line


def test_an_unknown_reward_function_with_nothing_close_suggests_nothing():
    with pytest.raises(ValueError) as err:
        RewardSet.from_specs(["reward_helpers.zzzzqqq"])
    assert "did you mean" not in str(err.value)


def test_bad_set_options():
    with pytest.raises(ValueError, match="empty"):
        RewardSet.from_specs([])
    with pytest.raises(ValueError, match="2 values for 1"):
        RewardSet.from_specs(["reward_helpers.length_reward"], [1.0, 2.0])
    with pytest.raises(ValueError, match="on_error"):
        RewardSet.from_specs(["reward_helpers.length_reward"], on_error="maybe")
    with pytest.raises(ValueError, match="timeout"):
        RewardSet.from_specs(["reward_helpers.length_reward"], timeout=0)


def test_missing_column_fails_before_any_function_runs():
    calls = []

    class Counting:
        def __call__(self, prompts, completions, completion_ids, **columns):
            calls.append(1)
            return [0.0] * len(completions)

    rs = RewardSet.from_specs([Counting(), "reward_helpers.needs_solution"])
    with pytest.raises(ValueError, match=r"'needs_solution'.*requires \['solution'\].*columns: \['answer'\]"):
        rs.score(*batch(["a"], answer=["a"]))
    assert calls == []
    rs = RewardSet.from_specs([Counting(), ExactAnswer(column="gold")])
    with pytest.raises(ValueError, match=r"'ExactAnswer' reads column\(s\) \['gold'\].*\['answer'\]"):
        rs.score(*batch(["a"], answer=["a"]))
    assert calls == []


@pytest.mark.parametrize(
    "spec, message",
    [
        ("reward_helpers.wrong_count", r"'wrong_count' returned 1 values for 2 completions.*'first'"),
        ("reward_helpers.returns_nan", r"'returns_nan' returned nan for completion 1 of prompt 'second'.*return None"),
        ("reward_helpers.returns_text", r"'returns_text' returned 'high' \(str\).*a number.*or None"),
        ("reward_helpers.numeric_text", r"'numeric_text' returned '0.5' \(str\) for completion 0.*a number"),
    ],
)
def test_bad_values(spec, message):
    rs = RewardSet.from_specs([spec])
    with pytest.raises(ValueError, match=message):
        rs.score(*batch(["ok", "bad"], prompts=["first", "second"]))


def test_exception_names_function_and_prompt():
    rs = RewardSet.from_specs(["reward_helpers.raises"])
    with pytest.raises(RewardError, match=r"'raises' raised on prompt 'first'.*KeyError") as info:
        rs.score(*batch(["boom", "x"], prompts=["first", "second"]))
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("on_error, value", [("none", NAN), (-1.0, -1.0), ("0.25", 0.25)])
def test_on_error_scores_instead_of_raising(on_error, value):
    rs = RewardSet.from_specs(["reward_helpers.raises"], on_error=on_error)
    with pytest.warns(RewardWarning, match=r"'raises' raised on prompt 'first'.*scored as"):
        total, _ = rs.score(*batch(["boom", "x"], prompts=["first", "second"]))
    assert_close(total, [value, value])
    # Protocol errors are bugs: they raise whatever on_error says.
    rs = RewardSet.from_specs(["reward_helpers.returns_nan"], on_error=on_error)
    with pytest.raises(ValueError, match="return None"):
        rs.score(*batch(["bad"]))


# -- built-ins ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [
        ("1,000", 1000), ("1000", 1000), ("3.0", 3), ("-2", -2), ("1/2", 0.5), ("\\frac{1}{2}", 0.5),
        ("-\\dfrac{3}{4}", -0.75), ("$5", 5), ("42.", 42), (".5", 0.5), ("2.5e3", 2500), (7, 7), (0.1, 0.1),
        ("12,34", None), ("x", None), ("1/0", None), (None, None), (True, None),
    ],
)
def test_parse_number(text, value):
    got = parse_number(text)
    if value is None:
        assert got is None
    else:
        assert got == parse_number(str(value)) and float(got) == pytest.approx(value)


def test_exact_answer_last_number():
    fn = ExactAnswer()
    completions = ["so the total is 1,000.", "3.0", "I get -2", "half: 1/2", "7 then 8", "no idea", "1000", "5"]
    answers = ["1000", 3, "-2", 0.5, "7", "4", None, "#### 5"]
    assert fn(["p"] * 8, completions, [[]] * 8, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, None, 1.0]


def test_exact_answer_boxed_and_regex():
    fn = ExactAnswer(extract="boxed")
    completions = ["so \\boxed{\\frac{1}{2}}", "\\boxed{x^{2}+1}", "\\boxed{3} no, \\boxed{4}", "4", "\\boxed{ 12 }"]
    answers = ["0.5", "x^{2} + 1", "4", "4", 12]
    assert fn(["p"] * 5, completions, [[]] * 5, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0]
    fn = ExactAnswer(column="gold", extract="regex", pattern=r"ANSWER:\s*(\w+)")
    assert fn(["p"] * 3, ["ANSWER: paris", "ANSWER: rome ANSWER: oslo", "paris"], [[]] * 3,
              gold=["paris", "oslo", "paris"]) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="pattern"):
        ExactAnswer(extract="regex")
    with pytest.raises(ValueError, match="extract"):
        ExactAnswer(extract="first_number")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        ExactAnswer(extract="regex", pattern="(")


def test_regex_match_and_length_penalty():
    think = RegexMatch(r"<think>.*</think>\s*<answer>.*</answer>", full_match=True)
    completions = ["<think>a\nb</think> <answer>1</answer>", "x <think>a</think><answer>1</answer>"]
    assert think(["p", "p"], completions, [[], []]) == [1.0, 0.0]
    assert RegexMatch(r"<answer>")(["p", "p"], completions, [[], []]) == [1.0, 1.0]
    penalty = LengthPenalty(target_tokens=3, coef=0.5)
    assert penalty(["p"] * 3, ["", "", ""], [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5, 6]]) == [0.0, 0.0, -1.5]
    with pytest.raises(ValueError, match="coef"):
        LengthPenalty(coef=-1)


def test_builtins_from_yaml_specs():
    rs = RewardSet.from_specs(
        [{"class_path": "rloo_lightning.rewards.builtin.RegexMatch", "init_args": {"pattern": "^a"}},
         {"class_path": "rloo_lightning.rewards.builtin.LengthPenalty", "init_args": {"coef": 0.1}}],
    )
    total, per = rs.score(*batch(["ab", "ba"]))
    assert_close(per["RegexMatch"], [1.0, 0.0])
    assert_close(total, [1.0 - 0.2, -0.2])


# -- shaping -----------------------------------------------------------------------------------
def test_missing_eos_penalty():
    rewards = torch.tensor([1.0, 0.5, NAN, -1.0])
    truncated = torch.tensor([False, True, True, True])
    assert_close(missing_eos_penalty(rewards, truncated, 1.0), [1.0, -0.5, NAN, -2.0])
    with pytest.raises(ValueError, match="shape"):
        missing_eos_penalty(rewards, truncated[:2], 1.0)


def test_overlong_penalty_dapo():
    # L_max = 10, L_cache = 4: free up to 6, then (6 - L) / 4, -1 beyond 10.
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    assert_close(overlong_penalty(lengths, max_len=10, buffer=4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert_close(overlong_penalty(lengths.float(), 10, 4, factor=0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=10, buffer=11)


def test_clip_rewards():
    assert_close(clip_rewards(torch.tensor([-20.0, 0.5, NAN, 20.0]), -10, 10), [-10.0, 0.5, NAN, 10.0])
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(torch.zeros(2), 1, -1)


# -- workers and timeouts ----------------------------------------------------------------------
SPECS = [
    "reward_helpers.length_reward",
    {"class_path": "reward_helpers.Scaled", "init_args": {"factor": -0.5}},
    {"class_path": "rloo_lightning.rewards.builtin.ExactAnswer", "init_args": {"extract": "last_number"}},
    "reward_helpers.answer_match",
]


@pytest.mark.slow  # a pool of worker processes
def test_workers_give_the_serial_result():
    args = batch([f"{i} " * (i % 4) for i in range(10)], answer=[str(i) for i in range(10)])
    serial = RewardSet.from_specs(SPECS, [1.0, 2.0, 3.0, 4.0]).score(*args)
    with RewardSet.from_specs(SPECS + ["reward_helpers.pid"], [1.0, 2.0, 3.0, 4.0, 0.0], num_workers=2) as rs:
        total, per = rs.score(*args)
        pids = set(per.pop("pid").tolist())
        torch.testing.assert_close(total, serial[0])
        for name in serial[1]:
            torch.testing.assert_close(per[name], serial[1][name])
        assert os.getpid() not in pids and pids <= set(rs._pool.pids)
        # The pool lives across calls.
        before = list(rs._pool.pids)
        _, per2 = rs.score(*args)
        assert set(per2["pid"].tolist()) <= set(before) and rs._pool.pids == before
        procs = [w.proc for w in rs._pool._workers]
    assert rs._pool is None and not any(p.is_alive() for p in procs)


@pytest.mark.slow  # worker processes and a 1 s timeout to wait out (5-7 s)
def test_timeout_scores_and_warns_without_waiting():
    rs = RewardSet.from_specs(["reward_helpers.sleepy", "reward_helpers.length_reward"], timeout=1.0,
                              num_workers=2, chunk_size=1, on_error="none")
    try:
        rs.score(*batch(["warm"]))  # starts the workers: start-up is not counted against the timeout
        start = time.monotonic()
        with pytest.warns(RewardWarning, match=r"'sleepy' timed out after 1 s on prompt 'q1'.*None \(missing\)"):
            total, per = rs.score(*batch(["ab", "sleep", "abc"], prompts=["q0", "q1", "q2"]))
        elapsed = time.monotonic() - start
        assert elapsed < 10, elapsed  # about the timeout, not the 60 s sleep
        assert_close(per["sleepy"], [2.0, NAN, 3.0])
        assert_close(per["length_reward"], [2.0, 5.0, 3.0])
        assert_close(total, [4.0, NAN, 6.0])
        # The stuck worker was replaced: the next call is served.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, per = rs.score(*batch(["abcd"]))
        assert_close(per["sleepy"], [4.0])
    finally:
        rs.close()


def test_timeout_in_process_mode_value_and_raise():
    # num_workers=0 with a timeout still runs the functions in one killable worker.
    rs = RewardSet.from_specs(["reward_helpers.sleepy"], timeout=0.5, on_error=-1.0)
    try:
        with pytest.warns(RewardWarning, match="scored as -1.0"):
            total, _ = rs.score(*batch(["sleep", "ab"]))
        assert_close(total, [-1.0, -1.0])  # one chunk for one worker: the whole chunk timed out
    finally:
        rs.close()
    with RewardSet.from_specs(["reward_helpers.sleepy"], timeout=0.5) as rs:
        with pytest.raises(RewardTimeoutError, match=r"'sleepy' timed out after 0.5 s on prompt 'p0'"):
            rs.score(*batch(["sleep"]))


def test_worker_errors_and_deaths():
    with RewardSet.from_specs(["reward_helpers.raises"], num_workers=1) as rs:
        with pytest.raises(RewardError, match=r"(?s)'raises' raised on prompt 'first'.*worker traceback") as info:
            rs.score(*batch(["boom"], prompts=["first"]))
        assert isinstance(info.value.__cause__, KeyError)
    with RewardSet.from_specs(["reward_helpers.crash"], num_workers=1, chunk_size=1, on_error=0.0) as rs:
        with pytest.warns(RewardWarning, match=r"'crash': its worker process died \(exit code 3\) on prompt 'p1'"):
            total, _ = rs.score(*batch(["ok", "crash", "ok"]))
        assert_close(total, [1.0, 0.0, 1.0])


def test_function_that_cannot_be_built_in_a_worker():
    rs = RewardSet.from_specs(["reward_helpers.FailsInWorker"], num_workers=1)
    with pytest.raises(RewardError, match=r"(?s)could not build the reward functions \['FailsInWorker'\].*no verifier"):
        rs.score(*batch(["a"]))
    assert rs._pool.closed
    rs.close()


@pytest.mark.slow  # spawned worker processes (~30 s)
def test_spawn_start_method():
    with RewardSet.from_specs(["reward_helpers.length_reward"], num_workers=1, start_method="spawn") as rs:
        assert rs.score(*batch(["abc"]))[0].tolist() == [3.0]
    with pytest.raises(ValueError, match="fork"):
        RewardSet.from_specs(["reward_helpers.length_reward"], num_workers=1, start_method="fork")


def test_unpicklable_function_with_workers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot be sent to a worker process.*import path"):
        RewardSet.from_specs([lambda prompts, completions, completion_ids, **c: [0.0] * len(completions)],
                             num_workers=1)


def test_reward_set_pickles_without_its_pool():
    rs = RewardSet.from_specs(["reward_helpers.length_reward"])
    clone = pickle.loads(pickle.dumps(rs))
    assert clone._pool is None and clone.names == rs.names


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


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (0.25, 0.25), (True, 1.0), (np.float32(0.25), 0.25), (np.int64(3), 3.0), (np.bool_(True), 1.0),
    (np.array(0.5), 0.5), (torch.tensor(0.5), 0.5), (torch.tensor(2), 2.0), (torch.tensor(False), 0.0),
    (torch.tensor(0.5, dtype=torch.bfloat16), 0.5)])
def test_a_reward_may_be_any_real_number_type(value, expected):
    got = to_floats("f", [value, None], ["p", "q"])
    assert got[0] == expected and type(got[0]) is float and got[1] != got[1]  # None: NaN


@pytest.mark.parametrize("value", ["0.5", b"1", 1j, [0.5], torch.tensor([0.5]), np.array([0.5]), np.array("1"),
                                   torch.tensor(1j), {"reward": 1.0}])
def test_anything_else_is_refused_naming_the_function_and_the_completion(value):
    with pytest.raises(RewardError, match=r"reward function 'f' returned .* for completion 1 \(prompt 'q'\): a reward "
                                          r"is a number"):
        to_floats("f", [1.0, value], ["p", "q"])


def test_a_signature_is_checked_against_the_datas_columns_before_the_model_loads(tiny_model_dir, tmp_path):
    from lightning.pytorch import Trainer

    from rloo_lightning import RLOOModule
    from rloo_lightning.data import PromptDataModule

    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "abc=", "answer": "cba", "solutions": "{i}"}}\n' for i in range(16)))
    module = RLOOModule(tiny_model_dir, rewards={"funcs": ["reward_helpers.needs_solution"]},
                        validation={"at_start": False})
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(path), batch_size=4,
                            cache_dir=str(tmp_path / "cache"))
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(RewardError, match=r"'needs_solution'.*It requires \['solution'\], which is not a dataset "
                                          r"column \(columns: \['answer', 'solutions'\]; did you mean 'solutions'\?\)"
                                          r".*\[data: the training prompts of .*train.jsonl\]"):
        trainer.fit(module, datamodule=data)
    assert module.policy is None  # refused before configure_model loaded anything


def test_before_the_data_is_read_a_wrong_signature_lists_no_columns():
    def keyword_style(completions, solution_text):  # neither (prompts, completions, completion_ids) nor **kwargs
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as err:
        RewardSet.from_specs([keyword_style])
    assert "must accept" in str(err.value) and "columns:" not in str(err.value)
