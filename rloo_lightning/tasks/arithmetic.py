"""Short arithmetic word problems answered with a number (for real pretrained chat models).

``{"prompt": "Mia has 7 pencils and gets 5 more. How many pencils does Mia have now? Answer with
just the number.", "answer": "12"}``. The reward is 1.0 when the last number in the completion
equals the answer (compared as numbers: ``"12.0"`` counts), else 0.0 — the built-in
:class:`rloo_lightning.rewards.builtin.ExactAnswer`: verifiable and prompt-dependent.
"""

from __future__ import annotations

import operator
import random
import re

from rloo_lightning.rewards.builtin import ExactAnswer
from rloo_lightning.tasks.base import Task

NAMES = ["Mia", "Sam", "Lena", "Omar", "Kai", "Zoe", "Ivan", "Nora", "Ben", "Ada"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "coins", "cards", "shells"]
TEMPLATES = [  # (text, the operator's symbol)
    ("{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?", "+"),
    ("{n} has {a} {item} and gives away {b}. How many {item} does {n} have left?", "-"),
    ("{n} buys {a} bags with {b} {item} in each bag. How many {item} does {n} buy?", "*"),
]
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SUFFIX = " Answer with just the number."


def _pattern(text: str) -> re.Pattern:
    """A template as a regex of its prompts: ``{a}``/``{b}`` numbers, ``{n}``/``{item}`` words (repeats equal)."""
    seen: set[str] = set()

    def field(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return f"(?P={name})"
        seen.add(name)
        return rf"(?P<{name}>\d+)" if name in ("a", "b") else rf"(?P<{name}>\w+)"

    return re.compile(re.sub(r"\\\{(\w+)\\\}", field, re.escape(text + SUFFIX)) + r"\Z")


_PATTERNS = [(_pattern(text), symbol) for text, symbol in TEMPLATES]


def make_rows(n: int, seed: int) -> list[dict]:
    """``n`` problems drawn with ``random.Random(seed)``; the answers are non-negative integers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text, symbol = rng.choice(TEMPLATES)
        a, b = rng.randint(2, 20), rng.randint(2, 9)
        a, b = (max(a, b), min(a, b)) if symbol == "-" else (a, b)  # non-negative answers
        prompt = text.format(n=rng.choice(NAMES), a=a, b=b, item=rng.choice(ITEMS)) + SUFFIX
        rows.append({"prompt": prompt, "answer": str(OPERATORS[symbol](a, b))})
    return rows


def expression(prompt: str) -> str:
    """The arithmetic of one of this task's prompts, e.g. ``"8 - 5"`` (parsed with the templates above)."""
    for pattern, symbol in _PATTERNS:
        m = pattern.match(prompt)
        if m:
            return f"{m['a']} {symbol} {m['b']}"
    raise ValueError(f"not an arithmetic-task prompt: {prompt!r}")


_EXACT = ExactAnswer(column="answer", extract="last_number")


def reward(prompts, completions, completion_ids, answer, **columns) -> list[float | None]:
    """1.0 if the completion's last number equals the answer (compared as numbers), else 0.0."""
    return _EXACT(prompts, completions, completion_ids, answer=answer)


TASK = Task(name="arithmetic", make_rows=make_rows, reward=reward, build_tiny_model=None)
