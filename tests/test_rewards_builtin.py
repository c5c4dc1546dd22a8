"""The built-in reward functions (``rloo_lightning.rewards.builtin``): number parsing, exact answers, regex match,
length penalty, and as YAML specs.
"""

from __future__ import annotations

import pytest

from reward_helpers import assert_close, batch
from rloo_lightning.rewards import RewardSet
from rloo_lightning.rewards.builtin import ExactAnswer, LengthPenalty, RegexMatch, parse_number


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
