"""Import by path, and the working directory on ``sys.path``.

:func:`import_object` is the package's one import by path (``package.module.name``): reward functions, engines,
environments and tools named in a config all resolve through it, with one kind of error
(:class:`ImportPathError`) that says what was looked for and, when something is close, what was meant.

The working directory on ``sys.path``: a user's ``myreward.py`` next to their data is importable.

``rloo-lightning`` (an entry-point script) does not put the working directory on ``sys.path`` the
way ``python -m`` does, so ``--model.rewards.funcs '[myreward.score]'`` would fail with ``No module
named 'myreward'``. :func:`add_cwd_to_sys_path` appends it at the *end* (a user's ``datasets.py``
cannot shadow the installed ``datasets``) and warns about files in it named like a module the package
imports. It runs at the start of :func:`rloo_lightning.cli.main` (so again in every DDP rank, which
Lightning starts by re-running the command) and in every reward worker process, with the parent's
working directory.
"""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rloo_lightning.runtime.renamed import renamed_hint

__all__ = ["DEPENDENCIES", "ImportPathError", "add_cwd_to_sys_path", "import_object", "shadowing_files"]

# Top-level modules the package imports (checked even when not imported yet).
DEPENDENCIES = frozenset({
    "torch", "lightning", "transformers", "datasets", "tokenizers", "huggingface_hub", "safetensors",
    "jsonargparse", "yaml", "numpy", "pandas", "pyarrow", "accelerate", "peft", "gguf", "tensorboard",
})


def _within(file: str | None, folder: Path) -> bool:
    if not file:
        return False
    try:
        return Path(file).resolve().is_relative_to(folder)
    except (OSError, ValueError):
        return False


def shadowing_files(cwd: str | os.PathLike) -> list[str]:
    """Files / packages in ``cwd`` named like a dependency or an imported top-level module.

    A module that was itself loaded from ``cwd`` (the package's own source tree, run from the repo)
    is no clash, unless it is a dependency (then the user's file did shadow it).
    """
    folder = Path(cwd).resolve()
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    names = {name.partition(".")[0] for name in list(sys.modules)} - {"__main__", "__mp_main__"}
    out = []
    for entry in sorted(entries):
        if entry.suffix == ".py" and entry.is_file():
            name = entry.stem
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            name = entry.name
        else:
            continue
        if name not in names and name not in DEPENDENCIES:
            continue
        module = sys.modules.get(name)
        if name == "rloo_lightning" or (
            name not in DEPENDENCIES and module is not None and _within(getattr(module, "__file__", None), folder)
        ):
            continue
        out.append(entry.name)
    return out


def add_cwd_to_sys_path(cwd: str | os.PathLike | None = None, warn: bool = True) -> str:
    """Append ``cwd`` (default: the working directory) to the end of ``sys.path``; warn on stderr (one
    line per file) about files there that are named like an installed module the package uses."""
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    present = {os.path.abspath(p or os.curdir) for p in sys.path}
    if cwd not in present:
        sys.path.append(cwd)
    if warn:
        for name in shadowing_files(cwd):
            module = name.removesuffix(".py")
            print(f"warning: {os.path.join(cwd, name)} has the name of the module {module!r} that rloo_lightning "
                  f"uses; an import path '{module}.…' means that module, not this file: rename it",
                  file=sys.stderr)
    return cwd


# -- import by path ------------------------------------------------------------------------------
class ImportPathError(ValueError):
    """An import path that does not resolve: its message names the path, what it was for, and the closest name."""


def _did_you_mean(path: str, found: Any = None, at: int | None = None,
                  candidates: Callable[[], Iterable[str]] | None = None) -> str:
    """``"; did you mean '<path>'?"`` for an import path that does not resolve, or "" when nothing is close.

    ``found``: the object the path resolved to up to part ``at`` (which it lacks): the closest of its public names
    (and, for a package, of its submodules) replaces that part. Else the path among ``candidates`` (import paths)
    whose last part is closest to the path's last part.
    """
    parts = path.split(".") if isinstance(path, str) else []
    if found is not None and at is not None:
        names = {n for n in dir(found) if not n.startswith("_")}
        if hasattr(found, "__path__"):  # a package: its submodules are names too, imported or not
            names |= {m.name for m in pkgutil.iter_modules(found.__path__)}
        close = difflib.get_close_matches(parts[at], sorted(names), n=1)
        if close:
            return f"; did you mean {'.'.join(parts[:at] + close + parts[at + 1:])!r}?"
    if candidates is not None and parts:
        known = {p.rpartition(".")[2].lower(): p for p in candidates()}
        close = difflib.get_close_matches(parts[-1].lower(), list(known), n=1)
        if close:
            return f"; did you mean {known[close[0]]!r}?"
    return ""


def import_object(path: str, what: str, candidates: Callable[[], Iterable[str]] | None = None) -> Any:
    """The object at ``"pkg.module.attr[.attr...]"``: the longest importable module prefix, then attributes.

    ``what`` names it in errors (``"reward function"``, ``"tool"``, an option); ``candidates``: import paths to
    suggest from when the path's module cannot be found (the package's own reward classes, for one).
    Raises :class:`ImportPathError`."""
    if not isinstance(path, str) or "." not in path.strip("."):
        raise ImportPathError(f"{what} {path!r}: expected an import path 'package.module.name'"
                              + _did_you_mean(path, candidates=candidates))
    if (hint := renamed_hint(path)) is not None:  # an old module of the package (gone): its new path, in one line
        raise ImportPathError(f"{what} {hint}")
    parts = path.split(".")
    errors = []
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only "this very module is missing" means: try a shorter prefix. A missing
            # dependency *inside* an existing module is the user's real error.
            if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
                errors.append(err)
                continue
            raise ImportPathError(f"{what} {path!r} cannot be imported: {err}") from err
        except Exception as err:  # the module itself failed while executing
            raise ImportPathError(f"{what} {path!r}: importing {module_name!r} failed: {err!r}") from err
        for at in range(cut, len(parts)):
            try:
                obj = getattr(obj, parts[at])
            except AttributeError as err:
                raise ImportPathError(f"{what} {path!r} cannot be imported: {err}"
                                      + _did_you_mean(path, obj, at, candidates)) from err
        return obj
    missing = errors[-1].name if errors else parts[0]
    raise ImportPathError(
        f"{what} {path!r} cannot be imported: no module named {missing!r} (searched the working directory "
        f"{os.getcwd()}, PYTHONPATH and the installed packages; run from the folder that holds {missing}.py "
        "or add its folder to PYTHONPATH)" + _did_you_mean(path, candidates=candidates)
    ) from None
