"""benchmarks/async_step.py with ``--engines``: a server configuration's summary takes its push from the trainer's wait
for the weight sync, the colocated engine's keeps its own; a server that does not start is one error with its log;
and, with vLLM, the smallest run against a server it starts records a step time, the syncs and the start-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import async_step
from vllm_helpers import vllm_test


def _steps(**columns) -> list[dict]:
    """Four steps (one warm-up, two timed, the extra last one) with these per-step values."""
    steps = []
    for i in range(4):
        step = {"step": i, "t_start": float(i), "hooks_s": 0.9, "interval_s": 1.0 if i < 3 else None,
                "generation_s": 0.5, "tokens": 8, "rollout_wait_s": None, "engine_idle_s": None, "staleness": None,
                "queue_depth": None, "mismatch_kl_k3": 0.0}
        step.update({key: values[i] for key, values in columns.items()})
        steps.append(step)
    return steps


def test_a_server_configuration_takes_its_push_from_the_sync_wait_and_reports_the_syncs():
    result = {"steps": _steps(weight_sync_s=[2.0, 0.1, 0.3, 0.2], weight_sync_mb=[0.5] * 4,
                              weight_sync_wait_s=[2.5, 0.2, 0.4, 0.3], server_retries=[0.0, 1.0, 0.0, 0.0]),
              "engine": {"class": "VLLMServerEngine", "pushes": None, "push_s": [], "child": {}}}
    summary = async_step._summary(result, warmup=1, steps=2, engine_name="server")
    assert summary["push_s"] == pytest.approx(0.3)  # the timed steps' median wait, not the warm-up's first sync
    assert summary["weight_sync_s"] == pytest.approx(0.2) and summary["weight_sync_mb"] == pytest.approx(0.5)
    assert summary["server_retries"] == 1 and summary["step_s"] == pytest.approx(1.0)
    assert summary["engine_peak_rss_mb"] is None and list(summary)[-1] == "per_step"
    assert summary["per_step"]["weight_sync_wait_s"] == [2.5, 0.2, 0.4, 0.3]


def test_a_colocated_configuration_keeps_the_engines_pushes_and_its_keys():
    result = {"steps": _steps(weight_sync_s=[0.5, 0.02, 0.04, 0.03], weight_sync_mb=[4.0] * 4),
              "engine": {"push_s": [1.0, 0.02, 0.04, 0.03], "child": {"peak_rss_mb": 100.0}}}
    summary = async_step._summary(result, warmup=1, steps=2)
    assert summary["push_s"] == pytest.approx(0.03)  # the first push left out, as before
    # the colocated engine logs its pushes' seconds and megabytes too; retries are the server's alone
    assert summary["weight_sync_s"] == pytest.approx(0.03) and summary["weight_sync_mb"] == pytest.approx(4.0)
    assert "server_retries" not in summary
    assert async_step._name("colocated", 2, 1, 0) == "split2x1_k0"  # the published records' keys
    assert async_step._name("server", 2, 1, 0) == "server_split2x1_k0"


@pytest.mark.slow
def test_a_server_that_does_not_start_is_one_error_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "test-key")
    with pytest.raises(RuntimeError, match="the vLLM server .* exited") as caught:
        with async_step._server(str(tmp_path / "no_such_model"), None, "float32", 1, tmp_path, "server_1x1",
                                timeout=120):
            pass
    assert str(tmp_path / "server_1x1.log") in str(caught.value)


@vllm_test
def test_the_smallest_run_against_a_server_records_its_steps_syncs_and_startup(tmp_path):
    from cli_harness import REPO, make_env

    out = tmp_path / "async_step.json"
    subprocess.run([sys.executable, "-m", "benchmarks", "async_step", "--smallest", "--engines", "server",
                    "--load-wait", "0", "--out", out], cwd=REPO, env=make_env(tmp_path / "cache"), check=True,
                   capture_output=True, timeout=900)
    record = json.loads(out.read_text())
    assert record["settings"]["engines"] == ["server"]
    for lag in (0, 1):
        entry = record["results"][f"server_split1x1_k{lag}"]
        assert entry["engine"] == "server" and "error" not in entry, entry
        assert entry["step_s"] > 0 and entry["push_s"] > 0 and entry["server_start_s"] > 0
        assert entry["weight_sync_mb"] > 0 and entry["server_retries"] == 0
