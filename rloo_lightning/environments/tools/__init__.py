"""Tool use: plain Python functions as tools, called by the policy in a multi-turn episode.

A tool is a typed function with a Google-style docstring (its ``Args:`` describe the parameters); its JSON schema
is read from them (``transformers.utils.get_json_schema``). The policy calls a tool by writing, in its turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>

The call runs (in a worker process with a timeout and a memory limit, by default), and its result comes back as a
``tool`` message; the policy goes on. A turn without a call is the policy's answer and ends the episode.

**Several calls in one turn** all run, in the order written, and each counts as a call (``max_calls`` too). With
one call the tool message is its result as it is (a string as it is, anything else as JSON) or its error message.
With several, the message is a JSON list with one object per call, in call order: ``{"name": <tool name>,
"result": <the text one call would have shown>}`` or ``{"name": <tool name, or null if it could not be read>,
"error": "error (<kind>): ..."}``, e.g.
``[{"name": "add", "result": "3"}, {"name": "divide", "error": "error (exception): divide raised ..."}]``.

Whatever goes wrong with a call becomes an error message to the policy, ``error (<kind>): ...``, and a metric,
never an exception out of :meth:`ToolEnvironment.step` (a policy under RL writes anything):

=====================  =====================================================================================
kind                   when
=====================  =====================================================================================
``malformed``          a ``<tool_call>`` that is not closed, not JSON (also JSON nested too deeply for the
                       parser, or an integer of more than 4300 digits), nested more than 64 levels deep, or not
                       ``{"name": ..., "arguments": {...}}``
``unknown_tool``       a name that is not one of the tools
``bad_arguments``      arguments the function's signature does not accept, or that do not fit its JSON schema
                       (see :mod:`.validation`); a call past ``max_calls`` (which also ends the episode)
``exception``          the tool raised (a ``MemoryError`` past ``memory_mb`` too), its worker died or failed, or
                       its result cannot be written as text
``timeout``            the call ran past ``timeout`` seconds: its worker is killed and replaced
=====================  =====================================================================================

**Argument checks.** Before a tool runs, its arguments are checked against its schema, the subset that
``get_json_schema`` writes (:mod:`.validation` lists what is checked, in depth).

**Security.** A tool is your code, run with the policy's arguments: treat the arguments as untrusted input. Never
``eval`` or ``exec`` model output, never pass it to a shell; parse it (the built-in :func:`calculator` parses
arithmetic with :mod:`ast` and evaluates only numbers and ``+ - * / // % **`` with bounded exponents, to a finite
real number). The worker process bounds the time of a call and its address space (``memory_mb``), not what it
can touch.

Schemas reach the prompt through ``data.tools`` (the same import paths): a chat template that takes ``tools``
renders them itself; otherwise :func:`tool_prompt` writes them, with the call format above, as a system message.

The package's modules, by concept: :mod:`.schema` (schemas from signatures, the fallback prompt), :mod:`.parsing`
(reading calls out of a turn), :mod:`.validation` (arguments against a schema), :mod:`.environment`
(:class:`ToolEnvironment`) and :mod:`.calculator` (a built-in tool).
"""

from rloo_lightning.environments.tools.arithmetic import calculator
from rloo_lightning.environments.tools.environment import ERROR_KINDS, ToolEnvironment
from rloo_lightning.environments.tools.parsing import MAX_ARGUMENT_DEPTH, ToolCall, parse_tool_call, parse_tool_calls
from rloo_lightning.environments.tools.schema import resolve_tools, tool_prompt, tool_schema, tool_schemas

__all__ = ["ToolEnvironment", "ToolCall", "calculator", "parse_tool_call", "parse_tool_calls", "tool_prompt",
           "tool_schema", "resolve_tools", "tool_schemas", "ERROR_KINDS", "MAX_ARGUMENT_DEPTH"]
