"""Tools for the tool tests (``test_environments_tools*.py``), importable by path in a worker process."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def hang(seconds: float) -> str:
    """Sleep, far longer than any timeout.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke up"


def untyped(x):
    """No type hints."""
    return x


# -- a tiny policy that writes calculator calls, for the CLI resume test -------------------------------------------
CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'


def build_tool_caller(directory) -> None:
    """A tiny Llama over eight tokens: the specials, ``CALL_OPEN``, ``CALL_CLOSE``, ``3`` and ``+`` (every other
    character encodes as ``<unk>``), warm-started for a few steps on first turns like ``CALL_OPEN 3 + 3 CALL_CLOSE
    <eos>``. Sampled at temperature 1 it writes valid calls, calls the calculator cannot parse (``3 +``) and
    malformed ones, and answers."""
    import random
    import re

    import torch

    from rloo_lightning.tasks.base import segments_nll

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rloo_lightning.models.tiny import build_tiny_llama

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, CALL_OPEN: 4, CALL_CLOSE: 5, "3": 6, "+": 7}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{re.escape(CALL_OPEN)}|{re.escape(CALL_CLOSE)}|."),
                                              behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>", padding_side="left", model_max_length=256)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256, seed=0)
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(20):
        turns = [[([3] * rng.randint(3, 8), False),
                  ([4, *(rng.choice([6, 7]) for _ in range(rng.randint(1, 3))), 5, 2], True)] for _ in range(16)]
        loss = segments_nll(model, 0, turns)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def successful_calls(prompts, completions, completion_ids, transcript, **columns) -> list[float]:
    """The number of tool results in each episode that are not errors."""
    return [float(sum(m["role"] == "tool" and not m["content"].startswith("error (") for m in t))
            for t in transcript]


# -- for ``test_environments_tools_hostile.py``: union, optional, list and literal parameters, odd results, memory
from typing import Any, Literal, Optional, Union  # noqa: E402


def pick(value: int | str) -> str:
    """Echo an integer or a string.

    Args:
        value: an integer or a string.
    """
    return f"{type(value).__name__}:{value}"


def maybe(value: Optional[int]) -> str:
    """Echo an integer or null.

    Args:
        value: an integer, or null.
    """
    return f"{type(value).__name__}:{value}"


def either(value: Union[int, str]) -> str:
    """Echo an integer or a string (typing.Union).

    Args:
        value: an integer or a string.
    """
    return f"{type(value).__name__}:{value}"


def total(values: list[int]) -> int:
    """Sum a list of integers.

    Args:
        values: the integers.
    """
    return sum(values)


def colour(name: Literal["red", "green"]) -> str:
    """Echo one of two colours.

    Args:
        name: red or green.
    """
    return name


def shape(value: list[int] | dict[str, int]) -> str:
    """Echo a list of integers or a mapping to integers.

    Args:
        value: the list or the mapping.
    """
    return type(value).__name__


def anything(value: Any) -> str:
    """Echo the JSON type of anything (its schema has no "type").

    Args:
        value: any JSON value.
    """
    return type(value).__name__


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")

    __repr__ = __str__


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def _refuse_to_load():
    raise RuntimeError("this result cannot be rebuilt")


class _Unloadable:
    """Pickles in the worker, fails to unpickle in the parent."""

    def __reduce__(self):
        return _refuse_to_load, ()


def odd_result(kind: str):  # noqa: ANN201 - the return type is the point
    """Return something awkward.

    Args:
        kind: which awkward thing.
    """
    if kind == "set":
        return {1, 2}
    if kind == "bytes":
        return b"\x00\xff"
    if kind == "unprintable":
        return _Unprintable()
    if kind == "huge_int":
        return 10 ** 5000
    if kind == "deep":
        value: list = []
        for _ in range(5000):
            value = [value]
        return value
    if kind == "surrogate":
        return "half a pair: \ud800"
    if kind == "unprintable_error":
        raise _UnprintableError()
    if kind == "unloadable":
        return _Unloadable()
    if kind == "exit":
        raise SystemExit(3)
    return kind


def allocate(megabytes: int) -> int:
    """Allocate and touch a buffer.

    Args:
        megabytes: its size in MiB.
    """
    data = bytearray(megabytes * 2 ** 20)
    return len(data)
