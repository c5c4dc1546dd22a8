"""Every command after ``fit`` on every checkpoint the package writes, for every engine: the engine is stored in the
checkpoint and rebuilt by validate, test, predict and a resume; options are stored as given and checked where they
are used; export builds no engine.

The CLI runs are subprocesses started together (they are independent), with the ``tiny_model_dir`` model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rloo_lightning import RLOOModule
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.engines import (
    GenerationEngine, HFGenerateEngine, ReducedPrecisionEngine, build_engine, cpu_supports_bf16, engine_class,
    engine_spec,
)
from rloo_lightning.engines.vllm import VLLMEngine

REWARDS = {"funcs": ["rloo_lightning.tasks.reverse.reward"]}
ROWS = [{"prompt": "abc=", "answer": "cba"}, {"prompt": "hgfed=", "answer": "defgh"},
        {"prompt": "ab=", "answer": "ba"}, {"prompt": "dcba=", "answer": "abcd"}]


class CallableArgEngine(GenerationEngine):
    """An engine built with an argument a checkpoint cannot hold (a function)."""

    def __init__(self, transform=None) -> None:
        self.transform = transform


# -- the engine's name and arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", [DecodeLoopEngine(return_logprobs=True), HFGenerateEngine(sampler_temperature=2.0),
                                    ReducedPrecisionEngine("int8"), VLLMEngine(dtype="float32", max_num_seqs=8)],
                         ids=lambda e: type(e).__name__)
def test_each_shipped_engine_is_named_with_every_argument_and_rebuilt(engine):
    spec, why = engine_spec(engine)
    assert why is None
    assert spec["class_path"] == f"{type(engine).__module__}.{type(engine).__name__}"
    rebuilt = build_engine(spec)
    assert type(rebuilt) is type(engine)
    assert engine_spec(rebuilt) == (spec, None)
    if isinstance(engine, VLLMEngine):  # defaults are stored too: a later default does not change a resumed run
        assert spec["init_args"]["dtype"] == "float32" and spec["init_args"]["kv_cache_bytes"] is None


def test_an_engine_that_cannot_be_named_says_why():
    class Local(GenerationEngine):
        pass

    spec, why = engine_spec(Local())
    assert spec is None and "cannot be imported by that path" in why
    spec, why = engine_spec(CallableArgEngine(transform=len))
    assert spec is None and "transform=" in why and "not a plain value" in why
    assert engine_spec(CallableArgEngine())[0] == {"class_path": f"{__name__}.CallableArgEngine",
                                                    "init_args": {"transform": None}}
    with pytest.raises(ImportError, match="generation engine 'no_such_module.Engine' cannot be imported"):
        build_engine({"class_path": "no_such_module.Engine"})
    with pytest.raises(TypeError, match="is not a GenerationEngine subclass"):
        build_engine({"class_path": "torch.nn.Linear", "init_args": {}})


def test_options_are_stored_as_given_and_the_engine_beside_them(tiny_model_dir):
    module = RLOOModule(tiny_model_dir, rewards=REWARDS, generation_engine=VLLMEngine(max_num_seqs=8))
    assert module.cfg.correction.level == "token"  # auto, for this engine
    assert module.hparams["correction"]["level"] == "auto"  # stored as given
    assert module.hparams["generation_engine"]["class_path"] == "rloo_lightning.engines.vllm.VLLMEngine"
    again = RLOOModule(**module.hparams)  # as load_from_checkpoint builds it
    assert isinstance(again.engine, VLLMEngine) and again.engine.max_num_seqs == 8
    assert again.cfg.correction.level == "token"
    default = RLOOModule(tiny_model_dir, rewards=REWARDS)
    assert default.hparams["generation_engine"] is None and isinstance(default.engine, DecodeLoopEngine)
    assert default.cfg.correction.level == "none"


def test_an_engine_from_the_checkpoint_that_cannot_run_here_gives_way_except_to_train(tiny_model_dir):
    engine = ReducedPrecisionEngine("float16")  # an argument only a GPU takes
    module = RLOOModule(tiny_model_dir, rewards=REWARDS, generation_engine=engine)
    with pytest.raises(RuntimeError, match="float16"):  # given for this command: its error stands
        module.setup("test")
    module.engine_from_checkpoint = True
    with pytest.raises(RuntimeError, match="float16"):  # a resume does not change its sampler
        module.setup("fit")
    with pytest.warns(UserWarning, match=r"generation engine ReducedPrecisionEngine cannot run here \(.*float16.*\): "
                                         r"test samples with the default engine, DecodeLoopEngine"):
        module.setup("test")
    assert isinstance(module.engine, DecodeLoopEngine) and module.cfg.correction.level == "none"


# -- the CLI, end to end ------------------------------------------------------------------------------------------
ENGINES = {
    "default": [],
    "reduced": ["--model.generation_engine", json.dumps({
        "class_path": "rloo_lightning.engines.ReducedPrecisionEngine",
        "init_args": {"dtype": "bfloat16" if cpu_supports_bf16() else "int8"}}),
        "--model.correction.level", "token"],
    "hf": ["--model.generation_engine", json.dumps({
        "class_path": "rloo_lightning.engines.HFGenerateEngine", "init_args": {"return_logprobs": True}}),
        "--model.correction.level", "sequence"],
}


def fit_args(root: Path, model_dir: str, steps: int = 2) -> list[str]:
    """A 2-step fit of the quickstart on ``model_dir``, logging under ``root``."""
    from cli_harness import CONFIGS

    return ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
            "--trainer.default_root_dir", str(root), "--data.num_val_rows", "8", "--data.num_train_rows", "32",
            "--data.batch_size", "4"]


def last_checkpoint(root: Path) -> Path:
    (path,) = Path(root).glob("lightning_logs/version_*/checkpoints/last.ckpt")
    return path


def after_fit_args(command: str, ckpt: Path, where: Path) -> list[str]:
    """``export`` / ``test`` / ``predict`` of ``ckpt``, writing into ``where``."""
    if command == "export":
        return ["export", "--ckpt_path", str(ckpt), "--output_dir", str(where / "exported")]
    data = where / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    option = {"test": "--data.test_file", "predict": "--data.predict_file"}[command]
    extra = ["--model.predict.output_file", str(where / "predictions.jsonl")] if command == "predict" else []
    return [command, "--ckpt_path", str(ckpt), option, str(data), *extra]


@pytest.fixture(scope="module")
def fits(tmp_path_factory, tiny_model_dir, _cache_dir):
    """For each engine: its 2-step fit, then export, test and predict of its last.ckpt."""
    from cli_harness import make_env, start_cli, wait_all

    env = make_env(_cache_dir)
    roots = {name: tmp_path_factory.mktemp(f"fit_{name}") for name in ENGINES}
    procs = {name: start_cli("fit", fit_args(roots[name], tiny_model_dir) + args, roots[name], env)
             for name, args in ENGINES.items()}
    wait_all(*procs.values())
    runs = {}
    for name, proc in procs.items():
        proc.check()
        ckpt = last_checkpoint(roots[name])
        runs[name] = {"fit": proc, "ckpt": ckpt, "root": roots[name],
                      "hparams": torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]}
        runs[name].update({command: start_cli(command, after_fit_args(command, ckpt, roots[name]), roots[name], env)
                           for command in ("export", "test", "predict")})
    wait_all(*(run[c] for run in runs.values() for c in ("export", "test", "predict")))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_checkpoint_stores_the_engine_and_the_options_as_given(fits, name):
    hparams = fits[name]["hparams"]
    engine = hparams["generation_engine"]
    if name == "default":
        assert engine is None and hparams["correction"]["level"] == "auto"
    else:
        assert engine_class(json.loads(ENGINES[name][1])["class_path"]) is engine_class(engine["class_path"])
        assert hparams["correction"]["level"] == ENGINES[name][3]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_checkpoint_exports_tests_and_predicts(fits, name):
    from transformers import AutoModelForCausalLM

    run = fits[name]
    for command in ("export", "test", "predict"):
        run[command].check()
    exported = AutoModelForCausalLM.from_pretrained(run["root"] / "exported")
    state = torch.load(run["ckpt"], map_location="cpu", weights_only=True)["state_dict"]
    trained = state["policy.lm_head.weight"] if "policy.lm_head.weight" in state else state[
        "policy.model.embed_tokens.weight"]
    torch.testing.assert_close(exported.get_output_embeddings().weight, trained, rtol=0, atol=0)
    assert "test/reward" in run["test"].stdout
    predictions = (run["root"] / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == len(ROWS) and all("completion" in json.loads(line) for line in predictions)


def _rewrite(ckpt: Path, out: Path, **hparams) -> Path:
    """``ckpt`` with its hyperparameters changed (a key set to ``...`` is removed)."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    for key, value in hparams.items():
        if value is ...:
            checkpoint["hyper_parameters"].pop(key, None)
        else:
            checkpoint["hyper_parameters"][key] = value
    torch.save(checkpoint, out)
    return out


