"""``experiments/learning_parity/learning_parity.py``'s held-out prompts and summary when a seed is added to a finished
record: the new seed's training rows may hold a few of the prompts the first runs were scored on, and those stop
counting."""

from __future__ import annotations

import sys

import pytest
from study_helpers import load_script

lp = load_script("experiments/learning_parity/learning_parity.py")

ROWS = 2000  # the script's num_train_rows


def test_held_out_indices_drop_exactly_the_prompts_a_new_seed_trains_on():
    from rloo_lightning.tasks import get_task

    rows = lp.held_out_rows(200, [0, 1], ROWS, "arithmetic")
    assert lp.held_out_indices(rows, [0, 1], ROWS, "arithmetic") == list(range(len(rows)))
    keep = lp.held_out_indices(rows, [0, 1, 2], ROWS, "arithmetic")
    seed2 = {r["prompt"] for r in get_task("arithmetic").make_rows(ROWS, 2)}
    dropped = [i for i in range(len(rows)) if i not in keep]
    assert dropped, "seed 2 shares no prompt with these rows: the test would not test the drop"
    assert all(rows[i]["prompt"] in seed2 for i in dropped)
    assert not any(rows[i]["prompt"] in seed2 for i in keep)


def _run(system: str, seed: int, finals: list[int]) -> dict:
    snapshots = [{"step": 10, "train_s": 5.0, "correct": [0] * len(finals)},
                 {"step": 20, "train_s": 10.0, "correct": finals}]
    return {"system": system, "seed": seed, "snapshots": snapshots, "startup_s": 1.0, "peak_rss_mb": 100.0,
            "train_reward": [0.0, 1.0]}


def test_summary_counts_only_the_kept_prompts():
    start = {"correct": [0, 0, 1, 0]}
    runs = {"a_seed0": _run("a", 0, [1, 1, 1, 0]), "b_seed0": _run("b", 0, [1, 0, 1, 1])}
    everything = lp.summarize(runs, start, [0, 1, 2, 3])
    assert everything["held_out_prompts"] == 4
    assert everything["difference_a_minus_b"]["mean"] == 0.0
    kept = lp.summarize(runs, start, [0, 1, 2])  # prompt 3 is in a new seed's training rows
    assert kept["held_out_prompts"] == 3
    assert kept["step0_accuracy"] == pytest.approx(1 / 3, abs=1e-4)
    a, b = (kept["systems"][s]["runs"][0] for s in "ab")
    assert (a["final_accuracy"], b["final_accuracy"]) == (1.0, pytest.approx(2 / 3, abs=1e-4))
    assert [c["accuracy"] for c in a["curve"]] == [pytest.approx(1 / 3, abs=1e-4), 0.0, 1.0]
    assert kept["difference_a_minus_b"]["mean"] == pytest.approx(1 / 3, abs=1e-4)
    assert kept["systems"]["a"]["improvement_over_step0"]["mean"] == pytest.approx(2 / 3, abs=1e-4)


def test_t_quantile_matches_the_tables():
    # two-sided 95 % points of Student's t (any statistics table)
    for df, t in [(1, 12.706), (5, 2.571), (10, 2.228), (30, 2.042), (1000, 1.962)]:
        assert lp._t_quantile(0.975, df) == pytest.approx(t, abs=1e-3)


def test_run_level_interval_and_per_step_difference():
    start = {"correct": [0, 0, 0, 0]}
    finals_a = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]  # final accuracies 0.5, 0.75, 0.25
    finals_b = [[1, 1, 1, 1], [1, 1, 1, 0]]  # 1.0, 0.75
    runs = {f"a_seed{i}": _run("a", i, f) for i, f in enumerate(finals_a)}
    runs.update({f"b_seed{i}": _run("b", i, f) for i, f in enumerate(finals_b)})
    out = lp.summarize(runs, start, [0, 1, 2, 3])
    w = out["difference_by_run"]
    # mean 0.5 - 0.875; variances 0.0625 and 0.03125 over 3 and 2 runs
    va, vb = 0.0625 / 3, 0.03125 / 2
    assert w["mean"] == pytest.approx(-0.375, abs=1e-4)
    assert w["se"] == pytest.approx((va + vb) ** 0.5, abs=1e-4)
    assert w["df"] == pytest.approx((va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 1), abs=0.05)
    half = lp._t_quantile(0.975, (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 1)) * (va + vb) ** 0.5
    assert w["ci95"] == [pytest.approx(-0.375 - half, abs=1e-4), pytest.approx(-0.375 + half, abs=1e-4)]
    assert [d["step"] for d in out["difference_by_step"]] == [0, 10, 20]
    assert [d["mean"] for d in out["difference_by_step"]] == [0.0, 0.0, pytest.approx(-0.375, abs=1e-4)]
    one_each = lp.summarize({"a_seed0": runs["a_seed0"], "b_seed0": runs["b_seed0"]}, start, [0, 1, 2, 3])
    assert "difference_by_run" not in one_each and "spread_by_run" not in one_each  # no spread to estimate


