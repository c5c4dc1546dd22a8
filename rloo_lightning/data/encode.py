"""PromptEncoder: a row's prompt to token ids: the chat template, the system prompt and the length check.

Used once per row when the prompt cache is built (:mod:`rloo_lightning.data.cache`); its
:meth:`PromptEncoder.identity` is the part of the cache key that says how rows were encoded.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from typing import Iterable

__all__ = ["CHAT_ROLES", "PromptEncoder", "UNKNOWN_REFUSED", "UNKNOWN_WARNED", "tokenizer_fingerprint"]

CHAT_ROLES = ("system", "user", "assistant", "tool")  # what every chat template knows; others need data.extra_roles
UNKNOWN_REFUSED = 0.5  # a prompt whose tokens are more than this share unknown is refused: the model cannot read it
UNKNOWN_WARNED = 0.01  # a split whose prompt tokens are more than this share unknown gives a warning


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides the tokenizer's ids: its serialized pipeline (vocabulary, merges,
    normalizer, pre-tokenizer, post-processor with BOS/EOS) or, for a slow tokenizer, its vocabulary; its
    class and special tokens. Two tokenizers with one fingerprint encode every text alike."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(json.dumps([getattr(tokenizer, a, None) for a in ("add_bos_token", "add_eos_token")]).encode())
    return h.hexdigest()


class PromptEncoder:
    """Formats and tokenizes prompts as the data module's options say.

    Args:
        tokenizer: the policy's tokenizer.
        tokenizer_name: how messages name it.
        prompt_column, use_chat_template, system_prompt, on_long_prompt, max_prompt_length,
            max_new_tokens: the data module's options of those names.
        max_prompt_tokens: the longest prompt allowed (``max_prompt_length`` or the context's room).
        context: the model's context length (None: unknown), for the long-prompt message.
        tools: tool schemas for every prompt (``data.tools``): given to a chat template that takes ``tools``,
            else written as a system message (:func:`~rloo_lightning.environments.tools.tool_prompt`).
    """

    def __init__(self, tokenizer, tokenizer_name: str, prompt_column: str, use_chat_template, system_prompt,
                 on_long_prompt: str, max_prompt_length: int | None, max_new_tokens: int,
                 max_prompt_tokens: int | None, context: int | None, tools: list[dict] | None = None,
                 extra_roles: list[str] | None = None, on_unreadable_prompt: str = "error") -> None:
        self.tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self.prompt_column = prompt_column
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.on_long_prompt = on_long_prompt
        self.max_prompt_length = max_prompt_length
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.context = context
        self.tools = tools
        self.roles = (*CHAT_ROLES, *(extra_roles or ()))
        self.extra_roles = list(extra_roles or ())
        self.unknown_id = getattr(tokenizer, "unk_token_id", None)
        self.on_unreadable_prompt = on_unreadable_prompt
        self.counts = {"tokens": 0, "unknown": 0}  # of the prompts encoded (reset by the cache per split)
        self._fingerprint: str | None = None

    def identity(self) -> dict:
        """What the cache key records of the encoding (any change re-encodes the rows). The tokenizer's
        fingerprint serializes its whole pipeline: taken once, though ``prepare_data`` and ``setup`` both ask."""
        if self._fingerprint is None:
            self._fingerprint = tokenizer_fingerprint(self.tokenizer)
        return {"tokenizer": self._fingerprint, "chat_template": self.tokenizer.chat_template,
                "use_chat_template": self.use_chat_template, "system_prompt": self.system_prompt,
                "prompt_column": self.prompt_column, "max_prompt_tokens": self.max_prompt_tokens,
                "on_long_prompt": self.on_long_prompt, **({"tools": self.tools} if self.tools else {}),
                # the checks a row passed when the entry was built (roles, unknown tokens): rows accepted under
                # other ones are checked again
                "checks": {"version": 1, "extra_roles": self.extra_roles,
                           "on_unreadable_prompt": self.on_unreadable_prompt}}

    def format_prompt(self, prompt, where: str) -> tuple[str, bool]:
        """The text fed to the model for ``prompt`` and whether it went through the chat template."""
        has_template = bool(self.tokenizer.chat_template)
        chat = isinstance(prompt, list) or self.system_prompt is not None or bool(self.tools) or (
            self.use_chat_template is True or (self.use_chat_template == "auto" and has_template))
        if self.use_chat_template is False and (isinstance(prompt, list) or self.system_prompt is not None
                                                or self.tools):
            raise ValueError(f"{where}: a messages prompt, system_prompt or tools need use_chat_template")
        if not chat:
            return prompt, False
        if not has_template:
            raise ValueError(f"{where}: a messages prompt, system_prompt or tools need a chat template, and the "
                             f"tokenizer of {self.tokenizer_name!r} has none")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        template_tools = bool(self.tools) and "tools" in self.tokenizer.chat_template
        system = self.system_prompt
        if self.tools and not template_tools:  # the documented fallback: the schemas and call format as text
            from rloo_lightning.environments.tools import tool_prompt

            system = tool_prompt(self.tools) + ("" if system is None else "\n\n" + system)
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        extra = {"tools": self.tools} if template_tools else {}
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as err:
            raise ValueError(f"{where}: the chat template failed on this prompt: {err}") from err
        return text, True

    def _prompt(self, where: str, row: dict):
        col = self.prompt_column
        if col not in row:
            raise ValueError(f"{where}: no prompt column {col!r}; columns are {sorted(row)}. Set `prompt_column`.")
        prompt = row[col]
        is_messages = isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        if not (isinstance(prompt, str) and prompt) and not is_messages:
            raise ValueError(f"{where}: prompt column {col!r} must be a non-empty string or a list of "
                             f"{{'role', 'content'}} messages, got {prompt!r:.80}")
        if is_messages:
            for j, message in enumerate(prompt):
                role = message["role"]
                if role not in self.roles:
                    close = difflib.get_close_matches(str(role), self.roles, n=1)
                    raise ValueError(
                        f"{where}: message {j} has role {role!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                        + f"; a chat role is one of {', '.join(self.roles)}. List a role your chat template "
                        "accepts in data.extra_roles")
        return prompt

    def encode(self, pairs: Iterable[tuple[str, dict]]) -> list[dict | None]:
        """Each ``(where, row)`` as ``{"input_ids", "prompt", "columns"}``, or None for a prompt dropped as
        too long (``on_long_prompt: drop``). Raises ``ValueError`` naming the row for a bad row, or a long
        prompt under ``on_long_prompt: error``. Tokenizes the batch in two calls (templated or not)."""
        pairs = list(pairs)
        formatted = [self.format_prompt(self._prompt(where, row), where) for where, row in pairs]
        ids: list[list[int] | None] = [None] * len(pairs)
        for templated in (True, False):
            at = [i for i, (_, t) in enumerate(formatted) if t is templated]
            if at:
                # A chat template writes its own special tokens (BOS included); don't add them twice.
                encoded = self._tokenize([formatted[i][0] for i in at], add_special_tokens=not templated)
                for i, e in zip(at, encoded):
                    ids[i] = e
        out: list[dict | None] = []
        for (where, row), row_ids in zip(pairs, ids):
            if self.max_prompt_tokens is not None and len(row_ids) > self.max_prompt_tokens:
                if self.on_long_prompt == "drop":
                    out.append(None)
                    continue
                raise ValueError(f"{where}: prompt of {len(row_ids)} tokens {self._long_why()}; shorten it or "
                                 "set on_long_prompt=drop")
            self._count_unknown(where, row_ids)
            col = self.prompt_column
            columns = {c: v for c, v in row.items() if c != col}
            out.append({"input_ids": row_ids, "prompt": row[col], "columns": columns})
        return out

    def _count_unknown(self, where: str, ids: list[int]) -> None:
        """Adds the prompt's tokens to :attr:`counts`; refuses a prompt more than ``UNKNOWN_REFUSED`` unknown."""
        unknown = ids.count(self.unknown_id) if self.unknown_id is not None else 0
        self.counts["tokens"] += len(ids)
        self.counts["unknown"] += unknown
        if ids and unknown > UNKNOWN_REFUSED * len(ids) and self.on_unreadable_prompt == "error":
            token = getattr(self.tokenizer, "unk_token", None)
            raise ValueError(f"{where}: {unknown} of the prompt's {len(ids)} tokens are the unknown token {token!r}: "
                             f"the tokenizer of {self.tokenizer_name!r} cannot read it (characters outside its "
                             "vocabulary, or text meant for another model's tokenizer); on_unreadable_prompt=keep "
                             "trains on such prompts as they are")

    def _tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of ``texts``. A fast tokenizer's own pipeline is called directly: the same ids as
        ``tokenizer(texts)`` (no truncation or padding is asked for) without building a ``BatchEncoding``,
        which cost more than the tokenization itself on short prompts."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(self.tokenizer, "is_fast", False):
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]

    def _long_why(self) -> str:
        if self.max_prompt_length is not None and self.max_prompt_tokens == self.max_prompt_length:
            return f"exceeds max_prompt_length={self.max_prompt_length}"
        return f"+ max_new_tokens={self.max_new_tokens} exceeds the model's context of {self.context} tokens"
