"""After training: export a checkpoint to a Hugging Face folder, `test` on held-out prompts, `predict` to JSONL."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer

from module_helpers import REWARD
from rloo_lightning import RLOOModule
from rloo_lightning.data import PromptDataModule
from rloo_lightning.export import checkpoint_hparams, export_checkpoint, module_from_checkpoint

PROMPTS = [{"prompt": "abc=", "answer": "cba"}, {"prompt": "hgfed=", "answer": "defgh"},
           {"prompt": "ab=", "answer": "ba"}]


def _module(model_dir: str, rewards=(REWARD,), **groups) -> RLOOModule:
    return RLOOModule(model_dir, rewards={"funcs": list(rewards)}, sampling={"k": 2, "max_new_tokens": 6},
                      validation={"at_start": False}, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **groups)


def _trainer(root, max_steps: int = 1) -> Trainer:
    return Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False,
                   default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False)


def _prompt_file(tmp_path, rows=PROMPTS, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data(model_dir: str, **kwargs) -> PromptDataModule:
    kwargs.setdefault("batch_size", 2)
    return PromptDataModule(tokenizer_name_or_path=model_dir, max_new_tokens=6, **kwargs)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A module after one RLOO step and its checkpoint (written as fit writes one)."""
    root = tmp_path_factory.mktemp("trained")
    module = _module(tiny_model_dir)
    trainer = _trainer(root)
    trainer.fit(module, datamodule=_data(tiny_model_dir, task="reverse", num_train_rows=8, num_val_rows=8))
    trainer.save_checkpoint(root / "step1.ckpt")
    return module, root / "step1.ckpt"


