"""Every shipped config parses: ``rloo-lightning fit --config <yaml> --print_config`` exits 0, on CPU.

``--print_config`` parses and validates the whole configuration (class paths resolved, option names and
types checked) without instantiating the trainer, the model or the data, so GPU, DeepSpeed and SLURM configs
parse here too. A config without a ``model:`` section is an overlay (``configs/callbacks.yaml``, the
strategy configs): it is given after ``configs/quickstart.yaml``, as its header says to use it. Option names
are never spelled here: the check is that every value the file sets shows up in the printed configuration.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from cli_harness import CLI, CONFIGS, HELPERS_DIR, Proc, make_env

pytestmark = pytest.mark.slow  # two subprocesses, started together

BASE = CONFIGS / "quickstart.yaml"
YAMLS = sorted(CONFIGS.glob("*.yaml"))
# the installed entry point (what users type), else the module
ENTRY = shutil.which("rloo-lightning", path=str(Path(sys.executable).parent))
COMMAND = [ENTRY] if ENTRY else CLI


def _load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f) or {}


def _args(path: Path) -> list[str]:
    configs = [path] if "model" in _load(path) or path == BASE else [BASE, path]
    return ["fit", *(arg for c in configs for arg in ("--config", str(c))), "--print_config"]


@pytest.fixture(scope="module")
def printed(tmp_path_factory, _cache_dir) -> dict[str, dict]:
    """``{config name: {"rc", "stdout", "stderr", "how"}}``. The base config through the installed entry point,
    as a user types it; the others in one process that calls the entry point's ``main`` for each (what each
    config costs then is its parse, not a process start-up with every import)."""
    env = make_env(_cache_dir)
    root = tmp_path_factory.mktemp("print_config")
    others = [p for p in YAMLS if p != BASE]
    base = Proc("base", [*COMMAND, *_args(BASE)], root, env, timeout=300)
    rest = Proc("rest", [sys.executable, str(HELPERS_DIR / "print_configs.py"), json.dumps([_args(p) for p in others])],
                root, env, timeout=300)
    base.wait()
    rest.check()
    out = {BASE.name: {"rc": base.rc, "stdout": base.stdout, "stderr": base.stderr, "how": base.explain()}}
    for path, result in zip(others, json.loads(rest.stdout)):
        out[path.name] = {**result, "how": f"main({_args(path)}) rc={result['rc']}\n{result['stderr'][-3000:]}"}
    return out


def test_every_config_is_tested():
    assert len(YAMLS) >= 8 and BASE in YAMLS, YAMLS


def _same(expected, got) -> bool:
    """A value of the file as printed: numbers by value (YAML reads ``1e-6`` as a string), import paths by name
    (jsonargparse prints the shortest path that imports the class)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        return all(k in got and _same(v, got[k]) for k, v in expected.items() if k != "class_path") and (
            "class_path" not in expected
            or str(got.get("class_path", "")).rsplit(".", 1)[-1] == str(expected["class_path"]).rsplit(".", 1)[-1])
    if isinstance(expected, list) and isinstance(got, list):
        return len(expected) <= len(got) and all(any(_same(e, g) for g in got) for e in expected)
    if expected == got:
        return True
    if isinstance(expected, str) and isinstance(got, str) and re.fullmatch(r"[\w.]+\.\w+", expected):
        return got.rsplit(".", 1)[-1] == expected.rsplit(".", 1)[-1]  # an import path, as printed: shortened
    try:
        return math.isclose(float(expected), float(got), rel_tol=1e-12)
    except (TypeError, ValueError):
        return False


def _missing(expected: dict, got: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in expected.items():
        where = f"{prefix}{key}"
        if key not in got:
            out.append(f"{where}: not printed")
        elif isinstance(value, dict) and isinstance(got[key], dict) and "class_path" not in value:
            out.extend(_missing(value, got[key], where + "."))
        elif not _same(value, got[key]):
            out.append(f"{where}: file {value!r}, printed {got[key]!r}")
    return out


@pytest.mark.parametrize("name", [p.name for p in YAMLS])
def test_config_parses_with_print_config(printed, name):
    result = printed[name]
    assert result["rc"] == 0, result["how"]
    config = yaml.safe_load(result["stdout"])
    assert isinstance(config, dict) and {"trainer", "model", "data"} <= config.keys(), result["how"]
    missing = _missing(_load(CONFIGS / name), config)
    assert not missing, f"{name}: values of the file not in the printed config: {missing}\n{result['how']}"
