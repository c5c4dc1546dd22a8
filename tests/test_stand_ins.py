"""The stand-ins that tests, studies and benchmarks put in place of `RLOOModule`'s methods (a `log` that records
nothing, a `sample` that returns a stored rollout) keep the real methods' signatures: a renamed method or a new
parameter fails here, in the main suite, instead of in a study that nothing runs (issue 61: the TRL parity study's
`sample` lacked `in_step` and no test saw it). `benchmarks.bench_common.stand_in` checks the same when it installs a
stand-in; this test also reads the assignments that do not go through it (`module.log = lambda *a, **kw: None`)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from benchmarks.bench_common import stand_in, stand_in_problems
from rloo_lightning import RLOOModule

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tests", "experiments", "benchmarks")
# targets of an assignment to a name that `RLOOModule` also has, which are not the module: a layer's `forward`, a
# callback's hook, the episode sampler's `sample`; and this file's own examples
NOT_THE_MODULE = {"mlp", "probe", "sampler_py.EpisodeSampler", "real", "_Real", "_Real()"}


class _Real:
    def sample(self, batch, k, seed, greedy=False, in_step=False):
        return "real"


def test_a_stand_in_missing_a_parameter_fails_loudly():
    with pytest.raises(TypeError, match="takes no keyword 'in_step'"):
        stand_in(_Real(), "sample", lambda batch, k, seed, greedy=False: None)
    with pytest.raises(TypeError, match="has 's' where 'seed' is"):
        stand_in(_Real(), "sample", lambda batch, k, s, greedy=False, in_step=False: None)
    with pytest.raises(TypeError, match="requires 'greedy', which has a default"):
        stand_in(_Real(), "sample", lambda batch, k, seed, greedy, in_step=False: None)
    with pytest.raises(TypeError, match="requires 'extra'"):
        stand_in(_Real(), "sample", lambda batch, k, seed, extra, greedy=False, in_step=False: None)


def test_a_stand_in_for_a_method_that_is_gone_fails_loudly():
    with pytest.raises(AttributeError, match="has no method 'sample_rollout'"):
        stand_in(_Real(), "sample_rollout", lambda *a, **kw: None)


def test_a_matching_stand_in_is_installed(monkeypatch):
    real = _Real()
    stand_in(real, "sample", lambda batch, k, seed, greedy=False, in_step=False: "stand-in")
    assert real.sample(1, 2, 3, in_step=True) == "stand-in"
    stand_in(real, "sample", lambda *a, **kw: "again")  # checked against the class's method, not the first stand-in
    assert real.sample(1, 2, 3) == "again"
    stand_in(_Real, "sample", lambda self, *a, **kw: "patched", monkeypatch=monkeypatch)  # on the class: self first
    assert _Real().sample(1, 2, 3) == "patched"
    monkeypatch.undo()
    assert _Real().sample(1, 2, 3) == "real"


def _signature(args: ast.arguments) -> inspect.Signature:
    """A lambda's or a def's signature from its source (defaults stand for themselves: only their presence counts)."""
    P, has = inspect.Parameter, object()
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [P(a.arg, P.POSITIONAL_ONLY if a in args.posonlyargs else P.POSITIONAL_OR_KEYWORD,
                default=P.empty if d is None else has) for a, d in zip(positional, defaults)]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else has)
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _stand_ins():
    """``(where, method name, target expression, signature)`` of every stand-in for a method of `RLOOModule` in
    FOLDERS: ``x.name = <lambda or def>``, ``monkeypatch.setattr(x, "name", ...)`` and ``stand_in(x, "name", ...)``."""
    methods = {n for n, v in inspect.getmembers(RLOOModule) if callable(v) and not n.startswith("__")}
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            defs = {}
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs.setdefault(node.name, []).append(node)
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0],
                                                                                          ast.Attribute):
                    target, name, value = node.targets[0].value, node.targets[0].attr, node.value
                elif (isinstance(node, ast.Call) and len(node.args) >= 3 and isinstance(node.args[1], ast.Constant)
                      and ((isinstance(node.func, ast.Attribute) and node.func.attr == "setattr")
                           or (isinstance(node.func, ast.Name) and node.func.id == "stand_in"))):
                    target, name, value = node.args[0], node.args[1].value, node.args[2]
                else:
                    continue
                if name not in methods or ast.unparse(target) in NOT_THE_MODULE:
                    continue
                if isinstance(value, ast.Lambda):
                    signature = _signature(value.args)
                elif isinstance(value, ast.Name) and value.id in defs:
                    # the def of that name nearest before the assignment
                    before = [d for d in defs[value.id] if d.lineno < node.lineno] or defs[value.id]
                    signature = _signature(before[-1].args)
                else:
                    continue  # not a function written here (a saved original put back, a Mock): nothing to compare
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", name, ast.unparse(target), signature))
    return found


def test_every_stand_in_of_a_module_method_keeps_its_signature():
    found = _stand_ins()
    assert any(where.startswith("experiments/trl_parity/parity_fed_steps.py") and name == "sample"
               for where, name, _, _ in found), "the scan no longer sees the TRL parity study's stand-in"
    problems = []
    for where, name, target, signature in found:
        def fn(*a, **kw):
            pass

        fn.__signature__ = signature
        real = getattr(RLOOModule, name)
        if target != "RLOOModule":  # on an instance: the method bound, without self
            real = real.__get__(object.__new__(RLOOModule), RLOOModule)
        for problem in stand_in_problems(real, fn):
            problems.append(f"{where}: stand-in for RLOOModule.{name}{inspect.signature(real)} {problem}")
    assert not problems, "\n".join(problems)
