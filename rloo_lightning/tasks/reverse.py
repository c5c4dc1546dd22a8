"""The default embedded task: write the prompt's letters in reverse order.

Prompt ``"cabd="`` -> answer ``"dbac"``. The reward is the fraction of positions that match,
over the longer of answer and completion, so it is in [0, 1], gives partial credit, and
depends on the prompt: no single fixed completion scores well on every prompt
(:func:`best_constant_score` measures the best one on a set of rows).

The tiny model's warm start (standing in for the SFT model RLHF starts from) is a short
supervised phase on *shuffled* answers: it learns the format (which letters, how many, then
EOS) but not the order, so the RL phase is what has to learn the task.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rloo_lightning.tasks.base import Task, segments_nll, warm_start
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

ALPHABET = "abcdefgh"
SEPARATOR = "="
MIN_LEN, MAX_LEN = 3, 5
WARM_START_STEPS = 150
WARM_START_SEED = 1234


def make_rows(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt": "cabd=", "answer": "dbac"}`` drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        rows.append({"prompt": word + SEPARATOR, "answer": word[::-1]})
    return rows


def score(completion: str, answer: str) -> float:
    """Positional matches over ``max(len(answer), len(completion))``: in [0, 1]."""
    matches = sum(a == b for a, b in zip(completion, answer))
    return matches / max(len(answer), len(completion), 1)


def reward(prompts, completions, completion_ids, answer, **columns) -> list[float]:
    """Reward function (the protocol of :mod:`rloo_lightning.rewards`): one score per completion."""
    return [score(c, a) for c, a in zip(completions, answer)]


def best_constant_score(rows: list[dict]) -> tuple[str, float]:
    """The constant completion (up to ``MAX_LEN`` letters) with the best mean score on ``rows``.

    Exhaustive over lengths 1..MAX_LEN would be 8^5 strings; the best constant is found per
    length greedily position by position, which is exact here because positions score
    independently for a fixed length.
    """
    best = ("", 0.0)
    for length in range(1, MAX_LEN + 1):
        guess = "".join(
            max(ALPHABET, key=lambda ch, i=i: sum(len(r["answer"]) > i and r["answer"][i] == ch for r in rows))
            for i in range(length)
        )
        value = sum(score(guess, r["answer"]) for r in rows) / len(rows)
        if value > best[1]:
            best = (guess, value)
    return best


def build_tiny_model(directory: Path, num_heads: int = 4, max_position_embeddings: int = 32) -> None:
    """Tokenizer + tiny Llama, warm-started on shuffled answers, saved to ``directory``.

    ``num_heads=2`` gives head size 32, which vLLM's CPU attention supports (the task's own model has 16); a longer
    ``max_position_embeddings`` takes longer sequences (the task's own need 32)."""
    tok = build_char_tokenizer(ALPHABET + SEPARATOR, model_max_length=max_position_embeddings)
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=num_heads,
                             max_position_embeddings=max_position_embeddings, seed=WARM_START_SEED)
    rng = random.Random(WARM_START_SEED)
    ids_of = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    def batch_loss() -> torch.Tensor:  # the NLL of "shuffled answer + EOS" given the prompt
        pieces = []
        for row in make_rows(64, rng.randrange(2**31)):
            letters = list(row["answer"])
            rng.shuffle(letters)
            pieces.append([(ids_of(row["prompt"]), False), (ids_of("".join(letters)) + [tok.eos_token_id], True)])
        return segments_nll(model, tok.pad_token_id, pieces)

    warm_start(model, WARM_START_STEPS, lr=3e-3, seed=WARM_START_SEED, batch_loss=batch_loss)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


TASK = Task(name="reverse", make_rows=make_rows, reward=reward, build_tiny_model=build_tiny_model, version=1)
