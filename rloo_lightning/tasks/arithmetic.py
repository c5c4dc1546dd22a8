"""Short arithmetic word problems answered with a number (for real pretrained chat models).

``{"prompt": "Mia has 7 pencils and gets 5 more. How many pencils does Mia have now? Answer with
just the number.", "answer": "12"}``. The reward is 1.0 when the last number in the completion
equals the answer (compared as numbers: ``"12.0"`` counts), else 0.0 — the built-in
:class:`rloo_lightning.rewards.builtin.ExactAnswer`: verifiable and prompt-dependent.
"""

from __future__ import annotations

import random

from rloo_lightning.rewards.builtin import ExactAnswer
from rloo_lightning.tasks.base import Task

NAMES = ["Mia", "Sam", "Lena", "Omar", "Kai", "Zoe", "Ivan", "Nora", "Ben", "Ada"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "coins", "cards", "shells"]
TEMPLATES = [
    ("{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?", lambda a, b: a + b),
    ("{n} has {a} {item} and gives away {b}. How many {item} does {n} have left?", lambda a, b: a - b),
    ("{n} buys {a} bags with {b} {item} in each bag. How many {item} does {n} buy?", lambda a, b: a * b),
]
SUFFIX = " Answer with just the number."


def make_rows(n: int, seed: int) -> list[dict]:
    """``n`` problems drawn with ``random.Random(seed)``; the answers are non-negative integers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text, op = rng.choice(TEMPLATES)
        a, b = rng.randint(2, 20), rng.randint(2, 9)
        a, b = (max(a, b), min(a, b)) if op(5, 3) == 2 else (a, b)
        prompt = text.format(n=rng.choice(NAMES), a=a, b=b, item=rng.choice(ITEMS)) + SUFFIX
        rows.append({"prompt": prompt, "answer": str(op(a, b))})
    return rows


_EXACT = ExactAnswer(column="answer", extract="last_number")


def reward(prompts, completions, completion_ids, answer, **columns) -> list[float | None]:
    """1.0 if the completion's last number equals the answer (compared as numbers), else 0.0."""
    return _EXACT(prompts, completions, completion_ids, answer=answer)


TASK = Task(name="arithmetic", make_rows=make_rows, reward=reward, build_tiny_model=None)
