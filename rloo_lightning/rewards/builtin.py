"""Built-in rule rewards, configurable from YAML by ``class_path`` / ``init_args``.

    rewards:
      funcs:
        - class_path: rloo_lightning.rewards.builtin.ExactAnswer
          init_args: {column: answer, extract: boxed}
        - class_path: rloo_lightning.rewards.builtin.RegexMatch
          init_args: {pattern: "^<think>.*</think>\\s*<answer>.*</answer>$", full_match: true}
      weights: [1.0, 0.1]

Each follows the protocol of :mod:`rloo_lightning.rewards` and lists the dataset columns it reads
in ``required_columns``, so a missing column is an error before any completion is scored.
Reward shaping that needs the rollout's tensors (missing-EOS and overlong penalties, clipping)
is in :mod:`rloo_lightning.algo.shaping`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Literal

__all__ = ["ExactAnswer", "RegexMatch", "LengthPenalty", "parse_number", "last_boxed"]

# A number as written in an answer: "-12", "1,000", "3.50", ".5", "1/2", "2.5e3".
_NUMBER = re.compile(
    r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|[-+\u2212]?\.\d+"
)
_PLAIN = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)(?:/([-+]?(?:\d+\.?\d*|\.\d+)))?", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def parse_number(value) -> Fraction | None:
    """``value`` as an exact rational, or None when it is not a plain number.

    Accepts ints, floats (by their shortest decimal, so ``0.1`` is 1/10), and strings such as
    ``"1,000"``, ``"-3.0"``, ``"1/2"``, ``"\\frac{1}{2}"``, ``"$5"``, ``"2.5e3"`` and a trailing
    period. ``"1,000" == "1000"`` and ``"3.0" == "3"`` compare equal as rationals.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(repr(value)) if math.isfinite(value) else None
    if isinstance(value, (Fraction, Decimal)):
        return Fraction(value) if not (isinstance(value, Decimal) and not value.is_finite()) else None
    s = str(value).strip().replace("\u2212", "-")
    s = re.sub(r"\\[!,;: ]", "", s)  # LaTeX spacing
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _FRAC.sub(r"\1/\2", s)
    s = s.replace("{", "").replace("}", "").replace(" ", "").rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    m = _PLAIN.fullmatch(s)
    if m is None:
        return None
    try:
        number = Fraction(m.group(1))
        if m.group(2) is not None:
            den = Fraction(m.group(2))
            if den == 0:
                return None
            number /= den
    except (ValueError, ZeroDivisionError):
        return None
    return number


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if absent."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for j in range(start, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:j]
    return None


def _normalise_text(s: str) -> str:
    s = str(s).strip().replace("\\!", "").replace("$", "")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    return re.sub(r"\s+", "", s).rstrip(".")


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or (
        isinstance(value, str) and not value.strip()
    )


