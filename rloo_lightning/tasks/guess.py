"""The embedded multi-turn task: guess a hidden word, told after the first guess which letters are right.

A row is ``{"prompt": "????=", "secret": "abba"}``: the prompt shows only the secret's length (one ``?`` per
letter, 4 letters of ``a`` / ``b``). The policy guesses; the environment
(:class:`rloo_lightning.environments.guess.GuessEnvironment`) answers with the guess's right letters, each wrong
one replaced by ``-`` (``"a--a"``: which positions are right, never a letter the guess did not have); the policy
guesses again, and the reward is the fraction of positions the second guess gets right. Nothing in the prompt
tells the secret, so without the reply no policy beats 0.5 on average; with it, keeping the right letters scores
0.75, and also flipping the wrong ones 1.

The tiny model's warm start teaches the format only: transcripts whose first guess is a random word of the right
length and whose second guess is the first with about one letter in seven flipped at random, after replies that
are informative or all ``?`` alike. Its second guess scores 0.5 on average like its first: it has never seen one
that uses the reply. The RL phase is what has to learn that.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rloo_lightning.tasks.base import Task, segments_nll, warm_start
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

LETTERS = "ab"
LENGTH = 4  # one length: the reply's letters sit at a fixed distance from the guess they mark
REPLY_FORMAT = "|{content}="  # the environment's reply after a guess, as the tiny tokenizer spells it
WARM_START_STEPS = 400
WARM_START_SEED = 4321
FLIP = 0.15  # the warm start's second guess flips each letter of the first with this probability


def _flip(letter: str) -> str:
    return LETTERS[1 - LETTERS.index(letter)]


def make_rows(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt": "????=", "secret": "abba"}`` drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        secret = "".join(rng.choice(LETTERS) for _ in range(LENGTH))
        rows.append({"prompt": "?" * len(secret) + "=", "secret": secret})
    return rows


def score(guess: str, secret: str) -> float:
    """Positional matches over ``max(len(secret), len(guess))``: in [0, 1]."""
    return sum(a == b for a, b in zip(guess, secret)) / max(len(secret), len(guess), 1)


def marks(guess: str, secret: str) -> str:
    """The guess's right letters kept and its wrong ones (or missing ones) replaced by ``-``: one character per
    letter of the secret (``"a-b-"``)."""
    return "".join(ch if i < len(guess) and guess[i] == ch else "-" for i, ch in enumerate(secret))


def reward(prompts, completions, completion_ids, secret, **columns) -> list[float]:
    """The single-turn reward (no environment): the completion scored against the secret."""
    return [score(c, s) for c, s in zip(completions, secret)]


def build_tiny_model(directory: Path, num_heads: int = 4) -> None:
    """Tokenizer + tiny Llama, warm-started on the transcript format only, saved to ``directory``.

    ``num_heads=2`` gives head size 32, which vLLM's CPU attention supports (the task's own model has 16)."""
    tok = build_char_tokenizer(LETTERS + "?=-|", model_max_length=48)
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=num_heads, max_position_embeddings=48,
                             seed=WARM_START_SEED)
    rng = random.Random(WARM_START_SEED)
    eos = tok.eos_token_id
    ids_of = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    def batch_loss() -> torch.Tensor:
        pieces = []  # (ids, trained) segments of each transcript: only the guesses are trained on
        for row in make_rows(64, rng.randrange(2**31)):
            n = len(row["secret"])
            first = "".join(rng.choice(LETTERS) for _ in range(n))
            # The second guess edits the first: each letter flipped with probability FLIP, whatever the reply.
            second = "".join(_flip(ch) if rng.random() < FLIP else ch for ch in first)
            reply = marks(first, row["secret"]) if rng.random() < 0.5 else "?" * n
            pieces.append([(ids_of(row["prompt"]), False), (ids_of(first) + [eos], True),
                           (ids_of(REPLY_FORMAT.format(content=reply)), False), (ids_of(second) + [eos], True)])
        return segments_nll(model, tok.pad_token_id, pieces)

    # lr 1e-3: at 3e-3 the model never learns to copy the first guess
    warm_start(model, WARM_START_STEPS, lr=1e-3, seed=WARM_START_SEED, batch_loss=batch_loss)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


TASK = Task(name="guess", make_rows=make_rows, reward=reward, build_tiny_model=build_tiny_model, version=1,
            hold_out_prompts=False)
