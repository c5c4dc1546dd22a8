"""The command's exit (``cli.run``): the command's status unchanged, the garbage of the run collected, the rest
frozen out of the interpreter's last collections; ``main`` called in a process that goes on leaves the collector
alone."""

from __future__ import annotations

import gc
import tomllib

import pytest
from cli_harness import REPO

from rloo_lightning import cli


class _Finalized:
    """An object in a reference cycle whose finalizer records that it ran."""

    seen: list[str] = []

    def __init__(self, name: str) -> None:
        self.name, self.me = name, self

    def __del__(self) -> None:
        _Finalized.seen.append(self.name)


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # what the test froze goes back to the collector of this (ongoing) process


@pytest.mark.parametrize("code", [0, 1, 143])
def test_run_keeps_mains_status_finalizes_its_garbage_and_freezes_the_rest(monkeypatch, unfrozen, code):
    _Finalized.seen.clear()

    def main():
        _Finalized(f"garbage of {code}")  # unreachable at once, freed only by a collection
        raise SystemExit(code)

    monkeypatch.setattr(cli, "main", main)
    gc.unfreeze()
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == code
    assert _Finalized.seen == [f"garbage of {code}"]  # collected before the freeze, as any exit would
    assert gc.get_freeze_count() > 0


def test_an_error_in_main_leaves_run_with_its_traceback(monkeypatch, unfrozen):
    def main():
        raise ValueError("from main")

    monkeypatch.setattr(cli, "main", main)
    with pytest.raises(ValueError, match="from main"):
        cli.run()


def test_main_called_in_process_does_not_freeze(monkeypatch):
    gc.unfreeze()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert gc.get_freeze_count() == 0


def test_the_command_and_python_m_run_run():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rloo-lightning"] == "rloo_lightning.cli:run"
    assert "run()" in (REPO / "rloo_lightning" / "__main__.py").read_text()