class ExactAnswer:
    """1.0 when the completion's final answer equals the reference column, else 0.0.

    Source: the verifiable accuracy rewards of RLVR (Tülu 3, Lambert et al. 2024, Sec. 6: GSM8K
    and MATH answers checked exactly) and DeepSeek-R1 (Guo et al. 2025: "accuracy rewards",
    answer in a box); ``\\boxed{}`` is the MATH convention (Hendrycks et al. 2021).

    The answer is extracted with ``extract``:

    * ``"last_number"``: the last number in the completion (GSM8K style);
    * ``"boxed"``: the content of the last ``\\boxed{...}``;
    * ``"regex"``: the last match of ``pattern`` (its first group if it has one).

    Answers that parse as numbers are compared as exact rationals (``"1,000" == "1000"``,
    ``"3.0" == "3"``, ``"0.5" == "1/2"``, ``"\\frac{1}{2}" == "0.5"``); others as text with the
    whitespace removed. A completion without an answer scores 0.0; a missing reference (None,
    NaN or empty) scores None (no reward). A string reference containing ``"####"`` is read after
    the last ``"####"``, so GSM8K's solution column can be the reference as it is.

    Args:
        column: the dataset column with the reference answer.
        extract: how the completion's answer is found.
        pattern: the regular expression for ``extract="regex"``.
    """

    def __init__(self, column: str = "answer", extract: Literal["last_number", "boxed", "regex"] = "last_number",
                 pattern: str | None = None) -> None:
        if extract not in ("last_number", "boxed", "regex"):
            raise ValueError(f"ExactAnswer: extract must be 'last_number', 'boxed' or 'regex', got {extract!r}")
        if (extract == "regex") != (pattern is not None):
            raise ValueError("ExactAnswer: give `pattern` exactly when extract='regex'")
        try:
            self.regex = re.compile(pattern, re.DOTALL) if pattern is not None else None
        except re.error as err:
            raise ValueError(f"ExactAnswer: pattern {pattern!r} is not a valid regular expression: {err}") from err
        self.column, self.extract, self.pattern = column, extract, pattern
        self.required_columns = (column,)

    def answer(self, completion: str) -> str | None:
        """The answer found in ``completion`` (None if there is none)."""
        if self.extract == "boxed":
            return last_boxed(completion)
        if self.extract == "regex":
            matches = list(self.regex.finditer(completion))
            if not matches:
                return None
            m = matches[-1]
            return m.group(1) if self.regex.groups else m.group(0)
        matches = _NUMBER.findall(completion)
        return matches[-1] if matches else None

    def score(self, completion: str, reference) -> float | None:
        if _missing(reference):
            return None
        if isinstance(reference, str) and "####" in reference:
            reference = reference.rpartition("####")[2]
        found = self.answer(completion)
        if found is None:
            return 0.0
        ref_num, got_num = parse_number(reference), parse_number(found)
        if ref_num is not None and got_num is not None:
            return float(ref_num == got_num)
        return float(_normalise_text(found) == _normalise_text(reference))

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float | None]:
        return [self.score(c, r) for c, r in zip(completions, columns[self.column])]


class RegexMatch:
    """Format reward: 1.0 when the completion matches ``pattern``, else 0.0.

    Source: the "format rewards" of DeepSeek-R1 (Guo et al. 2025, Sec. 2.2.2: reasoning inside
    ``<think>`` tags), as in TRL's ``think_format_reward``.

    Args:
        pattern: a Python regular expression (``.`` matches newlines).
        full_match: the whole completion must match (``re.fullmatch``, no stripping); otherwise a
            match anywhere counts (``re.search``).
    """

    def __init__(self, pattern: str, full_match: bool = False) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ValueError(f"RegexMatch: pattern {pattern!r} is not a valid regular expression: {err}") from err
        self.pattern, self.full_match = pattern, full_match

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float]:
        match = self.regex.fullmatch if self.full_match else self.regex.search
        return [float(match(c) is not None) for c in completions]


class LengthPenalty:
    """``-coef * max(0, n - target_tokens)`` where ``n = len(completion_ids)`` (EOS included).

    A linear penalty on the tokens beyond a free budget, the simplest of the length penalties used
    against the length hacking of RLHF (Singhal et al. 2023, "A Long Way to Go: Investigating
    Length Correlations in RLHF"). Give it a weight of 1 and set the strength with ``coef``.
    For DAPO's soft overlong punishment near the generation limit see
    :func:`rloo_lightning.algo.shaping.overlong_penalty`.

    Args:
        target_tokens: tokens that cost nothing.
        coef: penalty per token beyond ``target_tokens`` (>= 0).
    """

    def __init__(self, target_tokens: int = 0, coef: float = 0.001) -> None:
        if target_tokens < 0:
            raise ValueError(f"LengthPenalty: target_tokens must be >= 0, got {target_tokens}")
        if not (math.isfinite(coef) and coef >= 0):
            raise ValueError(f"LengthPenalty: coef must be a finite number >= 0, got {coef}")
        self.target_tokens, self.coef = target_tokens, coef

    def __call__(self, prompts, completions, completion_ids: Sequence[Sequence[int]], **columns) -> list[float]:
        return [-self.coef * max(0, len(ids) - self.target_tokens) for ids in completion_ids]
