"""The ``rloo-lightning`` command's one-line errors.

:func:`error_line` is the line an exception chain comes down to (its innermost useful message);
:func:`unknown_option_message` names an unknown option as the user gave it, with the config file that sets it and the
closest valid option; :func:`renamed_message` names the new path of a class path that names an old module;
:func:`set_where` says where an option was set, for an error about its value.
"""

from __future__ import annotations

import difflib
import re
from argparse import ArgumentError
from pathlib import Path

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from rloo_lightning.engines.vllm_http import ServerDown, ServerFailed
from rloo_lightning.runtime import framework
from rloo_lightning.runtime.atomic_checkpoint import NoSpaceError
from rloo_lightning.runtime.renamed import renamed_hint, renamed_option
from rloo_lightning.runtime.sigterm import StepFailed

__all__ = ["error_line", "parser_message", "renamed_message", "set_where", "unknown_option_message"]

# Exception types whose message says it all; other types are named on the error line (NonFiniteError: ...).
_PLAIN_ERRORS = (ValueError, RuntimeError, OSError, FileNotFoundError, FileExistsError, ImportError,
                 ModuleNotFoundError, TypeError, NotImplementedError, MisconfigurationException, NoSpaceError,
                 ServerFailed, ServerDown,  # the vLLM server engine's: each names the server and what happened
                 StepFailed)  # a failure every rank raises together: it names the failed ranks and their errors


def _error_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    chain, seen = [exc], {id(exc)}
    while True:
        last = chain[-1]
        inner = last.__cause__ if last.__cause__ is not None else (
            None if last.__suppress_context__ else last.__context__)
        if inner is None or id(inner) in seen:
            return chain
        chain.append(inner)
        seen.add(id(inner))


def _is_wrapper(exc: BaseException) -> bool:
    """An exception that only carries another: raised by the argument parser, or with no message of its own."""
    module = type(exc).__module__ or ""
    from_parser = isinstance(exc, ArgumentError) or module.split(".")[0] in ("jsonargparse", "argparse")
    return from_parser or not str(exc).strip()


def error_line(exc: BaseException) -> str:
    """The one line that says what went wrong: the innermost useful message of ``exc``'s chain."""
    chain = _error_chain(exc)
    useful = next((e for e in chain if not _is_wrapper(e)), None)
    if useful is None:  # only wrappers: the innermost one with a message
        useful = next((e for e in reversed(chain) if str(e).strip()), exc)
    message = str(useful).strip()  # a message written on several lines keeps them
    name = type(useful).__name__
    # A private subclass of those (the vLLM child that ended or stalled) reads as plainly: its name means nothing to a
    # user, its message names what failed.
    private = name.startswith("_") and isinstance(useful, _PLAIN_ERRORS)
    if (type(useful) in _PLAIN_ERRORS or private) and message:
        return f"error: {message}"
    return f"error: {name}: {message}" if message else f"error: {name}"


def parser_message(exc: BaseException) -> str:
    """The argument parser's message of ``exc`` (its ``message``, else its text)."""
    return str(getattr(exc, "message", None) or exc)


_UNKNOWN = (re.compile(r"Subcommand '[^']+' does not accept option '([^']+)'"),
            re.compile(r"Group '([^']+)' does not accept option '([^']+)'"),
            re.compile(r"Option '([^']+)' is not accepted"))
