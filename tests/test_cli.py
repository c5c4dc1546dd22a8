"""The real CLI (``python -m rloo_lightning``) as subprocesses, on CPU, with a tiny offline model.

The four invocations are started together in one module fixture (they are independent), then each
test asserts on one of them.

The fit run uses ``configs/quickstart.yaml`` unchanged except for the overrides below; its model is
the ``tiny_model_dir`` fixture instead of ``tiny:reverse`` (same tokenizer alphabet and context), because
building the warm-started ``tiny:reverse`` model takes a minute or more on 2 CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from cli_harness import CONFIGS, make_env, start_cli, wait_all

pytestmark = pytest.mark.slow  # subprocesses

CONFIG = str(CONFIGS / "quickstart.yaml")
TIMEOUT = 400


def _fit_args(root: Path, model_dir: str) -> list[str]:
    return [
        "fit", "--config", CONFIG,
        "--model.model_name_or_path", model_dir,
        "--trainer.max_steps", "3",
        "--trainer.val_check_interval", "3",
        "--trainer.default_root_dir", str(root),
        "--data.num_val_rows", "16",
        "--data.num_train_rows", "64",
    ]


@pytest.fixture(scope="module")
def cli(tmp_path_factory, tiny_model_dir, _cache_dir):
    env = make_env(_cache_dir)
    fit_root = tmp_path_factory.mktemp("cli_fit")
    k1_root = tmp_path_factory.mktemp("cli_k1")
    specs = {
        "fit": (_fit_args(fit_root, tiny_model_dir), fit_root),
        "print_config": (["fit", "--config", CONFIG, "--model.sampling.k", "6", "--print_config"],
                         tmp_path_factory.mktemp("cli_print")),
        "help": (["--help"], tmp_path_factory.mktemp("cli_help")),
        "k1": (_fit_args(k1_root, tiny_model_dir) + ["--model.sampling.k", "1"], k1_root),
    }
    procs = {name: start_cli(name, args, cwd, env, timeout=TIMEOUT) for name, (args, cwd) in specs.items()}
    wait_all(*procs.values())
    return {name: {"rc": p.rc, "stdout": p.stdout, "stderr": p.stderr, "root": p.cwd, "proc": p}
            for name, p in procs.items()}


def _explain(run) -> str:
    return run["proc"].explain()


def test_fit_exits_zero(cli):
    assert cli["fit"]["rc"] == 0, _explain(cli["fit"])


def test_fit_logs_tensorboard_scalars(cli):
    from rloo_lightning.runtime.tensorboard_logs import read_events

    run = cli["fit"]
    assert run["rc"] == 0, _explain(run)
    version = run["root"] / "lightning_logs" / "version_0"
    events = list(version.glob("events.out.tfevents.*"))
    assert events, list(version.iterdir())
    scalars = read_events(version)
    tags = set(scalars)
    for tag in ("train/reward", "train/kl", "train/loss", "val/reward"):
        assert tag in tags, sorted(tags)
    train_steps = [e.step for e in scalars["train/reward"]]
    assert len(train_steps) == 3
    val = scalars["val/reward"]
    steps = [e.step for e in val]
    assert 0 in steps, steps  # logged before training
    assert max(steps) > 0, steps  # and again after the 3 steps
    assert all(0.0 <= e.value <= 1.0 for e in val)  # the reverse reward is in [0, 1]
    assert all(torch.isfinite(torch.tensor(e.value)) for e in scalars["train/loss"])


def test_fit_checkpoint_loads_with_policy_weights_and_no_reference(cli, tiny_model_dir):
    from rloo_lightning.models import load_causal_lm
    from rloo_lightning.module import RLOOModule

    run = cli["fit"]
    assert run["rc"] == 0, _explain(run)
    ckpts = sorted((run["root"] / "lightning_logs" / "version_0").rglob("*.ckpt"))
    assert ckpts, "no checkpoint written"
    path = ckpts[-1]
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    # only the policy's weights are checkpointed: the frozen reference is not a registered submodule
    assert not any("ref" in key.lower() for key in state), list(state)
    others = {k: v for k, v in state.items() if not k.startswith("policy.")}
    assert all(v.numel() <= 1 for v in others.values()), list(others)  # scalars (e.g. beta), no model copy

    loaded = RLOOModule.load_from_checkpoint(path)
    assert loaded.hparams["sampling"]["k"] == 4 and loaded.hparams["kl"]["beta"] == 0.05
    assert loaded.cfg.sampling.k == 4 and loaded.cfg.kl.beta == 0.05
    policy_state = loaded.policy.state_dict()
    assert {f"policy.{k}" for k in policy_state} == {k for k in state if k.startswith("policy.")}
    for key, value in policy_state.items():
        torch.testing.assert_close(value, state[f"policy.{key}"], rtol=0, atol=0)
    # and training did move the weights away from the initial model
    initial = load_causal_lm(tiny_model_dir).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in policy_state.items() if k in initial)


def test_print_config_shows_model_sampling_k(cli):
    run = cli["print_config"]
    assert run["rc"] == 0, _explain(run)
    config = yaml.safe_load(run["stdout"])
    assert config["model"]["sampling"]["k"] == 6
    assert config["model"]["model_name_or_path"] == "tiny:reverse"
    assert config["data"]["task"] == "reverse"
    with open(CONFIG) as f:
        shipped = yaml.safe_load(f)
    assert config["trainer"]["max_steps"] == shipped["trainer"]["max_steps"]
    assert config["model"]["kl"]["beta"] == shipped["model"]["kl"]["beta"]


def test_help_exits_zero(cli):
    run = cli["help"]
    assert run["rc"] == 0, _explain(run)
    assert "fit" in run["stdout"]


def test_k1_fails_before_training(cli):
    run = cli["k1"]
    assert run["rc"] != 0, _explain(run)
    text = run["stdout"] + run["stderr"]
    assert "sampling.k must be >= 2" in text, _explain(run)
    assert "validation before training" not in text
    version = run["root"] / "lightning_logs" / "version_0"
    assert not list(version.rglob("*.ckpt")) and not list(version.glob("events.out.tfevents.*"))
