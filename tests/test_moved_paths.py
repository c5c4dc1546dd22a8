"""Old module paths still import, for now: each shim hands out the new module's object with a FutureWarning that
names the new path, and a class path a user's config or a checkpoint holds still resolves (as LightningCLI does it,
through jsonargparse)."""

from __future__ import annotations

import importlib
import json
import re
import warnings

import pytest
from jsonargparse import ArgumentParser

# (old dotted name, new dotted name): the public classes and functions of each moved module.
MOVED = [
    ("rloo_lightning.stop.install", "rloo_lightning.runtime.sigterm.install"),
    ("rloo_lightning.stop.check", "rloo_lightning.runtime.sigterm.check"),
    ("rloo_lightning.checkpoint_io.AtomicCheckpointIO", "rloo_lightning.runtime.atomic_checkpoint.AtomicCheckpointIO"),
    ("rloo_lightning.checkpoint_io.atomic_write", "rloo_lightning.runtime.atomic_checkpoint.atomic_write"),
    ("rloo_lightning.checkpoint_io.NoSpaceError", "rloo_lightning.runtime.atomic_checkpoint.NoSpaceError"),
    ("rloo_lightning.checkpoint_io.check_checkpoint_path",
     "rloo_lightning.runtime.checkpoint_check.check_checkpoint_path"),
    ("rloo_lightning.checkpoint_io.local_checkpoint_path",
     "rloo_lightning.runtime.checkpoint_check.local_checkpoint_path"),
    ("rloo_lightning.console.write_line", "rloo_lightning.runtime.console.write_line"),
    ("rloo_lightning.threads.use_threads", "rloo_lightning.runtime.threads.use_threads"),
    ("rloo_lightning.timing.PhaseTimer", "rloo_lightning.runtime.timing.PhaseTimer"),
    ("rloo_lightning.importpath.add_cwd_to_sys_path", "rloo_lightning.runtime.importpath.add_cwd_to_sys_path"),
    ("rloo_lightning.rewards.parallel.WorkerPool", "rloo_lightning.runtime.workers.WorkerPool"),
]
MOVED += [  # model loading: rloo_lightning/models/ (models.py itself became the package: no shim)
    (f"rloo_lightning.{old}.{name}", f"rloo_lightning.models.{new}.{name}")
    for old, new, names in [
        ("policy", "policy", ["Frozen", "lora_config", "load_models", "check_checkpoint_fits", "prepare_policy",
                              "disable_dropout", "export_pretrained"]),
        ("tiny_models", "tiny", ["cache_dir", "build_char_tokenizer", "build_tiny_llama"]),
        ("sharding", "sharding", ["GenerationPath", "decoder_layers", "gathered_for_generation", "generation_path",
                                  "is_zero3", "pretrained_init_context", "replicated_init_context", "shard_policy"]),
    ]
    for name in names
]
MOVED += [  # the pure mathematics: rloo_lightning/algo/; logprobs.py split three ways
    (f"rloo_lightning.{old}.{name}", f"rloo_lightning.{new}.{name}")
    for old, new, names in [
        ("advantages", "algo.advantages", ["BASELINES", "leave_one_out_advantages", "group_mean_advantages",
                                           "group_mean_std_advantages", "MovingAverageBaseline",
                                           "baseline_advantages", "whiten", "informative_groups", "group_std",
                                           "AdvantageEstimator"]),
        ("kl", "algo.kl", ["KL_ESTIMATORS", "KL_PLACEMENTS", "kl_per_token", "token_rewards_after_baseline",
                           "reward_to_go", "mix_into_reference", "fold_kl", "KLTerm"]),
        ("losses", "algo.losses", ["AGGREGATION_MODES", "aggregate_token_loss", "sequence_clipped_surrogate",
                                   "token_clipped_surrogate", "PolicyLoss"]),
        ("correction", "algo.correction", ["mismatch_sums", "importance_weights", "weighted_advantages"]),
        ("rewards.shaping", "algo.shaping", ["missing_eos_penalty", "overlong_penalty", "clip_rewards",
                                             "shape_rewards"]),
        ("logprobs", "algo.logprobs", ["token_logprobs", "token_entropy", "completion_mask", "masked_sum",
                                       "mask_width", "mask_positions"]),
        ("logprobs", "forward", ["completion_logits", "can_share_prompt", "shared_prompt_logits", "worth_sharing",
                                 "sequence_logprobs", "SHARE_MIN_WORK"]),
        ("logprobs", "engines.kv_cache", ["cache_keyword", "returned_cache", "prefill_groups"]),
    ]
    for name in names
]
MOVED += [  # generation engines: rloo_lightning/engines/ (engines.py itself became the package: no shim)
    (f"rloo_lightning.{old}.{name}", f"rloo_lightning.engines.{new}.{name}")
    for old, new, names in [
        ("decode", "decode", ["DecodeLoopEngine", "sample_from_logits", "plain_sampling"]),
        ("vllm_engine", "vllm", ["VLLMEngine", "CPU_HEAD_SIZES", "vllm_available"]),
    ]
    for name in names
]
MOVED += [  # multi-turn episodes: multiturn.py split into rloo_lightning/environments/; the harnesses into verify/
    (f"rloo_lightning.{old}.{name}", f"rloo_lightning.{new}.{name}")
    for old, new, names in [
        ("multiturn", "environments.turns", ["TurnFormat"]),
        ("multiturn", "environments.calls", ["EnvCalls", "EpisodeError", "call_error"]),
        ("multiturn", "environments.episodes", ["CUT_KINDS", "run_episodes", "assemble_transcripts",
                                                "transcript_logps", "end_failed", "abandon_cut_off", "control_ids"]),
        ("multiturn", "environments.sampler", ["EpisodeSampler", "EpisodeWarning", "EPISODE_METRICS",
                                               "import_environment"]),
        ("multiturn", "environments.base", ["Message", "EnvStep", "Environment", "EnvironmentConfigError"]),
        ("exactness", "verify.exactness", ["Toy", "ZTest", "TabularCausalLM", "TableSampler", "TableReward",
                                           "make_toy", "enumerate_completions", "completion_probabilities",
                                           "exact_objective", "exact_gradient", "training_step_draws", "step_draws",
                                           "perturbed_table", "z_test", "check_training_step", "toy_module",
                                           "toy_batch"]),
        ("exactness_multiturn", "verify.exactness_multiturn", ["MultiTurnToy", "ToyEnvironment",
                                                               "make_multiturn_toy", "exact_multiturn_objective",
                                                               "exact_multiturn_gradient", "multiturn_step_draws",
                                                               "check_multiturn_step"]),
    ]
    for name in names
]
# Renamed as it moved: the live state of one episode, apart from the rollout's record ``rollout.Episodes``.
MOVED += [("rloo_lightning.multiturn.Episode", "rloo_lightning.environments.episodes.LiveEpisode")]

