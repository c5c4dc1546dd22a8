"""RLOOModule's option groups (``rloo_lightning.config``): each checks itself and names the option in its
errors; the old flat names fail naming the new ones (Python, CLI, YAML); checkpoints hold plain primitives."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch
import yaml
from cli_harness import CONFIGS, make_env, start_cli, wait_all

from rloo_lightning import RLOOModule
from rloo_lightning.config import (
    GROUPS,
    AdvantageArgs,
    DynamicSamplingArgs,
    KLArgs,
    PolicyArgs,
    RewardArgs,
    RunArgs,
    SamplingArgs,
    ShapingArgs,
    UpdateArgs,
    ValidationArgs,
    as_group,
)

REWARD = "rloo_lightning.tasks.reverse.reward"
QUICKSTART = CONFIGS / "quickstart.yaml"

BAD = [
    (SamplingArgs, {"k": 1}, "sampling.k must be >= 2"),
    (SamplingArgs, {"max_new_tokens": 0}, "sampling.max_new_tokens must be >= 1"),
    (SamplingArgs, {"temperature": 0.0}, "sampling.temperature must be > 0"),
    (SamplingArgs, {"stop_strings": ["ab", ""]}, "sampling.stop_strings must be non-empty strings"),
    (ShapingArgs, {"overlong_buffer": -1}, "shaping.overlong_buffer must be >= 0"),
    (ShapingArgs, {"reward_clip": [1.0, -1.0]}, "shaping.reward_clip must be [low, high] with low < high"),
    (KLArgs, {"beta": -0.1}, "kl.beta must be >= 0"),
    (KLArgs, {"estimator": "k4"}, "kl.estimator must be one of 'k1', 'k2', 'k3'; got 'k4'"),
    (KLArgs, {"placement": "after"}, "kl.placement must be one of 'reward', 'token_reward', 'loss'; got 'after'"),
    (KLArgs, {"clamp": 0.0}, "kl.clamp must be > 0 or None"),
    (KLArgs, {"ref_sync_alpha": 0.0}, "kl.ref_sync_alpha in (0, 1]"),
    (AdvantageArgs, {"baseline": "max"}, "advantage.baseline must be one of 'leave_one_out'"),
    (AdvantageArgs, {"baseline_decay": 1.0}, "advantage.baseline_decay must be in [0, 1)"),
    (AdvantageArgs, {"clip": [2.0, 1.0]}, "advantage.clip must be [low, high] with low < high"),
    (UpdateArgs, {"loss_aggregation": "mean"}, "update.loss_aggregation must be one of 'seq_sum'"),
    (UpdateArgs, {"clip_mode": "row"}, "update.clip_mode must be one of 'sequence', 'token'"),
    (UpdateArgs, {"on_nonfinite": "ignore"}, "update.on_nonfinite must be one of 'stop', 'skip'"),
    (UpdateArgs, {"loss_norm_constant": 0.0}, "update.loss_norm_constant must be > 0 or None"),
    (UpdateArgs, {"updates_per_rollout": 0}, "update.updates_per_rollout must be >= 1"),
    (UpdateArgs, {"clip_eps_low": 1.0}, "update.clip_eps_low must be in [0, 1)"),
    (UpdateArgs, {"dual_clip": 3.0}, "update.dual_clip must be > 1 and needs update.clip_mode='token'"),
    (UpdateArgs, {"micro_batch_size": 0}, "update.micro_batch_size must be >= 1"),
    (UpdateArgs, {"warmup_ratio": 1.0}, "update.warmup_ratio must be in [0, 1)"),
    (DynamicSamplingArgs, {"max_rounds": 0}, "dynamic_sampling.max_rounds must be >= 1"),
    (DynamicSamplingArgs, {"atol": -0.5}, "dynamic_sampling.atol >= 0"),
    (ValidationArgs, {"num_samples": 0}, "validation.num_samples must be >= 1"),
    (ValidationArgs, {"num_samples": 2, "pass_k": [4]}, "validation.pass_k=[4]: each k must be in [1, "
                                                        "validation.num_samples=2]"),
    (PolicyArgs, {"lora_export": "both"}, "policy.lora_export must be one of 'merged', 'adapter'; got 'both'"),
    (PolicyArgs, {"lora": {}}, "policy.lora must be a non-empty mapping"),
    (RunArgs, {"checkpoint_every_n_steps": -1}, "run.checkpoint_every_n_steps must be >= 0, got -1"),
    (PolicyArgs, {"lora": {"r": 4, "task_type": "SEQ_CLS"}}, "policy.lora: task_type is set by RLOOModule"),
]


@pytest.mark.parametrize("cls, fields, message", BAD, ids=[f"{c.prefix}-{'-'.join(f)}" for c, f, _ in BAD])
def test_groups_validate_themselves_naming_the_option(cls, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**fields)
    # the same check and message when the group comes to RLOOModule as a dict (as from YAML)
    groups = {"rewards": {"funcs": [REWARD]}, cls.prefix: {**({"funcs": [REWARD]} if cls is RewardArgs else {}),
                                                           **fields}}
    with pytest.raises(ValueError, match=re.escape(message)):
        RLOOModule("unused", **groups)


def test_groups_accept_dicts_or_instances_and_are_frozen():
    a = RLOOModule("unused", rewards={"funcs": [REWARD]}, kl={"beta": 0.1}, sampling=SamplingArgs(k=3))
    assert isinstance(a.cfg.kl, KLArgs) and a.cfg.kl.beta == 0.1 and a.cfg.kl.estimator == "k1"
    assert isinstance(a.cfg.sampling, SamplingArgs) and a.cfg.sampling.k == 3
    assert a.cfg.update == UpdateArgs()  # a group not given has its defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.cfg.kl.beta = 0.2
    # YAML lists become the typed values
    assert ShapingArgs(reward_clip=[-1, 2]).reward_clip == (-1.0, 2.0)


def test_unknown_field_names_the_group_and_the_closest_field():
    with pytest.raises(ValueError, match=re.escape("unknown option kl.betta; did you mean kl.beta?")):
        as_group(KLArgs, {"betta": 0.1})
    with pytest.raises(ValueError, match=re.escape("unknown option sampling.beta")):
        RLOOModule("unused", rewards={"funcs": [REWARD]}, sampling={"beta": 0.1})


def test_registry_options_take_their_tables_names():
    # Each option backed by a registry accepts exactly the table's names, and each name runs.
    from rloo_lightning.algo.advantages import BASELINES, baseline_advantages, MovingAverageBaseline
    from rloo_lightning.options import literal_choices
    from rloo_lightning.algo.kl import KL_ESTIMATORS, KL_PLACEMENTS, kl_per_token
    from rloo_lightning.algo.losses import AGGREGATION_MODES, aggregate_token_loss

    assert literal_choices(AdvantageArgs)["baseline"] == tuple(BASELINES)
    assert literal_choices(KLArgs)["estimator"] == tuple(KL_ESTIMATORS)
    assert literal_choices(KLArgs)["placement"] == KL_PLACEMENTS
    assert literal_choices(UpdateArgs)["loss_aggregation"] == tuple(AGGREGATION_MODES)
    rewards, logp, mask = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)
    for name in BASELINES:
        out = baseline_advantages(rewards, 2, name, moving_average=MovingAverageBaseline())
        assert out.shape == rewards.shape and torch.isfinite(out).all(), name
    for name in KL_ESTIMATORS:
        assert kl_per_token(logp, logp, name).abs().max() == 0, name  # every estimator is 0 at pi == pi_ref
    for name in AGGREGATION_MODES:
        assert torch.isfinite(aggregate_token_loss(logp, mask, name)), name
    for option, value in [("baseline", "max"), ("estimator", "k4"), ("loss_aggregation", "mean")]:
        group = {"baseline": AdvantageArgs, "estimator": KLArgs, "loss_aggregation": UpdateArgs}[option]
        with pytest.raises(ValueError, match=f"{group.prefix}.{option} must be one of"):
            group(**{option: value})


def test_run_group_reaches_the_final_checkpoint_and_the_timer():
    from rloo_lightning.callbacks.checkpoint import FinalCheckpoint

    module = RLOOModule("unused", rewards={"funcs": [REWARD]}, run={"checkpoint_every_n_steps": 3, "time_phases": True})
    final = [c for c in module.configure_callbacks() if isinstance(c, FinalCheckpoint)]
    assert len(final) == 1 and final[0].every_n_steps == 3 and module.timer.enabled
    assert not RLOOModule("unused", rewards={"funcs": [REWARD]}).timer.enabled


def test_flat_keyword_is_no_parameter():
    # No catch-all: an option outside its group is Python's own error, naming it.
    with pytest.raises(TypeError, match="unexpected keyword argument 'beta'"):
        RLOOModule("unused", rewards={"funcs": [REWARD]}, beta=0.1)


def test_cli_suggests_the_grouped_name_of_a_flat_option(capsys):
    from rloo_lightning.cli import main

    for flag, grouped in [("--model.beta", "--model.kl.beta"), ("--model.kl_estimator", "--model.kl.estimator"),
                          ("--model.reward_funcs", "--model.rewards.funcs"), ("--model.k", "--model.sampling.k"),
                          ("--model.time_phases", "--model.run.time_phases")]:
        with pytest.raises(SystemExit) as exit_:
            main(["fit", "--config", str(QUICKSTART), flag, "1"])
        assert exit_.value.code == 2
        assert f"unknown option {flag}; did you mean {grouped}?" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_and_yaml_with_flat_options_exit_naming_the_new_ones(tmp_path, _cache_dir):
    config = yaml.safe_load(QUICKSTART.read_text())
    model = config["model"]
    # the old flat form of the quickstart's model section
    flat = dict(model_name_or_path=model["model_name_or_path"], reward_funcs=model["rewards"]["funcs"],
                k=model["sampling"]["k"], beta=model["kl"]["beta"], optimizer=model["optimizer"])
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump({**config, "model": flat}))
    env = make_env(_cache_dir)
    procs = {
        "flag": start_cli("flag", ["fit", "--config", str(QUICKSTART), "--model.beta", "0.1"], tmp_path / "flag", env),
        "flag_eq": start_cli("flag_eq", ["fit", "--config", str(QUICKSTART), "--model.beta=0.1"], tmp_path / "flag_eq",
                             env),
        "yaml": start_cli("yaml", ["fit", "--config", str(tmp_path / "flat.yaml")], tmp_path / "yaml", env),
    }
    wait_all(*procs.values())
    for name, proc in procs.items():
        assert proc.rc not in (0, None) and not proc.timed_out, proc.explain()
        assert name == "yaml" or "model.kl.beta" in proc.log, proc.explain()
        assert not (proc.cwd / "lightning_logs").exists(), name  # refused before any training
    assert "unknown option --model.beta; did you mean --model.kl.beta?" in procs["flag"].log, procs["flag"].explain()
    text = procs["yaml"].log
    # the parser names the first unknown key of the file, and where it is
    assert re.search(r"unknown option model\.\w+ in \S*flat\.yaml; did you mean model\.\w+\.\w+\?", text), text


@pytest.mark.slow
def test_checkpoint_hyperparameters_are_plain_primitives(tmp_path, tiny_model_dir, _cache_dir):
    from lightning.pytorch import Trainer

    from rloo_lightning.data import PromptDataModule

    model = yaml.safe_load(QUICKSTART.read_text())["model"]
    groups = {name: value for name, value in model.items() if name in GROUPS}
    module = RLOOModule(tiny_model_dir, **groups, validation={"at_start": False})
    assert module.hparams["kl"]["beta"] == 0.05 and isinstance(module.hparams["kl"], dict)
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4, num_train_rows=8,
                            num_val_rows=4, max_new_tokens=model["sampling"]["max_new_tokens"])
    trainer = Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=data)
    ckpt = tmp_path / "one_step.ckpt"
    trainer.save_checkpoint(ckpt)

    # A process that never imports rloo_lightning loads it with weights_only=True: nothing but primitives and tensors.
    code = ("import json, sys, torch\n"
            "ckpt = torch.load(sys.argv[1], map_location='cpu', weights_only=True)\n"
            "assert not any(m.split('.')[0] == 'rloo_lightning' for m in sys.modules), 'imported rloo_lightning'\n"
            "print(json.dumps(ckpt['hyper_parameters']))\n")
    from cli_harness import Proc

    proc = Proc("load", [sys.executable, "-c", code, str(ckpt)], tmp_path / "load", make_env(_cache_dir)).check()
    hparams = json.loads(proc.stdout.strip().splitlines()[-1])
    assert hparams["kl"]["beta"] == 0.05 and hparams["kl"]["estimator"] == "k1"
    assert hparams["sampling"]["k"] == 4 and hparams["sampling"]["max_new_tokens"] == 8
    assert hparams["rewards"]["funcs"] == [REWARD] and hparams["model_name_or_path"] == tiny_model_dir

    loaded = RLOOModule.load_from_checkpoint(ckpt, weights_only=True)
    assert isinstance(loaded.cfg.kl, KLArgs) and loaded.cfg.kl == module.cfg.kl
    assert all(getattr(loaded.cfg, name) == getattr(module.cfg, name) for name in GROUPS)
    for (name, a), b in zip(loaded.policy.state_dict().items(), module.policy.state_dict().values()):
        assert torch.equal(a, b), name


def test_readme_options_table_lists_every_group():
    readme = (CONFIGS.parent / "README.md").read_text()
    assert [name for name in GROUPS if f"| `model.{name}` |" not in readme] == []