def test_spread_is_brown_forsythe_against_every_relabelling():
    """The spread comparison's p, from random relabellings, is the exact permutation p (all 70 relabellings of
    4 + 4 runs) up to its sampling error; runs alike on both sides give p = 1, one side scattered and the other
    constant a p near its exact 2/12870."""
    import itertools
    import statistics

    a, b = [0.0, 1.0, 2.0, 3.5], [1.4, 1.5, 1.6, 1.2]
    dev = [abs(x - statistics.median(a)) for x in a] + [abs(x - statistics.median(b)) for x in b]
    observed = abs(statistics.fmean(dev[:4]) - statistics.fmean(dev[4:]))
    splits = list(itertools.combinations(range(8), 4))
    exact = sum(abs(statistics.fmean(dev[i] for i in s) - statistics.fmean(dev[i] for i in range(8) if i not in s))
                >= observed - 1e-12 for s in splits) / len(splits)
    out = lp._spread(a, b)
    assert 0.02 < exact < 0.5 and out["p_brown_forsythe"] == pytest.approx(exact, abs=0.02)
    assert out["sd_a"] == pytest.approx(statistics.stdev(a), abs=1e-4) and out["runs"] == [4, 4]
    assert lp._spread(a, b) == out  # seeded: the record reproduces
    assert lp._spread([0.7, 0.7], [0.7, 0.7])["p_brown_forsythe"] == 1.0
    assert lp._spread([0.0, 1.0] * 4, [0.5] * 8)["p_brown_forsythe"] < 0.002


def test_sampler_diagnostic_runs_sit_beside_the_two_systems():
    start = {"correct": [0, 0, 0, 0]}
    finals = {"a": [[1, 1, 0, 0], [1, 0, 0, 0]], "b": [[1, 1, 1, 1], [1, 1, 1, 0]], "h": [[1, 1, 1, 0], [1, 1, 0, 0]]}
    runs = {f"{s}_seed{i}": _run(s, i, f) for s, fs in finals.items() for i, f in enumerate(fs)}
    out = lp.summarize(runs, start, [0, 1, 2, 3])
    without_h = lp.summarize({k: v for k, v in runs.items() if v["system"] != "h"}, start, [0, 1, 2, 3])
    # h changes nothing of the stated comparison
    for key in ("difference_a_minus_b", "difference_by_run", "difference_by_step"):
        assert out[key] == without_h[key]
    assert out["systems"]["h"]["final_accuracy_mean"] == pytest.approx(0.625, abs=1e-4)
    assert out["difference_h_minus_a_by_run"]["mean"] == pytest.approx(0.625 - 0.375, abs=1e-4)
    assert out["difference_h_minus_b_by_run"]["mean"] == pytest.approx(0.625 - 0.875, abs=1e-4)
    assert "difference_h_minus_a_by_run" not in without_h
    table = lp.markdown_of({"summary": out, "eval_steps": [10, 20]})
    assert "HF generate sampler minus TRL RLOOTrainer" in table and "HF generate sampler minus rloo_lightning" in table


def test_final_step_only_reports_no_time_to_accuracy():
    start = {"correct": [0, 0, 0, 0]}
    final_only = {"system": "a", "seed": 0, "snapshots": [{"step": 50, "train_s": 9.0, "correct": [1, 1, 0, 0]}],
                  "startup_s": 1.0, "peak_rss_mb": 100.0, "train_reward": [0.0]}
    run = lp.summarize({"a_seed0": final_only}, start, [0, 1, 2, 3])["systems"]["a"]["runs"][0]
    assert run["final_accuracy"] == 0.5
    assert run["time_to_midpoint_s"] is None and run["step_to_midpoint"] is None  # one point is not a curve
    row = lp.markdown_of({"summary": lp.summarize({"a_seed0": final_only}, start, [0, 1, 2, 3]),
                          "eval_steps": [50]}).splitlines()[2]
    assert row.startswith("| rloo_lightning | 0 | 0.000 | 0.500 | – |")
    with_curve = lp.summarize({"a_seed0": _run("a", 0, [1, 1, 0, 0])}, start, [0, 1, 2, 3])
    assert with_curve["systems"]["a"]["runs"][0]["step_to_midpoint"] == 20