# (old class path, a base class it must resolve as): class paths a config (``class_path: ...``) may hold.
CLASS_PATHS = [
    ("rloo_lightning.checkpoint_io.AtomicCheckpointIO", "lightning.fabric.plugins.io.checkpoint_io.CheckpointIO"),
    ("rloo_lightning.decode.DecodeLoopEngine", "rloo_lightning.engines.GenerationEngine"),
    ("rloo_lightning.vllm_engine.VLLMEngine", "rloo_lightning.engines.GenerationEngine"),
]


def _object(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("old", "new"), MOVED, ids=[old for old, _ in MOVED])
def test_old_path_is_the_new_object(old, new):
    old_module, _, name = old.rpartition(".")
    # Each name warns once per shim: a reload gives the shim a fresh record (an earlier test may have used it).
    shim = importlib.reload(importlib.import_module(old_module))
    with pytest.warns(FutureWarning, match=re.escape(f"{old} moved to {new}")):
        value = getattr(shim, name)
    assert value is _object(new)


@pytest.mark.parametrize(("old", "base"), CLASS_PATHS, ids=[old for old, _ in CLASS_PATHS])
def test_old_class_path_resolves_in_a_config(old, base):
    """A ``class_path`` naming the old module resolves, as LightningCLI resolves it (jsonargparse), to the new
    class."""
    old_module, _, name = old.rpartition(".")
    shim = importlib.reload(importlib.import_module(old_module))  # a fresh record of warned names: it warns again
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--obj", type=_object(base))
    with pytest.warns(FutureWarning, match=re.escape(f"{old} moved to")):
        cfg = parser.parse_args(["--obj", json.dumps({"class_path": old})])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        moved_class = getattr(shim, name)
    assert moved_class.__module__ != old_module
    # The parsed config keeps the path as written; instantiating it imports that path: the new class.
    assert cfg.obj.class_path == old and _object(cfg.obj.class_path) is moved_class