@pytest.fixture(scope="module")
def rebuilt(fits, tmp_path_factory, _cache_dir):
    """The CLI on checkpoints whose engine is stored, resolved, gone or unrunnable here."""
    from cli_harness import make_env, start_cli, wait_all

    env = make_env(_cache_dir)
    base = tmp_path_factory.mktemp("rebuilt")
    hf = fits["hf"]
    # Written by the earlier layout: correction.level stored resolved (token), no engine.
    earlier = _rewrite(hf["ckpt"], base / "earlier.ckpt", generation_engine=...,
                       correction={**hf["hparams"]["correction"], "level": "token"})
    gpu = _rewrite(fits["default"]["ckpt"], base / "gpu.ckpt", generation_engine={
        "class_path": "rloo_lightning.engines.ReducedPrecisionEngine", "init_args": {"dtype": "float16"}})
    gone = _rewrite(fits["default"]["ckpt"], base / "gone.ckpt",
                    generation_engine={"class_path": "no_such_module.Engine", "init_args": {}})
    specs = {
        "earlier_test": after_fit_args("test", earlier, base),
        "gpu_test": after_fit_args("test", gpu, base),
        "gpu_fit": ["fit", "--ckpt_path", str(gpu), "--trainer.max_steps", "3"],
        "gone_predict": after_fit_args("predict", gone, base) + ["--model.predict.output_file",
                                                                 str(base / "gone.jsonl")],
        "gone_fit": ["fit", "--ckpt_path", str(gone), "--trainer.max_steps", "3"],
        "resume": ["fit", "--ckpt_path", str(hf["ckpt"]), "--trainer.max_steps", "3",
                   "--trainer.default_root_dir", str(base / "resume")],
        "override": ["test", "--ckpt_path", str(hf["ckpt"]), "--model.generation_engine",
                     "rloo_lightning.engines.decode.DecodeLoopEngine", "--print_config"],
    }
    procs = {name: start_cli(name, args, base, env) for name, args in specs.items()}
    wait_all(*procs.values())
    return {"base": base, "earlier": earlier, **procs}


