"""The tests' way to the studies' and benchmarks' scripts (``experiments/<study>/*.py``, ``benchmarks/*.py``).

* :func:`load_script`: a script as a module. The benchmarks and the studies are packages of the repository's root
  (``benchmarks``, ``experiments.<study>``; pytest's ``pythonpath`` puts the root on ``sys.path``): a script is
  imported under its dotted name, the one it runs as (``python -m experiments.learning_parity.learning_parity``)
  and the one another study imports it by, so that all of them are one module. A script outside them
  (``scripts/*.py``) is loaded from its file under its stem.
* :class:`InProcess`: ``subprocess.run`` for what a study starts (the CLI, its own script, ``python -c``), run in this
  process, in the command's working directory and environment: a subprocess costs several seconds of imports, and a
  smoke test of a study needs its logic, not a process of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/helpers/ -> the root

__all__ = ["REPO", "load_script", "InProcess"]


def load_script(relative: str):
    """``relative`` (e.g. ``experiments/learning_parity/learning_parity.py``) as a module, loaded once."""
    path = (REPO / relative).resolve()
    if (path.parent / "__init__.py").exists():  # a package's module: experiments.learning_parity.learning_parity
        return importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
    name = path.stem
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "") or "").resolve() == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class InProcess:
    """A stand-in for ``subprocess.run`` that runs, in this process, ``python -m rloo_lightning ...`` and
    ``rloo-lightning ...`` (:func:`rloo_lightning.cli.main`), ``python <one of scripts> ...`` and ``python -m <one of
    scripts' names> ...`` (its ``main``) and ``python -c CODE``; any other command runs for real. The command's
    ``cwd`` and ``env`` apply while it runs, and what a run changes for the whole process (the working directory, the
    environment, ``sys.path``, torch's thread count, the SIGTERM handler and the warnings' display the CLI installs)
    is put back after it. ``commands`` lists what ran here."""

    def __init__(self, scripts=()) -> None:
        self.scripts = {Path(m.__file__).resolve(): m for m in scripts}
        self.commands: list[list[str]] = []
        self._run = subprocess.run

    def install(self, monkeypatch) -> "InProcess":
        monkeypatch.setattr(subprocess, "run", self)
        return self

    def _target(self, cmd: list[str]):
        cmd = [str(c) for c in cmd]
        if Path(cmd[0]).name == "rloo-lightning":
            return _cli, cmd[1:]
        if cmd[0] != sys.executable or len(cmd) < 2:
            return None, None
        if cmd[1:3] == ["-m", "rloo_lightning"]:
            return _cli, cmd[3:]
        if cmd[1] == "-c":
            return (lambda args: exec(args[0], {"__name__": "__main__"})), cmd[2:]
        if cmd[1] == "-m":
            script = next((m for m in self.scripts.values() if m.__name__ == cmd[2]), None)
            return (script.main, cmd[3:]) if script is not None else (None, None)
        script = self.scripts.get(Path(cmd[1]).resolve())
        return (script.main, cmd[2:]) if script is not None else (None, None)

    def __call__(self, cmd, *args, check=False, cwd=None, env=None, stdout=None, stderr=None, capture_output=False,
                 text=False, **kwargs):
        target, argv = self._target(list(cmd))
        if target is None:
            return self._run(cmd, *args, check=check, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                             capture_output=capture_output, text=text, **kwargs)
        import torch

        self.commands.append([str(c) for c in cmd])
        saved = (os.getcwd(), dict(os.environ), list(sys.path), torch.get_num_threads(),
                 signal.getsignal(signal.SIGTERM), warnings.showwarning)
        out = io.StringIO()
        code = 0
        try:
            if cwd is not None:
                os.chdir(cwd)
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            capture = capture_output or stdout == subprocess.PIPE
            with contextlib.redirect_stdout(out) if capture else contextlib.nullcontext():
                try:
                    target(argv)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    if exc.code not in (None, 0) and not isinstance(exc.code, int):
                        sys.stderr.write(f"{exc.code}\n")
        finally:
            os.chdir(saved[0])
            os.environ.clear()
            os.environ.update(saved[1])
            sys.path[:] = saved[2]
            torch.set_num_threads(saved[3])
            signal.signal(signal.SIGTERM, saved[4])
            warnings.showwarning = saved[5]
        printed = (out.getvalue() if text else out.getvalue().encode()) if capture else None
        result = subprocess.CompletedProcess(cmd, code, printed, ("" if text else b"") if capture else None)
        if check and code:
            raise subprocess.CalledProcessError(code, cmd, result.stdout, result.stderr)
        return result


def _cli(args: list[str]) -> None:
    from rloo_lightning.cli import main

    main(args)