@pytest.mark.parametrize("old", ["rloo_lightning.decode.DecodeLoopEngine", "rloo_lightning.vllm_engine.VLLMEngine"])
def test_a_checkpoint_naming_an_old_engine_path_rebuilds_it(old):
    """A checkpoint's ``generation_engine`` holds the class path it was saved with: an old one still builds (with
    the warning), and the rebuilt engine's spec names the new path."""
    from rloo_lightning.engines import build_engine, engine_spec

    old_module, _, name = old.rpartition(".")
    shim = importlib.reload(importlib.import_module(old_module))  # a fresh record of warned names: it warns again
    with pytest.warns(FutureWarning, match=re.escape(f"{old} moved to")):
        engine = build_engine({"class_path": old, "init_args": {}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert type(engine) is getattr(shim, name)
    spec, why = engine_spec(engine)
    assert why is None and spec["class_path"] == f"{type(engine).__module__}.{name}" != old


def test_the_engines_package_keeps_its_class_paths_without_a_warning():
    """``rloo_lightning.engines.HFGenerateEngine`` (and the other engines' short paths), as configs and checkpoints
    hold them, resolve with no warning: the package re-exports them."""
    from rloo_lightning.engines import build_engine

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("HFGenerateEngine", "DecodeLoopEngine", "ReducedPrecisionEngine"):
            assert type(build_engine({"class_path": f"rloo_lightning.engines.{name}"})).__name__ == name


def test_an_old_environment_class_path_resolves():
    """``model.environment.class_path`` naming an old module (the multi-turn exactness toy's environment) resolves,
    as the sampler resolves it, to the moved class, with the warning."""
    from rloo_lightning.environments.sampler import import_environment
    from rloo_lightning.verify.exactness_multiturn import ToyEnvironment

    old = "rloo_lightning.exactness_multiturn.ToyEnvironment"
    importlib.reload(importlib.import_module("rloo_lightning.exactness_multiturn"))  # a fresh record: it warns again
    with pytest.warns(FutureWarning, match=re.escape(f"{old} moved to rloo_lightning.verify.exactness_multiturn")):
        assert import_environment(old, "environment.class_path") is ToyEnvironment


def test_the_tools_package_keeps_its_paths_without_a_warning():
    """``rloo_lightning.environments.tools.ToolEnvironment`` and ``...tools.calculator``, as configs hold them,
    resolve with no warning: the package re-exports every name of the module it replaced."""
    from rloo_lightning.environments import tools
    from rloo_lightning.environments.sampler import import_environment
    from rloo_lightning.environments.tools.arithmetic import calculator
    from rloo_lightning.environments.tools.environment import ToolEnvironment

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert import_environment("rloo_lightning.environments.tools.ToolEnvironment", "x") is ToolEnvironment
        assert tools.resolve_tools(["rloo_lightning.environments.tools.calculator"]) == {"calculator": calculator}
    assert set(tools.__all__) == {"ToolEnvironment", "ToolCall", "calculator", "parse_tool_call", "parse_tool_calls",
                                  "tool_prompt", "tool_schema", "resolve_tools", "tool_schemas", "ERROR_KINDS",
                                  "MAX_ARGUMENT_DEPTH"}
    assert all(hasattr(tools, name) for name in tools.__all__)