@pytest.mark.slow
def test_a_checkpoint_of_the_earlier_layout_exports_and_tests(rebuilt):
    from rloo_lightning.export import module_from_checkpoint

    module = module_from_checkpoint(rebuilt["earlier"])  # builds no engine: nothing is sampled
    assert isinstance(module.engine, DecodeLoopEngine)
    rebuilt["earlier_test"].check()
    assert "test/reward" in rebuilt["earlier_test"].stdout


@pytest.mark.slow
def test_a_stored_engine_that_cannot_run_here_gives_way_to_evaluate_but_not_to_resume(rebuilt):
    test, fit = rebuilt["gpu_test"].check(), rebuilt["gpu_fit"]
    assert "generation engine ReducedPrecisionEngine cannot run here" in test.stderr
    assert "test/reward" in test.stdout
    assert fit.rc == 1 and "ReducedPrecisionEngine(dtype=float16) is for GPUs" in fit.stderr
    predict, fit = rebuilt["gone_predict"].check(), rebuilt["gone_fit"]
    assert "trained with no_such_module.Engine, which cannot be rebuilt here" in predict.stderr
    assert (rebuilt["base"] / "gone.jsonl").is_file()
    assert fit.rc == 1 and "resuming with another engine would change the run" in fit.stderr
    assert fit.stderr.count("error:") == 1


@pytest.mark.slow
def test_a_resume_rebuilds_the_engine_and_the_command_line_replaces_it(rebuilt, fits):
    import yaml

    resume = rebuilt["resume"].check()
    ckpt = last_checkpoint(rebuilt["base"] / "resume")
    hparams = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert hparams["generation_engine"] == fits["hf"]["hparams"]["generation_engine"]
    assert "train step 3/3" in resume.log
    config = yaml.safe_load(rebuilt["override"].check().stdout)
    assert config["model"]["generation_engine"]["class_path"] == "rloo_lightning.engines.decode.DecodeLoopEngine"
