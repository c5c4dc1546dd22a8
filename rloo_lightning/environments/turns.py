"""The turn markers of a multi-turn transcript: the ids appended around an environment's reply.

:class:`TurnFormat` reads them off the tokenizer's chat template once per role (or writes them from a plain
pattern without a template), so that a transcript grows by ids only: the policy's tokens stay as sampled and
the environment's reply is encoded as data, never as markup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rloo_lightning.environments.base import EnvironmentConfigError, Message

__all__ = ["TurnFormat"]

# Sentinels for reading a chat template's turn markers: plain words, so that no template trims or escapes them.
_A, _O, _U = "QXASSISTANTQX", "QXOBSERVATIONQX", "QXUSERQX"
# Around the observation's sentinel: survives a template that keeps the content as it is, gone where it trims.
_PAD = "\t \t"



@dataclass
class TurnFormat:
    """The ids appended around an environment message, read off the chat template once per role.

    For a reply in role ``r`` with text ``c``, the appended ids are ``before[r] + data(c) + after[r]``.
    ``before`` closes the policy's turn (whatever the template writes after an assistant message, less the
    end-of-turn token the policy sampled itself, when the template's closing starts with it) and opens a
    message in role ``r``. ``after`` closes it and opens the next assistant turn, as ``add_generation_prompt``
    does. Both depend on the role: a template may wrap a ``tool`` message inside a user turn, or give it a header
    of its own. Without a chat template, ``plain`` gives the markers as text.

    The markers are markup: their special tokens are parsed. The content is data: it is encoded with special tokens
    split into plain text, so an environment (or a policy echoed by a tool) that writes ``<|im_end|>`` cannot end a
    turn. A template that trims a message's content (``| trim``) gets its content trimmed here too.
    """

    tokenizer: object
    before: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    after: dict[str, list[int]] = field(default_factory=dict)
    trims: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    plain: str | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer, plain: str = "\n{role}: {content}\nassistant: ") -> "TurnFormat":
        """The format of ``tokenizer``: its chat template's markers, or ``plain`` (a ``str.format`` pattern with
        ``{role}`` and ``{content}``) when it has no template."""
        if not getattr(tokenizer, "chat_template", None):
            return cls(tokenizer, plain=plain)
        return cls(tokenizer)

    def _render(self, role: str) -> tuple[str, str, tuple[bool, bool]]:
        """The template's text between an assistant message and a ``role`` message, after the latter, and whether
        the template trims the content's start and end."""
        messages = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A},
                    {"role": role, "content": _PAD + _O + _PAD}]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:
            raise EnvironmentConfigError(f"the chat template cannot render a {role!r} message after an assistant "
                                         f"turn: {type(err).__name__}: {err}") from err
        if _A not in text or _O not in text[text.index(_A):]:
            raise EnvironmentConfigError(f"the chat template drops the content of an assistant or {role!r} message; "
                                         "it cannot carry a multi-turn episode")
        start = text.index(_A) + len(_A)
        at = text.index(_O, start)
        between, after = text[start:at], text[at + len(_O):]
        keeps_start, keeps_end = between.endswith(_PAD), after.startswith(_PAD)
        between = between[:-len(_PAD)] if keeps_start else between
        after = after[len(_PAD):] if keeps_end else after
        return between, after, (not keeps_start, not keeps_end)

    def markup_ids(self, text: str) -> list[int]:
        """``text`` written by the template or the user's ``reply_format``: special tokens are parsed."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def data_ids(self, text: str) -> list[int]:
        """``text`` written by an environment or a tool: special tokens are plain text, never markers."""
        if not text:
            return []
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def content(self, message: Message) -> str:
        """The message's content as the template writes it (trimmed where the template trims it)."""
        if self.plain is not None:
            return message.content
        if message.role not in self.trims:
            self._markers(message.role, "")
        trim_start, trim_end = self.trims[message.role]
        text = message.content.lstrip() if trim_start else message.content
        return text.rstrip() if trim_end else text

    def _markers(self, role: str, end: str) -> tuple[list[int], list[int]]:
        if self.plain is not None:
            head, _, tail = self.plain.partition("{content}")
            return self.markup_ids(head.format(role=role)), self.markup_ids(tail.format(role=role))
        key = (role, end)
        if key not in self.before:
            between, after, trims = self._render(role)
            if end and between.startswith(end):
                between = between[len(end):]
            self.before[key] = self.markup_ids(between)
            self.after[role], self.trims[role] = self.markup_ids(after), trims
        return self.before[key], self.after[role]

    def reply_ids(self, message: Message, end_token: str | None = None, content_ids: list[int] | None = None
                  ) -> list[int]:
        """The ids to append after a policy turn that ended with the end-of-turn token whose text is
        ``end_token`` (None: nothing of the template's closing is left out). The policy wrote that token, so
        where the template closes an assistant message with the same text it is not appended again; a turn ended
        by another end token (a model with several) gets the template's closing after it. ``content_ids``: the
        content's ids when the caller has them already (:meth:`data_ids` of :meth:`content`, possibly cut)."""
        before, after = self._markers(message.role, end_token or "")
        if content_ids is None:
            content_ids = self.data_ids(self.content(message))
        return before + list(content_ids) + after