_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def unknown_option_message(message: str, argv: list[str], parser, subcommand: str | None) -> str | None:
    """The one line for the parser's ``message`` when it is about an unknown option (else None): the option as
    given, the config file that has it, and the closest valid option at the level of the first unknown name.

    ``unrecognized arguments: --model.samplng.k 4`` (a command-line option) becomes ``unknown option
    --model.samplng.k; did you mean --model.sampling.k?``; ``Subcommand 'fit' does not accept option
    'model.samplng.k'`` (a key of a ``--config`` file) becomes ``unknown option model.samplng in my.yaml; did you
    mean model.sampling?``.
    """
    valid = {a.dest for a in framework.parser_actions(parser)
             if isinstance(a.dest, str) and a.dest.rsplit(".", 1)[-1] not in ("help", "print_config")}
    if message.startswith("unrecognized arguments:"):
        typed = next((t for t in message.split(":", 1)[1].split() if t.startswith("--") and len(t) > 2), None)
        if typed is None:
            return None
        key = typed[2:].split("=", 1)[0]
        _, level_fix, full_fix = _closest_key(key, valid)
        fix = renamed_option(key) or full_fix or level_fix
        return f"unknown option --{key}" + (f"; did you mean --{fix}?" if fix else "")
    choice = re.match(r"argument subcommand: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if choice:  # a misspelt subcommand
        close = difflib.get_close_matches(choice[1], re.findall(r"'([^']*)'", choice[2]), n=1)
        return f"{message}; did you mean {close[0]}?" if close else None
    match = next((m for m in (pattern.match(message) for pattern in _UNKNOWN) if m), None)  # not one nested deeper
    if match is None:
        return None
    key = ".".join(match.groups())
    if key in valid:  # a known option in the wrong place (before the subcommand): the parser's message says so
        return None
    bad, level_fix, full_fix = _closest_key(key, valid)
    files = _config_files_with(argv, bad.split("."), subcommand)
    if files:
        where = f" in {files[0]}"
        fix = renamed_option(bad) or level_fix
    else:
        bad, where, fix = key, "", renamed_option(key) or full_fix or level_fix
    return f"unknown option {bad}{where}" + (f"; did you mean {fix}?" if fix else "")


_PACKAGE_PATH = re.compile(r"(?<![\w.])rloo_lightning(?:\.\w+)+")
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')


def renamed_message(message: str, argv: list[str], subcommand: str | None) -> str | None:
    """The one line for the parser's ``message`` when it rejects a class path that names an old module of the
    package (else None): the option as the user set it, and the path's new name. ``Parser key
    "model.generation_engine": ... 'rloo_lightning.vllm_engine.VLLMEngine' ...`` (many lines) becomes
    ``model.generation_engine in my.yaml: rloo_lightning.vllm_engine.VLLMEngine was renamed
    rloo_lightning.engines.vllm.VLLMEngine: use the new path``."""
    hint = next((h for h in map(renamed_hint, _PACKAGE_PATH.findall(message)) if h is not None), None)
    if hint is None:
        return None
    key = _PARSER_KEY.search(message)
    return f"{set_where(argv, key[1], subcommand)}: {hint}" if key else hint


def _closest_key(key: str, valid: set[str]) -> tuple[str, str | None, str | None]:
    """``key`` up to its first name that is no option (``model.samplng`` of ``model.samplng.k``), that name
    replaced by the closest valid name at its level (``model.sampling``, or None), and the whole key so mended
    when it is valid (``model.sampling.k``, else None).

    A name that is a field of one option group one level down is that field: ``model.beta`` is ``model.kl.beta``
    (the module's options are grouped), as is a group and field written flat (``model.kl_estimator``)."""
    parts = key.split(".")
    nodes = {".".join(k.split(".")[:i]) for k in valid for i in range(1, k.count(".") + 2)}
    i = next((i for i in range(len(parts)) if ".".join(parts[:i + 1]) not in nodes), len(parts) - 1)
    level = ".".join(parts[:i])
    bad = ".".join(parts[:i + 1])
    start = len(level) + 1 if i else 0
    below = {n[start:]: n for n in nodes if n.count(".") == i + 1 and n.startswith(level + "." if i else "")}
    grouped = [n for rest, n in below.items() if rest.split(".", 1)[1] == parts[i]]
    if not grouped:  # a group and its field run together: ``kl_estimator``, ``reward_funcs``
        flat = {rest.replace(".", "_"): n for rest, n in below.items()}
        grouped = [flat[c] for c in difflib.get_close_matches(parts[i], list(flat), n=1, cutoff=0.85)]
    if len(grouped) == 1:
        full = ".".join([grouped[0], *parts[i + 1:]])
        return bad, grouped[0], full if full in nodes else None
    names = sorted({n.split(".")[i] for n in nodes if n.count(".") == i and n.startswith(level + "." if i else "")})
    close = difflib.get_close_matches(parts[i], names, n=1)
    if not close or close[0] == parts[i]:
        return bad, None, None
    level_fix = ".".join([*parts[:i], close[0]])
    full = ".".join([*parts[:i], close[0], *parts[i + 1:]])
    return bad, level_fix, full if full in nodes else None


def _config_files_with(argv: list[str], parts: list[str], subcommand: str | None) -> list[str]:
    """The config files given in ``argv`` (``--config my.yaml``, or a group's ``--model model.yaml``), as given,
    that set the key ``parts`` (nested, dotted, or under the subcommand's name)."""
    found = (_config_file_setting(argv, i, parts, subcommand) for i in range(len(argv)))
    return [path for path in found if path is not None]


def _config_file_setting(argv: list[str], i: int, parts: list[str], subcommand: str | None) -> str | None:
    """The config file that ``argv[i]`` gives (``--config my.yaml``, ``-c my.yaml``, ``--model model.yaml``) when it
    sets the key ``parts``, else None."""
    import yaml

    arg = argv[i]
    if arg == "-c" or arg.startswith("-c="):
        arg = "--config" + arg[2:]
    if not arg.startswith("--"):
        return None
    name, eq, value = arg[2:].partition("=")
    value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    root = [] if name == "config" else name.split(".")
    if root != parts[:len(root)] or len(root) >= len(parts) or not value.endswith(_CONFIG_SUFFIXES):
        return None
    try:
        data = yaml.safe_load(Path(value).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    rest = parts[len(root):]
    under = data.get(subcommand) if isinstance(data, dict) and subcommand and not root else None
    return value if _has_key(data, rest) or _has_key(under, rest) else None


def set_where(argv: list[str], key: str, subcommand: str | None, aliases: tuple[str, ...] = ()) -> str:
    """How ``argv`` last set the option ``key``: ``--<key>`` (or an alias) on the command line, ``<key> in
    <file>`` in a config file, or ``key`` itself when neither says (a default, a value given inline)."""
    where, parts = key, key.split(".")
    for i, arg in enumerate(argv):
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        path = _config_file_setting(argv, i, parts, subcommand)
        if name in (key, *aliases):
            where = f"--{name}"
        elif path is not None:
            where = f"{key} in {path}"
        elif name and name.split(".") == parts[:name.count(".") + 1] and name != key:
            where = key  # a group given whole (--model.optimizer '{...}'): the key names it
    return where


def _has_key(data, parts: list[str]) -> bool:
    """Whether the nested mapping ``data`` sets ``parts``, each level's key whole or dotted (``sampling.k``)."""
    if not parts:
        return True
    if not isinstance(data, dict):
        return False
    return any(".".join(parts[:i]) in data and _has_key(data[".".join(parts[:i])], parts[i:])
               for i in range(1, len(parts) + 1))