def test_resume_on_another_machine_takes_the_records_step0_scores(tmp_path, monkeypatch, capsys):
    import json

    n = 12
    start = {"accuracy": 0.25, "score_s": 1.0, "examples": [], "correct": [1, 1, 1] + [0] * (n - 3)}
    finals = {"a": [1] * 6 + [0] * 6, "b": [1] * 4 + [0] * 8}
    runs = {f"{s}_seed0": dict(system=s, seed=0, startup_s=1.0, peak_rss_mb=100.0, train_reward=[0.0],
                               snapshots=[{"step": 50, "train_s": 9.0, "correct": f}]) for s, f in finals.items()}
    record = {"steps": 50, "seeds": [0], "eval_steps": [50], "hyperparameters": lp._hyper(), "held_out_seeds": [0],
              "runs": runs, "step0": start}
    out = tmp_path / "record.json"
    out.write_text(json.dumps(record))

    def no_child(*args, **kwargs):
        raise AssertionError("nothing is left to run or to score")

    monkeypatch.setattr(lp, "_child", no_child)
    monkeypatch.setattr(sys, "argv", ["learning_parity.py", "--hf-dir", str(tmp_path), "--out", str(out),
                                      "--workdir", str(tmp_path / "empty"), "--seeds", "0", "--eval-rows", str(n),
                                      "--eval-steps", "50", "--resume"])
    lp.main()
    summary = json.loads(capsys.readouterr().out)
    assert summary["step0_accuracy"] == 0.25 and summary["held_out_prompts"] == n
    assert summary["difference_a_minus_b"]["mean"] == pytest.approx(2 / n, abs=1e-4)


def test_our_runs_record_each_steps_dashboard_and_the_snapshot(tmp_path):
    """The callback of run (a) keeps, for every step, the metrics ``STEP_METRICS`` names (None where a step logged
    none), and saves the policy at the scored steps only."""
    import json
    import time
    from types import SimpleNamespace

    import torch

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"eval_steps": [2], "run_dir": str(tmp_path), "launch_time": time.time()}))
    callback = lp.OursSnapshots(str(spec))
    policy = torch.nn.Linear(2, 1)
    logged = [{"train/reward": 0.25, "train/kl": 0.5, "train/completion_length": 30.0,
               "train/clipped_ratio": 0.125, "train/entropy": 0.7},
              {"train/reward": 0.5, "train/kl": 1.5, "train/completion_length": 28.0, "train/clipped_ratio": 0.0}]
    callback.on_train_start(None, None)
    for step, metrics in enumerate(logged, start=1):
        trainer = SimpleNamespace(global_step=step, callback_metrics={k: torch.tensor(v) for k, v in metrics.items()})
        callback.on_train_batch_end(trainer, SimpleNamespace(policy=policy), None, None, step - 1)
    callback.on_train_end(None, None)
    out = json.loads((tmp_path / "snapshots.json").read_text())
    assert out["train_reward"] == [0.25, 0.5]
    assert out["train_metrics"] == {"kl": [0.5, 1.5], "completion_length": [30.0, 28.0],
                                    "clipped_ratio": [0.125, 0.0], "entropy": [pytest.approx(0.7), None]}
    assert [s["step"] for s in out["snapshots"]] == [2] and not (tmp_path / "step1.pt").exists()
    assert torch.equal(torch.load(tmp_path / "step2.pt")["weight"], policy.weight)


