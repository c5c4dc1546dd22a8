"""``RewardSet`` (``rloo_lightning.rewards``): specs and weights, what a function is passed, protocol errors
(wrong counts, NaN, text, any real number type), exceptions and ``on_error``, the signature checked against the
data's columns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reward_helpers
from reward_helpers import assert_close, batch
from rloo_lightning.rewards import RewardError, RewardSet, RewardWarning, resolve_reward, to_floats
from rloo_lightning.rewards.builtin import ExactAnswer

NAN = float("nan")


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