# -- export ------------------------------------------------------------------------------------------------------
def _logits(model, ids=((3, 4, 5, 6, 7),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_export_writes_the_trained_policy_that_transformers_loads(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module, ckpt = trained
    out = export_checkpoint(ckpt, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    torch.testing.assert_close(_logits(loaded), _logits(module.policy.eval()))
    module.policy.train()


def test_export_refuses_a_folder_with_files_and_a_missing_checkpoint(trained, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        export_checkpoint(trained[1], tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(tmp_path / "nope.ckpt", tmp_path / "out")


def test_checkpoint_hparams_are_read_without_the_reward_code(trained):
    model, data = checkpoint_hparams(trained[1])
    assert model["model_name_or_path"] and model["rewards"]["funcs"] == [REWARD]
    assert data["task"] == "reverse"
    # the reward functions are not built for export: a checkpoint exports where its reward code is missing
    assert module_from_checkpoint(trained[1]).rewards is None


@pytest.mark.parametrize("lora_export", ["merged", "adapter"])
def test_export_of_a_lora_checkpoint(tiny_model_dir, tmp_path, lora_export):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    module = _module(tiny_model_dir, policy={"lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}})
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=_data(tiny_model_dir, task="reverse", num_train_rows=8, num_val_rows=8))
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    assert all("lora_" in k for k in torch.load(tmp_path / "lora.ckpt", weights_only=True)["state_dict"]
               if k.startswith("policy."))  # the checkpoint holds the adapter only
    out = export_checkpoint(tmp_path / "lora.ckpt", tmp_path / "hf", lora_export=lora_export)
    if lora_export == "merged":
        loaded = AutoModelForCausalLM.from_pretrained(out)
    else:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    expected = _logits(module.policy.eval())
    assert not torch.allclose(expected, _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir)))  # it trained
    torch.testing.assert_close(_logits(loaded), expected, rtol=1e-4, atol=1e-5)


def _narrower(model_dir: str, directory) -> str:
    """``model_dir``'s tokenizer with a model half as wide: every weight's shape differs from that model's."""
    from rloo_lightning.models import build_tiny_llama, load_tokenizer

    tok = load_tokenizer(model_dir)
    model = build_tiny_llama(tok, hidden_size=16, num_layers=2, num_heads=2, max_position_embeddings=32)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def test_a_checkpoint_of_another_model_is_refused_in_one_line_naming_both(trained, tiny_model_dir, tmp_path):
    """test/predict/validate/fit --ckpt_path and export --model_name_or_path: not PyTorch's list of every tensor."""
    from rloo_lightning.cli_errors import error_line

    other = _narrower(tiny_model_dir, tmp_path / "narrow")
    expected = (f"error: the checkpoint is of model_name_or_path {tiny_model_dir!r}, and this run's model {other!r} "
                "does not fit it: policy.model.embed_tokens.weight is [13, 32] in the checkpoint, [13, 16] here (20 "
                "more tensors differ); give model.model_name_or_path the model it was trained from, or a checkpoint "
                "of this model")
    data = _data(other, test_file=_prompt_file(tmp_path))
    with pytest.raises(ValueError) as err:
        _trainer(tmp_path).test(_module(other), datamodule=data, ckpt_path=trained[1])
    assert error_line(err.value) == expected
    with pytest.raises(ValueError) as err:
        export_checkpoint(trained[1], tmp_path / "exported", model_name_or_path=other)
    assert error_line(err.value) == expected


def test_a_checkpoint_of_another_architecture_names_the_first_tensor_only_one_has():
    from rloo_lightning.models.policy import check_checkpoint_fits

    here = {"policy.q.weight": torch.zeros(4, 4), "policy.lm_head.weight": torch.zeros(8, 4), "beta": torch.zeros(())}
    there = {**here, "policy.q.bias": torch.zeros(4)}  # q/k/v biases (Qwen2) where this model has none
    checkpoint = {"state_dict": there, "hyper_parameters": {"model_name_or_path": "Qwen/x"}}
    with pytest.raises(ValueError, match=r"of model_name_or_path 'Qwen/x', and this run's model 'llama' does not fit "
                                         r"it: the checkpoint has policy\.q\.bias, this model has not; give"):
        check_checkpoint_fits(checkpoint, here, "llama")
    checkpoint["state_dict"] = {k: v for k, v in here.items() if k != "policy.lm_head.weight"}
    with pytest.raises(ValueError, match=r"this model has policy\.lm_head\.weight, the checkpoint has not"):
        check_checkpoint_fits(checkpoint, here, "llama")
    check_checkpoint_fits(checkpoint, here, "llama", absent_ok={"policy.lm_head.weight"})  # LoRA's frozen base
    check_checkpoint_fits({"state_dict": dict(here)}, here, "llama")  # its own checkpoint fits


# -- test --------------------------------------------------------------------------------------------------------
def test_test_evaluates_the_test_file_with_the_validation_metrics(trained, tiny_model_dir, tmp_path):
    module, _ = trained
    data = _data(tiny_model_dir, task="reverse", num_train_rows=8, num_val_rows=8,
                 test_file=_prompt_file(tmp_path))
    (result,) = _trainer(tmp_path).test(module, datamodule=data)
    assert set(result) == {"test/reward", "test/reward_greedy", "test/accuracy_greedy"}
    assert len(data.test_rows) == 3
    # the greedy reward is that of the greedy completions of those three prompts
    batch = data._collate()(data.test_rows)
    greedy = module.sample(batch, 1, 0, greedy=True)
    greedy.scores, greedy.rewards = module.score(greedy, shape=False)
    assert result["test/reward_greedy"] == pytest.approx(greedy.rewards.mean().item(), abs=1e-6)


@pytest.mark.slow  # over ~5 s (the fast loop: pytest -m "not slow")
def test_test_without_a_test_file_evaluates_the_validation_split(trained, tiny_model_dir, tmp_path):
    data = _data(tiny_model_dir, task="reverse", num_train_rows=8, num_val_rows=8)
    (result,) = _trainer(tmp_path).test(trained[0], datamodule=data)
    assert data.test_rows is data.val_rows and "test/reward" in result


def test_test_file_alone_needs_no_training_source(tiny_model_dir, tmp_path):
    data = _data(tiny_model_dir, test_file=_prompt_file(tmp_path))
    data.setup("test")
    assert len(data.test_rows) == 3
    with pytest.raises(ValueError, match="fit needs data.task or data.train_file"):
        data.setup("fit")


# -- predict -----------------------------------------------------------------------------------------------------
def _predict(module, model_dir, tmp_path, **module_kwargs):
    data = _data(model_dir, predict_file=_prompt_file(tmp_path))
    _trainer(tmp_path).predict(module, datamodule=data, return_predictions=False)
    out = tmp_path / "predictions.jsonl"
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_predict_writes_each_completion_with_its_scores(tiny_model_dir, tmp_path):
    module = _module(tiny_model_dir, predict={"num_samples": 2, "output_file": str(tmp_path / "predictions.jsonl")})
    rows = _predict(module, tiny_model_dir, tmp_path)
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p["prompt"], s) for p in PROMPTS for s in range(2)]
    for r in rows:
        assert r["columns"] == {"answer": next(p["answer"] for p in PROMPTS if p["prompt"] == r["prompt"])}
        assert 0.0 <= r["reward"] <= 1.0 and r["scores"] == {"reward": r["reward"]}
        assert isinstance(r["completion"], str) and 1 <= r["num_tokens"] <= 6


def test_predict_runs_without_reward_functions_and_fit_does_not(tiny_model_dir, tmp_path):
    module = _module(tiny_model_dir, rewards=(), predict={"greedy": True,
                                                            "output_file": str(tmp_path / "predictions.jsonl")})
    rows = _predict(module, tiny_model_dir, tmp_path)
    assert len(rows) == 3 and all("reward" not in r and r["sample"] == 0 for r in rows)
    # greedy: the same completions again
    (tmp_path / "predictions.jsonl").unlink()
    assert [r["completion"] for r in _predict(module, tiny_model_dir, tmp_path)] == [r["completion"] for r in rows]
    data = _data(tiny_model_dir, task="reverse", num_train_rows=8, num_val_rows=8)
    with pytest.raises(ValueError, match="rewards.funcs must name at least one reward function: fit"):
        _trainer(tmp_path / "fit").fit(_module(tiny_model_dir, rewards=()), datamodule=data)


def test_predict_never_overwrites_a_file(tiny_model_dir, tmp_path):
    out = tmp_path / "predictions.jsonl"
    out.write_text("earlier results\n")
    module = _module(tiny_model_dir, predict={"output_file": str(out)})
    with pytest.raises(FileExistsError, match="predict.output_file"):
        _predict(module, tiny_model_dir, tmp_path)
    assert out.read_text() == "earlier results\n"


def test_predict_needs_a_predict_file(tiny_model_dir):
    with pytest.raises(ValueError, match="predict needs data.predict_file"):
        _data(tiny_model_dir, task="reverse").setup("predict")
    with pytest.raises(ValueError, match="predict needs data.predict_file"):  # a train_file over a task neither
        _data(tiny_model_dir, task="reverse", train_file="x.jsonl").setup("predict")


def test_predict_options_are_checked():
    from rloo_lightning.config import PredictArgs

    with pytest.raises(ValueError, match="predict.num_samples must be >= 1"):
        PredictArgs(num_samples=0)
    with pytest.raises(ValueError, match="predict.greedy gives one completion"):
        PredictArgs(num_samples=3, greedy=True)


# -- the CLI: the checkpoint's options are defaults ------------------------------------------------------------
@pytest.mark.slow  # a CLI subprocess
def test_cli_takes_options_from_the_checkpoint_and_the_command_line_wins(trained, tmp_path, _cache_dir):
    import yaml

    from cli_harness import CLI, Proc, make_env

    args = ["predict", "--ckpt_path", str(trained[1]), "--data.predict_file", "p.jsonl",
            "--model.predict.num_samples", "3", "--model.rewards.funcs", "[]", "--print_config"]
    proc = Proc("print", CLI + args, tmp_path, make_env(_cache_dir)).wait().check()
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["model_name_or_path"] == trained[0].hparams.model_name_or_path  # from the checkpoint
    assert config["model"]["sampling"]["k"] == 2 and config["model"]["sampling"]["max_new_tokens"] == 6
    assert config["data"]["task"] == "reverse" and config["data"]["num_train_rows"] == 8
    assert config["model"]["predict"]["num_samples"] == 3  # given on the command line
    assert config["model"]["rewards"]["funcs"] == []  # given: an empty list beats the checkpoint's function


def test_prediction_rows_write_a_missing_reward_as_null():
    from types import SimpleNamespace

    from rloo_lightning.callbacks.predict import prediction_rows

    rollout = SimpleNamespace(k=2, completions=["a", "b"], completion_mask=torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
                              truncated=torch.tensor([False, True]), rewards=torch.tensor([float("nan"), 0.5]),
                              scores={"f": torch.tensor([float("nan"), 0.5])}, columns={"answer": ["x", "x"]})
    rows = prediction_rows(rollout, ["p="])
    assert [(r["sample"], r["num_tokens"], r["truncated"], r["reward"], r["scores"]) for r in rows] == [
        (0, 1, False, None, {"f": None}), (1, 2, True, 0.5, {"f": 0.5})]
    assert json.loads(json.dumps(rows[0]))["reward"] is None


@pytest.mark.slow
def test_cli_predict_stops_at_sigterm_after_the_batch_in_progress_is_written(tiny_model_dir, tmp_path, _cache_dir):
    from cli_harness import CONFIGS, make_env, start_cli

    out = tmp_path / "predictions.jsonl"
    args = ["predict", "--config", CONFIGS / "quickstart.yaml", "--model.model_name_or_path", tiny_model_dir,
            "--data.predict_file", _prompt_file(tmp_path, PROMPTS * 2), "--data.val_batch_size", "2",
            "--model.predict.greedy", "true", "--model.predict.output_file", out,
            "--trainer.default_root_dir", tmp_path, "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks+=reliability_helpers.callbacks.SigtermAt", "--trainer.callbacks.predict_batch=0"]
    proc = start_cli("predict", args, tmp_path, make_env(_cache_dir)).wait()
    assert proc.rc == 143, proc.explain()  # not 0: whoever sent the signal sees the run did not finish
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole
    assert 0 < len(rows) < 6 and len(rows) % 2 == 0  # whole batches, not all three
    assert f"predict stopped by SIGTERM after batch {len(rows) // 2 - 1}: {len(rows)} completions are in {out}" in (
        proc.log)


# -- an engine with its own copy of the weights is told before each entry point generates ---------------------
def test_fit_validate_test_and_predict_each_tell_the_engine_before_generating(tiny_model_dir, tmp_path):
    """A restored checkpoint (``--ckpt_path``) changes the weights without an optimizer step: an engine holding a
    copy (VLLMEngine, ReducedPrecisionEngine) must refresh it before the entry point's first generation."""
    from rloo_lightning.engines.decode import DecodeLoopEngine

    class Recording(DecodeLoopEngine):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[str] = []

        def on_weights_updated(self, model) -> None:
            self.events.append("stale")

        def generate(self, *args, **kwargs):
            self.events.append("generate")
            return super().generate(*args, **kwargs)

    engine = Recording()
    module = _module(tiny_model_dir, generation_engine=engine,
                     predict={"output_file": str(tmp_path / "predictions.jsonl")})
    data = _data(tiny_model_dir, task="reverse", num_train_rows=4, num_val_rows=4, predict_file=_prompt_file(tmp_path))
    trainer = Trainer(accelerator="cpu", max_steps=1, limit_val_batches=1, logger=False, default_root_dir=str(tmp_path),
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    for run in (lambda: trainer.fit(module, datamodule=data), lambda: trainer.validate(module, datamodule=data),
                lambda: trainer.test(module, datamodule=data),
                lambda: trainer.predict(module, datamodule=data, return_predictions=False)):
        engine.events.clear()
        run()
        assert "generate" in engine.events and engine.events.index("stale") < engine.events.index("generate"), \
            engine.events


def test_predict_on_prompts_without_the_rewards_columns_writes_predictions_without_a_reward(tiny_model_dir,
                                                                                          tmp_path):
    # the reverse task's reward reads `answer`: new prompts have none
    module = _module(tiny_model_dir, predict={"output_file": str(tmp_path / "predictions.jsonl")})
    data = _data(tiny_model_dir, predict_file=_prompt_file(tmp_path, [{"prompt": p["prompt"]} for p in PROMPTS]))
    _trainer(tmp_path).predict(module, datamodule=data, return_predictions=False)
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all("reward" not in r and "scores" not in r and r["completion"] for r in rows)
    assert module.predict_scores is False


class _FailingAt:
    """A reward that raises on its ``at``-th call."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, prompts, completions, completion_ids, **columns):
        self.calls += 1
        if self.calls > self.at:
            raise RuntimeError("the reward service went away")
        return [0.0] * len(completions)


@pytest.mark.parametrize("at,kept", [(0, 0), (1, 2)])
def test_a_failed_predict_leaves_no_file_that_reads_as_complete(tiny_model_dir, tmp_path, at, kept):
    out = tmp_path / "predictions.jsonl"
    module = _module(tiny_model_dir, predict={"output_file": str(out), "greedy": True})
    module.rewards.funcs[0] = _FailingAt(at)
    data = _data(tiny_model_dir, predict_file=_prompt_file(tmp_path), val_batch_size=2)
    with pytest.raises(Exception, match="the reward service went away"):
        _trainer(tmp_path).predict(module, datamodule=data, return_predictions=False)
    assert not out.exists()
    partial = tmp_path / "predictions.jsonl.partial"
    assert (len(partial.read_text().splitlines()) if partial.exists() else 0) == kept  # the batches done