def test_late_dashboard_puts_both_systems_kl_per_sequence_and_compares_runs():
    """Steps 26-50 of each run's dashboard: TRL's per-token KL times its mean length is the KL per sequence that
    ours logs; the summary compares the systems run by run when each has two runs with a dashboard."""
    def run(system, seed, kl, length, reward):
        r = _run(system, seed, [1, seed, 1, 1])
        r["train_reward"] = [0.0] * 25 + [reward] * 25
        r["train_metrics"] = {"kl": [None] * 25 + [kl] * 25, "completion_length": [40.0] * 25 + [length] * 25,
                              "clipped_ratio": [0.5] * 50, "entropy": [0.4] * 49 + [None]}
        return r

    runs = {"a_seed0": run("a", 0, 2.0, 30.0, 0.4), "a_seed1": run("a", 1, 3.0, 32.0, 0.5),
            "b_seed0": run("b", 0, 0.1, 30.0, 0.5), "b_seed1": run("b", 1, 0.1, 34.0, 0.6)}
    assert lp.late_dashboard(runs["b_seed1"])["kl"] == pytest.approx(3.4)  # 0.1 nats a token, 34 tokens
    assert lp.late_dashboard(runs["a_seed1"]) == {"kl": 3.0, "completion_length": 32.0, "clipped_ratio": 0.5,
                                                  "entropy": 0.4, "reward": 0.5}
    assert lp.late_dashboard(_run("a", 2, [1, 0, 1, 1])) is None  # recorded before the dashboards were kept
    summary = lp.summarize(runs, {"correct": [0, 0, 1, 0]}, [0, 1, 2, 3])
    late = summary["late_dashboard_a_minus_b_by_run"]
    assert late["kl"]["mean"] == pytest.approx(2.5 - 3.2)
    assert late["reward"]["mean"] == pytest.approx(-0.1) and late["completion_length"]["mean"] == pytest.approx(-1.0)
    table = lp.markdown_of({"summary": summary, "eval_steps": [10, 20], "steps": 50})
    assert "| KL to the reference, nats per sequence | 2.500 | 3.200 | -0.700" in table
    spread = summary["spread_by_run"]
    assert set(spread) == {"final_accuracy", "kl", "completion_length", "clipped_ratio", "entropy", "reward"}
    assert spread["kl"]["sd_a"] == pytest.approx(2 ** -0.5, abs=1e-4) and spread["kl"]["sd_b"] == pytest.approx(
        (2 * 0.2 ** 2) ** 0.5, abs=1e-4)  # KL per sequence 3.0 and 3.4 for TRL's runs
    assert "| KL to the reference, nats per sequence, steps 26-50 | 2 / 2 | 0.707 | 0.283 |" in table
    runs.pop("b_seed1")
    assert "late_dashboard_a_minus_b_by_run" not in lp.summarize(runs, {"correct": [0, 0, 1, 0]}, [0, 1, 2, 3])


def test_tables_name_a_comparison_without_spread():
    """Runs alike on each side (every final the same) give a zero-width Welch interval, which the table names
    instead of formatting a t that does not exist."""
    runs = {f"{s}_seed{i}": _run(s, i, [1, 0, 1, 1] if s == "a" else [1, 1, 1, 1]) for s in "ab" for i in (0, 1)}
    summary = lp.summarize(runs, {"correct": [0, 0, 1, 0]}, [0, 1, 2, 3])
    assert summary["difference_by_run"]["ci95"] == [-0.25, -0.25] and summary["difference_by_run"]["t"] is None
    assert "| the same, each run one observation (Welch, no spread) | -0.250 | [-0.250, -0.250] |" in lp.markdown_of(
        {"summary": summary, "eval_steps": [10, 20], "steps": 50})


def test_difference_by_seed_count_recomputes_the_intervals_on_the_first_seeds():
    start = {"correct": [0, 0, 0, 0, 0]}
    finals_a = [[1, 1, 0, 0, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 1, 1, 1, 1]]
    finals_b = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 1], [0, 1, 1, 0, 1]]
    runs = {f"a_seed{i}": _run("a", i, f) for i, f in enumerate(finals_a)}  # ours' seed 3 has no TRL pair yet
    runs.update({f"b_seed{i}": _run("b", i, f) for i, f in enumerate(finals_b)})
    keep = [0, 1, 2, 3, 4]
    rows = lp.summarize(runs, start, keep)["difference_by_seed_count"]
    assert [r["seeds"] for r in rows] == [2, 3]  # seeds both systems ran, two at least
    three = lp.summarize({k: v for k, v in runs.items() if k != "a_seed3"}, start, keep)
    assert rows[-1]["paired"] == three["difference_a_minus_b"]
    assert rows[-1]["by_run"] == three["difference_by_run"]
    assert rows[-1]["within_0.05"] == three["difference_within_0.05"]
    two = lp.summarize({k: v for k, v in runs.items() if k[-1] in "01"}, start, keep)
    assert rows[0]["paired"] == two["difference_a_minus_b"] and rows[0]["by_run"] == two["difference_by_run"]
    assert rows[0]["paired"]["mean"] == pytest.approx((0.6 + 0.6) / 2 - (0.8 + 0.8) / 2, abs=1e-4)
    table = lp.markdown_of({"summary": three, "eval_steps": [10, 20], "steps": 20})
    assert "| 3 | " + f"{three['difference_a_minus_b']['mean']:+.3f} | " in table
