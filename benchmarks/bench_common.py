"""Helpers shared by the benchmarks (``benchmarks/bench.py`` and its systems ``bench_trl.py``, ``bench_bare.py``; the
phase benchmarks) and by the experiments' scripts.

Each system of the step benchmark runs in its own process, started by ``benchmarks/bench.py`` with ``--spec
spec.json --out result.json``. The spec fixes the work (model, prompts, reward, sizes, sampling, dtype, threads,
seed, steps); the result holds one entry per step and the process's peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def child_env(threads: int) -> dict[str, str]:
    """Environment of every child: offline, same thread count for torch, OpenMP and MKL, and the repository's root
    on the import path (the children are the lab's modules, ``python -m benchmarks.bench_trl``, or fits whose
    callbacks live there, in a working directory of their own)."""
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    })
    return env


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MiB.

    Not ``rloo_lightning.runtime.timing.peak_rss_mb``: importing the package (and Lightning) into TRL's and the bare
    loop's processes would add to the very peak measured here.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def read_spec(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _spec_out(argv: list[str] | None):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def child_args(argv: list[str] | None = None) -> tuple:
    """A benchmark child's ``--spec`` / ``--out`` arguments and its spec, with its thread count set."""
    args = _spec_out(argv)
    spec = read_spec(args.spec)
    set_threads(spec["threads"])
    return args, spec


def run_child_verb(argv: list[str], verbs: dict) -> bool:
    """When ``argv`` starts with one of ``verbs`` (a script's child entry points, ``{"_a": run_a}``), run it with
    the child's ``--spec`` and ``--out`` paths and return True; False otherwise (the parent's own arguments)."""
    if not argv or argv[0] not in verbs:
        return False
    args = _spec_out(argv[1:])
    verbs[argv[0]](args.spec, args.out)
    return True


def local_model_dir(parser, model: str | None, why: str = "") -> str | None:
    """``--model`` as a local directory: ``pkg:<package>`` resolved to the installed package's (its GGUF file), any
    other value that is not a directory refused through ``parser`` (None: the benchmark builds its own model)."""
    if model is not None and model.startswith("pkg:"):
        from rloo_lightning.models import resolve_model_path

        model = resolve_model_path(model)
    if model is not None and not Path(model).is_dir():
        parser.error(f"--model must be a local directory{why}: {model!r}")
    return model


def write_result(path: str, result: dict) -> None:
    import torch

    result.setdefault("peak_rss_mb", peak_rss_mb())
    result.setdefault("threads", torch.get_num_threads())
    Path(path).write_text(json.dumps(result, indent=1))


def emit_json(results: dict, out: Path | str | None) -> None:
    """A measurement script's results: printed as JSON, and written to ``out`` when given."""
    text = json.dumps(results, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def record_json(record, indent: int = 1, _level: int = 0) -> str:
    """``record`` as JSON for a file kept in the repository: nested objects indented as ``json.dumps(indent=1)``
    does, but a list of numbers or strings on one line (a per-step curve or a prompt's 0/1 scores, one entry a
    line, made the records several times their content), and a list of such lists one of them a line."""
    def flat(value) -> bool:
        return not isinstance(value, (dict, list)) or (
            isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value))

    if flat(record):
        return json.dumps(record, separators=(",", ":") if isinstance(record, list) else (", ", ": "))
    pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
    if isinstance(record, dict):
        if not record:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {record_json(v, indent, _level + 1)}" for k, v in record.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    items = [f"{inner}{record_json(v, indent, _level + 1)}" for v in record]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


