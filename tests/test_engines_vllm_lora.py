"""The adapter sync's pieces that need no vLLM (``engines/vllm_lora.py``): the adapter folder is PEFT's format (a
round trip through ``PeftModel.from_pretrained`` gives the policy's forward, embeddings' adapters included), the rank
vLLM is started with, and the refusals of what vLLM cannot serve. The syncs themselves: ``test_engines_vllm.py``
(colocated) and ``test_engines_vllm_server.py`` (servers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rloo_lightning.engines.vllm_lora import (
    adapter_tensors, check_adapter_sync, is_lora_policy, lora_rank, write_adapter_folder)
from rloo_lightning.models.tiny import build_tiny_llama

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tok():
    from rloo_lightning.models.tiny import build_char_tokenizer

    return build_char_tokenizer("abcdefghij0123456789+=")


def _policy(tok, **options):
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **options}
    model = peft.get_peft_model(build_tiny_llama(tok, seed=3), peft.LoraConfig(**options))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


@pytest.mark.parametrize("options", [
    {},
    {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "r": 8},
    {"target_modules": ["embed_tokens", "q_proj"], "use_rslora": True},
], ids=["qv", "all-linear", "embeddings-rslora"])
def test_the_adapter_folder_loads_in_peft_as_the_policy(tok, tmp_path, options):
    policy = _policy(tok, **options)
    tensors = adapter_tensors(policy)
    assert tensors and all(k.startswith("base_model.model.") and ".default" not in k for k in tensors)
    written = write_adapter_folder(str(tmp_path / "a"), policy, tensors)
    assert sorted(os.listdir(tmp_path / "a")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert written == sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == policy.peft_config["default"].r and config["lora_alpha"] == options.get("lora_alpha", 8)
    loaded = peft.PeftModel.from_pretrained(build_tiny_llama(tok, seed=3), str(tmp_path / "a"))
    x = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want, got = policy.eval()(input_ids=x).logits, loaded.eval()(input_ids=x).logits
        base = build_tiny_llama(tok, seed=3).eval()(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-3)  # the adapter matters: the round trip is not the base's


def test_an_adapter_left_out_of_the_folder_shows_in_the_round_trip(tok, tmp_path):
    """The round trip above can fail: a folder without the v_proj adapter loads, and gives another forward."""
    policy = _policy(tok)
    tensors = {k: v for k, v in adapter_tensors(policy).items() if "v_proj" not in k}
    write_adapter_folder(str(tmp_path / "a"), policy, tensors)
    loaded = peft.PeftModel.from_pretrained(build_tiny_llama(tok, seed=3), str(tmp_path / "a"))
    x = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert not torch.allclose(loaded.eval()(input_ids=x).logits, policy.eval()(input_ids=x).logits, atol=1e-3)


def test_a_rewritten_folder_holds_the_new_version_alone(tok, tmp_path):
    policy = _policy(tok)
    folder = str(tmp_path / "a")
    write_adapter_folder(folder, policy, adapter_tensors(policy))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.mul_(2)
    write_adapter_folder(folder, policy, adapter_tensors(policy))
    from safetensors.torch import load_file

    assert not os.path.exists(folder + ".partial")
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in adapter_tensors(policy).items())


@pytest.mark.parametrize("r, pattern, rank", [(4, {}, 8), (8, {}, 8), (16, {}, 16), (17, {}, 32),
                                               (4, {"v_proj": 40}, 64), (1, {}, 1)])
def test_the_rank_vllm_is_started_with_holds_every_rank_of_the_adapter(tok, r, pattern, rank):
    assert lora_rank(_policy(tok, r=r, rank_pattern=pattern)) == rank


@pytest.mark.parametrize("options, said", [
    ({"use_dora": True}, "policy.lora.use_dora"),
    ({"modules_to_save": ["lm_head"]}, "policy.lora.modules_to_save=['lm_head']"),
    ({"bias": "lora_only"}, "trained biases"),
    ({"r": 600}, "rank 600"),
])
def test_what_vllm_cannot_serve_is_refused_in_one_line_naming_the_option(tok, options, said):
    with pytest.raises(ValueError) as err:
        check_adapter_sync(_policy(tok, **options), "VLLMEngine")
    line = str(err.value)
    assert "\n" not in line and said in line and "lora_sync: merged" in line


def test_a_plain_lora_policy_passes_and_other_models_are_not_lora_policies(tok):
    policy = _policy(tok)
    check_adapter_sync(policy, "VLLMEngine")
    assert is_lora_policy(policy) and not is_lora_policy(build_tiny_llama(tok))
