"""Sharding in process (``rloo_lightning.models.sharding``): the generation path dispatches on the strategy's type,
an unsharded policy is untouched, decoder layers and tensor parallelism are refused, and ZeRO-3's generation and
model configuration work, through stand-ins for DeepSpeed. The distributed runs are in
``test_models_sharding_runs.py``.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch


# ---------------------------------------------------------------------------------------------------------------
# in-process unit tests: dispatch, no-op path, ZeRO-3 and FSDP bits through mocks
# ---------------------------------------------------------------------------------------------------------------
def _bare(cls, **attrs):
    """An instance of a Lightning strategy class without running its __init__ (DeepSpeed needs deepspeed)."""
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


@pytest.fixture
def tiny_policy(tiny_model_dir):
    from rloo_lightning.models import load_causal_lm

    return load_causal_lm(tiny_model_dir)


def test_generation_path_dispatches_on_the_strategy_type(tiny_policy):
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    from rloo_lightning.models.sharding import generation_path, is_zero3

    zero3 = _bare(DeepSpeedStrategy, config={"zero_optimization": {"stage": 3}})
    zero2 = _bare(DeepSpeedStrategy, config={"zero_optimization": {"stage": 2}})
    assert generation_path(tiny_policy, _bare(ModelParallelStrategy)) == "fsdp2"
    assert generation_path(tiny_policy, _bare(FSDPStrategy)) == "fsdp"
    assert generation_path(tiny_policy, zero3) == "deepspeed_zero3" and is_zero3(zero3)
    assert generation_path(tiny_policy, zero2) == "none" and not is_zero3(zero2)
    assert generation_path(tiny_policy, _bare(DDPStrategy)) == "none"
    assert generation_path(tiny_policy, _bare(SingleDeviceStrategy)) == "none"
    assert generation_path(tiny_policy, None) == "none"
    # without a strategy: by what the model holds (ZeRO-3 partitioned parameters carry ds_id)
    next(tiny_policy.parameters()).ds_id = 0
    assert generation_path(tiny_policy, None) == "deepspeed_zero3"
    # Lightning's own unsharded strategies are taken at their word: no scan of the model (twice a step)
    assert generation_path(tiny_policy, _bare(SingleDeviceStrategy)) == "none"
    assert generation_path(tiny_policy, _bare(DDPStrategy)) == "none"


def test_unsharded_generation_is_untouched(tiny_policy):
    from rloo_lightning.models.sharding import gathered_for_generation

    ids = torch.tensor([[3, 4, 5]])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    plain = tiny_policy.generate(**kwargs)
    with gathered_for_generation(tiny_policy, None):
        assert "generate" not in vars(tiny_policy)  # no kwargs injected
        assert not torch.is_grad_enabled()
        inside = tiny_policy.generate(**kwargs)
    assert torch.equal(plain, inside)
    assert torch.is_grad_enabled()


def test_decoder_layers_and_tensor_parallel_refused(tiny_policy):
    from rloo_lightning.models.sharding import decoder_layers, shard_policy

    layers = decoder_layers(tiny_policy)
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 2

    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name):
            return type("Sub", (), {"size": lambda self: 2})()

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        shard_policy(tiny_policy, Mesh())


class _FakeHook:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def remove(self) -> None:
        self.log.append(("remove", self.name))


def _fake_deepspeed(monkeypatch, log: list):
    """A ``deepspeed`` module with what the ZeRO-3 paths use, recording the calls in ``log``."""
    import contextlib
    import types

    ds = types.ModuleType("deepspeed")
    ds.zero = types.ModuleType("deepspeed.zero")
    pp = types.ModuleType("deepspeed.zero.partition_parameters")

    @contextlib.contextmanager
    def gathered(params, modifier_rank=None):
        log.append(("gather", len(params), modifier_rank))
        yield
        log.append(("partition",))

    ds.zero.GatheredParameters = gathered
    pp.shutdown_init_context = lambda: log.append(("shutdown_init",))
    pp.restore_init_context = lambda: log.append(("restore_init",))
    ds.zero.partition_parameters = pp
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    monkeypatch.setitem(sys.modules, "deepspeed.zero", ds.zero)
    monkeypatch.setitem(sys.modules, "deepspeed.zero.partition_parameters", pp)


def _zero3_strategy_with_engine(policy, log: list):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    offload = SimpleNamespace(module=policy, forward_hooks=[_FakeHook(log, "f")], backward_hooks=[_FakeHook(log, "b")])
    offload._register_deepspeed_module = lambda module: log.append(("register_hooks", module is policy))
    engine = SimpleNamespace(optimizer=SimpleNamespace(parameter_offload=offload))
    # strategy.model (a property: _model, else the LightningModule) is the DeepSpeedEngine after setup
    return _bare(DeepSpeedStrategy, config={"zero_optimization": {"stage": 3}}, _model=engine), offload


def test_zero3_generation_gathers_once_removes_hooks_and_passes_synced_gpus(monkeypatch, tiny_policy):
    from rloo_lightning.models.sharding import gathered_for_generation

    log: list = []
    _fake_deepspeed(monkeypatch, log)
    strategy, offload = _zero3_strategy_with_engine(tiny_policy, log)
    for p in tiny_policy.parameters():
        p.ds_active_sub_modules = {1, 2}
    calls = []
    monkeypatch.setattr(type(tiny_policy), "generate", lambda self, **kw: calls.append(kw), raising=True)
    with gathered_for_generation(tiny_policy, strategy):
        tiny_policy.generate(input_ids=None)
        log.append(("generate",))
        assert offload.forward_hooks == [] and offload.backward_hooks == []
        assert all(not p.ds_active_sub_modules for p in tiny_policy.parameters())
    assert calls == [{"input_ids": None, "synced_gpus": True}]  # explicit: transformers can't detect Lightning's ZeRO-3
    n = len(list(tiny_policy.parameters()))
    assert log == [("gather", n, None), ("remove", "f"), ("remove", "b"), ("generate",),
                   ("register_hooks", True), ("partition",)]  # hooks back before the parameters are partitioned
    assert "generate" not in vars(tiny_policy)


def test_zero3_without_gathering_only_passes_synced_gpus(monkeypatch, tiny_policy):
    from rloo_lightning.models.sharding import gathered_for_generation

    log: list = []
    _fake_deepspeed(monkeypatch, log)
    strategy, offload = _zero3_strategy_with_engine(tiny_policy, log)
    calls = []
    monkeypatch.setattr(type(tiny_policy), "generate", lambda self, **kw: calls.append(kw), raising=True)
    with gathered_for_generation(tiny_policy, strategy, gather=False):
        tiny_policy.generate()
    assert calls == [{"synced_gpus": True}] and log == []
    assert len(offload.forward_hooks) == 1


def test_zero3_configure_model_loads_policy_partitioned_and_reference_whole(monkeypatch, tiny_model_dir):
    """configure_model under a (mocked) ZeRO-3 strategy: the policy's from_pretrained sees ZeRO-3 (a live
    HfDeepSpeedConfig); the reference is a second load, whole (zero.Init suspended), not a copy; nothing leaks."""
    from types import SimpleNamespace

    import transformers.integrations
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, set_hf_deepspeed_config

    import rloo_lightning.models.loading as models
    from rloo_lightning.module import RLOOModule

    log: list = []
    _fake_deepspeed(monkeypatch, log)

    class FakeHfDeepSpeedConfig:
        def __init__(self, config):
            log.append(("hf_ds_config", config["zero_optimization"]["stage"]))
            set_hf_deepspeed_config(self)

        def is_zero3(self):
            return True

    monkeypatch.setattr(transformers.integrations, "HfDeepSpeedConfig", FakeHfDeepSpeedConfig, raising=False)
    # transformers' real ZeRO-3 load needs deepspeed and a process group: the fake load only records whether
    # from_pretrained would have seen ZeRO-3, and returns a copy of a model loaded beforehand
    loaded = models.load_causal_lm(tiny_model_dir)

    def load(*args, **kwargs):
        log.append(("load", is_deepspeed_zero3_enabled()))
        return copy.deepcopy(loaded)

    monkeypatch.setattr(models, "load_causal_lm", load)
    strategy, _ = _zero3_strategy_with_engine(None, log)
    module = RLOOModule(tiny_model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]}, kl={"beta": 0.1})
    module._trainer = SimpleNamespace(strategy=strategy)
    module.configure_model()
    assert log == [("hf_ds_config", 3), ("load", True), ("shutdown_init",), ("load", False), ("restore_init",)]
    assert not is_deepspeed_zero3_enabled()  # dropped after the policy's load: reward models load whole
    assert module.reference is not None and module.reference is not module.policy


def test_other_strategies_configure_model_copies_the_reference(monkeypatch, tiny_model_dir):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    import rloo_lightning.models.loading as models
    from rloo_lightning.module import RLOOModule

    loads = []
    real_load = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    module = RLOOModule(tiny_model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]}, kl={"beta": 0.1})
    module._trainer = SimpleNamespace(strategy=_bare(DDPStrategy))
    module.configure_model()
    assert loads == [1]  # one load; the reference is a deep copy
    ref, pol = next(module.reference.parameters()), next(module.policy.parameters())
    assert torch.equal(ref, pol) and ref.data_ptr() != pol.data_ptr()