def scalar_curves(folder: Path, tags: list[str]) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` in step order for each of ``tags`` the log folder has."""
    from rloo_lightning.runtime.tensorboard_logs import read_scalars  # here: a parent that runs no model stays light

    scalars = read_scalars(folder)
    return {t: sorted(scalars[t].items()) for t in tags if t in scalars}


def train_rows(spec: dict) -> list[dict]:
    """The training prompts: the embedded task's rows, as PromptDataModule(task=...) makes them."""
    from rloo_lightning.tasks import get_task

    return get_task(spec["task"]).make_rows(spec["num_train_rows"], spec["seed"])


def reward_fn(spec: dict):
    """The task's reward function (the quickstart's ``rewards.funcs``), by import path."""
    import importlib

    module, _, name = spec["reward"].rpartition(".")
    return getattr(importlib.import_module(module), name)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a prompt as PromptDataModule builds them (``use_chat_template: auto``, no system prompt)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


class Clock:
    """perf_counter with a CUDA sync when CUDA is in use."""

    @staticmethod
    def now() -> float:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()


def task_prompts(tokenizer, num_prompts: int, k: int, task: str = "reverse"):
    """The first ``num_prompts`` rows of an embedded task as a rollout's prompts: ``(ids [N, P], mask [N, P],
    prompt_ids [N*k, P], prompt_mask [N*k, P])``, left-padded, each prompt repeated k times."""
    import torch

    from rloo_lightning.tasks import get_task

    encoded = [encode_prompt(tokenizer, r["prompt"]) for r in get_task(task).make_rows(num_prompts, 0)]
    width = max(map(len, encoded))
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1
    return ids, mask, ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)


def rollout_parser(description: str, reps: int):
    """The options the phase scripts share: the model and the rollout's shape (the benchmark's by default), and
    where to write the JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="a Hugging Face directory or tiny:<task>")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser


def stand_in_problems(real, fn) -> list[str]:
    """How a call that ``real`` accepts could fail on ``fn``, or ``[]``: every parameter of ``real`` taken by ``fn``
    the same way (at the same position under the same name, or by keyword; a default where ``real`` has one, or
    ``*args`` / ``**kwargs`` to take it), and no parameter that ``fn`` requires unknown to ``real``."""
    import inspect

    P = inspect.Parameter
    theirs, ours = inspect.signature(fn).parameters.values(), inspect.signature(real).parameters.values()
    positional = [q for q in theirs if q.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    by_name = {q.name: q for q in theirs if q.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    var_pos = any(q.kind == P.VAR_POSITIONAL for q in theirs)
    var_kw = any(q.kind == P.VAR_KEYWORD for q in theirs)
    problems, taken, position = [], set(), 0
    for p in ours:
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if not (var_pos if p.kind == P.VAR_POSITIONAL else var_kw):
                problems.append(f"takes no {'*' if p.kind == P.VAR_POSITIONAL else '**'}{p.name}")
            continue
        q = None
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            if position < len(positional):
                q = positional[position]
                if p.kind == P.POSITIONAL_OR_KEYWORD and q.name != p.name:
                    problems.append(f"has {q.name!r} where {p.name!r} is (argument {position + 1})")
            elif not var_pos:
                problems.append(f"takes no argument {position + 1} ({p.name!r})")
            position += 1
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY):
            q = q or by_name.get(p.name)
            if q is None and not var_kw:
                problems.append(f"takes no keyword {p.name!r}")
        if q is not None:
            taken.add(q.name)
            if p.default is not P.empty and q.default is P.empty:
                problems.append(f"requires {q.name!r}, which has a default in the real method")
    problems += [f"requires {q.name!r}, which the real method does not have" for q in theirs
                 if q.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and q.default is P.empty and q.name not in taken]
    return problems


def stand_in(owner, name: str, fn, monkeypatch=None):
    """Puts ``fn`` in place of the method ``name`` of ``owner`` (an object: for it alone, the method bound; a class:
    for all its instances, ``self`` first) and returns it, after checking that the method exists (a renamed or
    removed one would leave the stand-in an attribute nothing calls) and that ``fn`` accepts every call the real
    method does (:func:`stand_in_problems`): a study's or a test's stand-in fails here, loudly, when the method's
    signature changes, instead of in a run nothing checks. With ``monkeypatch`` (pytest's), set through it."""
    import inspect

    cls = owner if inspect.isclass(owner) else type(owner)
    real = inspect.getattr_static(cls, name, None)  # the class's own: not an earlier stand-in on the object
    if real is None or not callable(getattr(cls, name)):
        raise AttributeError(f"stand-in for {cls.__qualname__}.{name}: {cls.__qualname__} has no method {name!r}")
    real = getattr(cls, name) if inspect.isclass(owner) else getattr(cls, name).__get__(owner, cls)
    problems = stand_in_problems(real, fn)
    if problems:
        raise TypeError(f"stand-in for {cls.__qualname__}.{name}{inspect.signature(real)}: "
                        f"{getattr(fn, '__qualname__', fn)}{inspect.signature(fn)} " + "; ".join(problems))
    if monkeypatch is not None:
        monkeypatch.setattr(owner, name, fn)
    else:
        setattr(owner, name, fn)
    return fn
