"""``rloo_lightning.runtime.framework``, the one seam to the private APIs of Lightning, LightningCLI, jsonargparse,
TensorBoard, torch, DeepSpeed, tqdm and Hugging Face: each function against the installed libraries (a private API
that vanished or changed fails here, named), and no private use of theirs anywhere else in the package.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import multiprocessing
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from private_api import private_uses, seam_names
from torch import nn

from rloo_lightning.runtime import framework

PACKAGE = Path(framework.__file__).resolve().parents[1]
SEAM = Path(framework.__file__).resolve()


def _require(obj, name: str) -> None:
    """``obj`` still has the private ``name``: else the upgrade removed an API that the seam wraps."""
    owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
    assert hasattr(obj, name), f"{owner}.{name} is gone from the installed version: mend runtime/framework.py"


# -- Lightning: the trainer ---------------------------------------------------------------------------------------
class _Counted(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args) -> None:
        self.batches += 1

    def state_dict(self) -> dict:
        return {"batches": self.batches}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A BoringModel fitted 2 steps, with a ModelCheckpoint saving every step and a callback with a state."""
    folder = tmp_path_factory.mktemp("fit")
    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True)
    trainer = Trainer(default_root_dir=folder, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[checkpoint, _Counted()], accelerator="cpu", devices=1)
    model = BoringModel()
    trainer.fit(model)
    return trainer, model, checkpoint, folder


def test_the_sigterm_notifier_replaced_is_what_lightning_registers():
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, accelerator="cpu")
    _require(trainer, "_signal_connector")
    calls = []
    framework.set_sigterm_notifier(trainer, lambda signum, frame: calls.append(signum))
    connector = trainer._signal_connector
    before = signal.getsignal(signal.SIGTERM)
    # Lightning chains the handler in place: a no-op, not this package's handler (which an earlier test in this
    # process may have installed, and which would record a signal for the tests after this one)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    connector.register_signal_handlers()  # what Lightning does when the trainer's run starts
    try:
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # Lightning's handler chain, called directly
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, before)
    assert calls == [signal.SIGTERM], "Lightning's SignalConnector no longer calls _sigterm_notifier_fn"
    assert not trainer.received_sigterm  # Lightning's own notifier did not run
    framework.set_sigterm_notifier(object(), lambda *a: None)  # no signal connector: nothing


def test_mark_sigterm_received_is_lightnings_flag():
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, accelerator="cpu")
    assert not trainer.received_sigterm
    framework.mark_sigterm_received(trainer)
    assert trainer.received_sigterm, "Trainer.received_sigterm no longer reads _signal_connector.received_sigterm"
    framework.mark_sigterm_received(object())  # no signal connector: nothing


def test_loops_and_callbacks_state_are_what_a_checkpoint_holds(fitted, tmp_path):
    trainer, _, _, _ = fitted
    loops, callbacks = framework.loops_state(trainer), framework.callbacks_state(trainer)
    trainer.save_checkpoint(tmp_path / "now.ckpt")
    saved = torch.load(tmp_path / "now.ckpt", weights_only=False)
    assert set(loops) == {"fit_loop", "validate_loop", "test_loop", "predict_loop"}
    assert loops["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == 2
    assert loops == saved["loops"]
    assert callbacks == saved["callbacks"] and callbacks[_Counted.__qualname__] == {"batches": 2}


def test_save_checkpoint_edited_is_save_checkpoint_with_the_edit(fitted, tmp_path):
    trainer, _, _, _ = fitted
    _require(trainer._checkpoint_connector, "dump_checkpoint")
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    framework.save_checkpoint_edited(trainer, tmp_path / "edited.ckpt", lambda checkpoint: checkpoint.update(edit=1))
    plain, edited = (torch.load(tmp_path / f"{name}.ckpt", weights_only=False) for name in ("plain", "edited"))
    assert edited.pop("edit") == 1 and list(edited) == list(plain)  # the same entries, in the same order
    torch.testing.assert_close(edited["state_dict"], plain["state_dict"])
    assert edited["loops"] == plain["loops"] and edited["callbacks"] == plain["callbacks"]


def test_module_trainer_is_the_attached_trainer_or_none(fitted):
    trainer, model, _, _ = fitted
    assert framework.module_trainer(model) is trainer
    assert framework.module_trainer(BoringModel()) is None
    with pytest.raises(RuntimeError):
        BoringModel().trainer  # the public property raises: why the seam reads the private one  # noqa: B018


def test_model_checkpoint_last_step_and_schedule(fitted):
    _, _, checkpoint, _ = fitted
    for name in ("_last_global_step_saved", "_every_n_train_steps", "_train_time_interval"):
        _require(ModelCheckpoint(), name)
    assert framework.last_saved_step(checkpoint) == 2
    assert framework.last_saved_step(ModelCheckpoint()) == 0
    assert framework.saves_within_epoch(ModelCheckpoint(every_n_train_steps=3)) == 3
    assert framework.saves_within_epoch(ModelCheckpoint(train_time_interval=timedelta(minutes=5)))
    assert not framework.saves_within_epoch(ModelCheckpoint())
    assert not framework.saves_within_epoch(ModelCheckpoint(every_n_epochs=2))


def test_checkpoint_io_slot_and_wrapper():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(device="cpu")
    _require(strategy, "_checkpoint_io")
    assert framework.checkpoint_io_of(strategy) is None  # none set yet (the public property would make one)
    io_ = TorchCheckpointIO()
    strategy.checkpoint_io = io_
    assert framework.checkpoint_io_of(strategy) is io_
    wrapper = AsyncCheckpointIO(TorchCheckpointIO())
    try:
        assert framework.is_wrapping_checkpoint_io(wrapper) and not framework.is_wrapping_checkpoint_io(io_)
        framework.set_wrapped_checkpoint_io(wrapper, io_)
        assert wrapper.checkpoint_io is io_
    finally:
        wrapper.teardown()


def test_strategies_checkpoint_formats():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    _require(ModelParallelStrategy(), "_save_distributed_checkpoint")
    _require(FSDPStrategy(), "_state_dict_type")
    assert framework.saves_distributed_checkpoint(ModelParallelStrategy())
    assert not framework.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False))
    assert framework.fsdp_state_dict_type(FSDPStrategy()) == "full"
    assert framework.fsdp_state_dict_type(FSDPStrategy(state_dict_type="sharded")) == "sharded"


def test_tqdm_progress_bar_internals():
    bar = TQDMProgressBar(refresh_rate=2, leave=True)
    for stage in ("train", "val", "test", "predict"):
        _require(bar, f"_{stage}_progress_bar")
        assert framework.tqdm_bar(bar, stage) is None
    marker = object()
    bar.val_progress_bar = marker  # the public setter
    assert framework.tqdm_bar(bar, "val") is marker
    with pytest.raises(ValueError, match="no tqdm bar for stage 'sanity': one of"):
        framework.tqdm_bar(bar, "sanity")
    assert framework.tqdm_leave(bar) is True and framework.tqdm_leave(TQDMProgressBar()) is False
    assert [framework.tqdm_should_update(bar, n, 5) for n in range(1, 6)] == [False, True, False, True, True]


# -- LightningCLI --------------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


class _ParsedCLI(LightningCLI):
    """Stops once parsed (before any class is built); records that LightningCLI called ``_parse_ckpt_path``."""

    parsed_ckpt_path = False

    def _parse_ckpt_path(self) -> None:
        type(self).parsed_ckpt_path = True
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        raise _Stop(self)


def _parsed(args: list[str]) -> LightningCLI:
    with pytest.raises(_Stop) as stopped, pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", ["rloo-lightning"])  # pytest's own arguments are no CLI's
        _ParsedCLI(BoringModel, args=args, seed_everything_default=0)
    return stopped.value.args[0]


def test_cli_config_values_parsers_and_their_options():
    cli = _parsed(["fit", "--trainer.max_steps", "7", "--trainer.logger", "false"])
    assert framework.cli_get(cli, cli.config, "trainer.max_steps") == 7
    assert framework.cli_get(cli, cli.config, "trainer")["max_steps"] == 7
    assert framework.cli_get(cli, cli.config, "ckpt_path") is None
    assert framework.cli_get(cli, cli.config, "no.such.key", default=5) == 5
    parsers = framework.cli_subcommand_parsers(cli)
    assert set(parsers) == set(LightningCLI.subcommands())
    assert framework.cli_parser(cli, "fit") is parsers["fit"] and framework.cli_parser(cli, None) is cli.parser
    assert hasattr(framework.cli_parser(cli, "fit"), "callback_keys")  # RLOOCLI reads it
    assert framework.cli_subcommand_parsers(object()) == {}
    names = {action.dest for action in framework.parser_actions(parsers["fit"])}  # what cli_errors suggests from
    assert {"trainer.max_steps", "ckpt_path", "config", "help"} <= names


def test_each_overridden_private_method_is_still_there_and_called():
    from rloo_lightning.cli import RLOOCLI

    for path, name in framework.OVERRIDDEN_PRIVATE_METHODS:
        module, cls = path.rsplit(".", 1)
        base = getattr(importlib.import_module(module), cls)
        assert callable(getattr(base, name, None)), f"{path}.{name} is gone: RLOOCLI's override no longer applies"
    assert "_parse_ckpt_path" in vars(RLOOCLI)
    _ParsedCLI.parsed_ckpt_path = False
    _parsed(["fit"])
    assert _ParsedCLI.parsed_ckpt_path, "LightningCLI no longer calls _parse_ckpt_path: RLOOCLI's override is moot"


# -- TensorBoard ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["", "run"])
def test_tensorboard_scalars_event_is_what_log_metrics_writes(tmp_path, prefix):
    from lightning.pytorch.loggers import TensorBoardLogger

    from rloo_lightning.runtime.tensorboard_logs import read_scalars

    def scalars(version: str, write) -> dict:
        logger = TensorBoardLogger(save_dir=tmp_path, name="tb", version=version, prefix=prefix)
        _require(logger, "_prefix")
        _require(logger.experiment, "_get_file_writer")
        write(logger)
        logger.experiment.flush()
        return read_scalars(logger.log_dir)

    values = {"train/reward": 0.25, "train/kl": 1.5}
    ours = scalars("one_event", lambda lg: framework.tensorboard_scalars_event(lg, lg.experiment, values, 3))
    assert ours == scalars("log_metrics", lambda lg: lg.log_metrics(values, step=3))
    assert set(ours) == {f"{prefix}-{name}" if prefix else name for name in values}
    assert framework.tensorboard_available() is True  # tensorboard is a dependency of the package


# -- torch ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_default_store_is_the_process_groups(tmp_path):
    with _one_rank_group(tmp_path):
        framework.default_store().set("rloo", "1")
        assert framework.default_store().get("rloo") == b"1"


def test_persistent_buffers_are_the_module_state_dicts():
    module = nn.Module()
    module.register_buffer("kept", torch.ones(2))
    module.register_buffer("dropped", torch.zeros(2), persistent=False)
    module.register_buffer("empty", None)
    module.child = nn.BatchNorm1d(2)
    assert [name for name, _ in framework.persistent_buffers(module)] == ["kept", "empty"]  # own ones, None too
    assert {n for n in module.state_dict() if not n.startswith("child.")} == {"kept"}


def test_foreach_norm_and_mkldnn():
    tensors = [torch.tensor([1.0, -3.0]), torch.tensor([[2.0], [float("inf")]])]
    norms = framework.foreach_norm(tensors, ord=float("inf"))
    assert [float(n) for n in norms] == [3.0, float("inf")]
    assert isinstance(framework.mkldnn_bf16_supported(), bool)


def test_fsdp2_settings_are_restored_and_parameters_resharded(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with _one_rank_group(tmp_path):
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        framework.fsdp2_lazy_init(model)
        modules = [model, *model]
        states = [m._get_fsdp_state() for m in modules]
        for name in ("_fsdp_param_groups", "_auto_reshard_after_forward"):
            _require(states[1], name)

        def settings():
            return ([s._auto_reshard_after_forward for s in states],
                    [[g.is_unsharded for g in s._fsdp_param_groups] for s in states])

        before = settings()
        assert before == ([True, True, True], [[], [False], [False]])
        with framework.fsdp2_reshard_settings_restored(modules):
            for m in modules:
                m.set_reshard_after_forward(False, recurse=False)
                m.unshard()
            assert settings() == ([False, False, False], [[], [True], [True]])
        assert settings() == before


def test_fsdp1_handles_keep_their_parameters_after_forward_inside(tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy as S

    with _one_rank_group(tmp_path), pytest.warns(UserWarning, match="NO_SHARD"):
        unit = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4)), device_id=torch.device("cpu"))
    with _one_rank_group(tmp_path):
        [handle] = framework.fsdp1_handles([unit, nn.Linear(2, 2)])
        _require(handle, "_sharding_strategy")
        for strategy, inside in ((S.FULL_SHARD, S.SHARD_GRAD_OP), (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2),
                                 (S.NO_SHARD, S.NO_SHARD)):
            handle._sharding_strategy = strategy
            with framework.fsdp1_params_kept_after_forward([handle]):
                assert handle._sharding_strategy == inside
            assert handle._sharding_strategy == strategy


def test_zero3_register_hooks_uses_the_name_deepspeed_has():
    calls = []

    class Old:
        module = "m"

        def _register_hooks_recursively(self, module):
            calls.append(("old", module))

    class New(Old):
        def _register_deepspeed_module(self, module):
            calls.append(("new", module))

    framework.zero3_register_hooks(New())
    framework.zero3_register_hooks(Old())
    assert calls == [("new", "m"), ("old", "m")]
    deepspeed = pytest.importorskip("deepspeed")
    offload = deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload
    assert hasattr(offload, "_register_deepspeed_module") or hasattr(offload, "_register_hooks_recursively")


# -- tqdm, Hugging Face, the standard library --------------------------------------------------------------------
def test_tqdm_bars_are_the_live_ones():
    from tqdm import tqdm

    _require(tqdm, "_instances")
    bar = tqdm(total=3, file=io.StringIO())
    assert bar in framework.tqdm_bars()
    bar.close()
    assert bar not in framework.tqdm_bars()


def test_dataset_fingerprint_and_no_split_modules():
    import datasets
    from transformers import LlamaForCausalLM

    one, other = datasets.Dataset.from_dict({"a": [1]}), datasets.Dataset.from_dict({"a": [2]})
    assert isinstance(framework.dataset_fingerprint(one), str)
    assert framework.dataset_fingerprint(one) != framework.dataset_fingerprint(other)
    assert framework.no_split_modules(LlamaForCausalLM) == ["LlamaDecoderLayer"]
    assert framework.no_split_modules(nn.Linear(1, 1)) is None


def test_forkserver_preload_modules():
    from multiprocessing import forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver here")
    _require(forkserver._forkserver, "_preload_modules")
    preload = framework.forkserver_preload_modules()
    assert preload == list(forkserver._forkserver._preload_modules)  # ["__main__"] unless a module was asked for
    assert preload is not forkserver._forkserver._preload_modules  # a copy


# -- nothing private of these libraries outside the seam -------------------------------------------------------------
def _package_uses() -> list[str]:
    names = seam_names(SEAM)
    return [use for path in sorted(PACKAGE.rglob("*.py")) if path.resolve() != SEAM
            for use in private_uses(path, PACKAGE.parent, names)]


def test_no_private_framework_api_is_used_outside_the_seam():
    uses = _package_uses()
    assert not uses, ("private APIs of other libraries used outside rloo_lightning/runtime/framework.py (wrap each in "
                      "a function there, tested here; a private name of this package's own: private_api.py's "
                      "OWN_PRIVATE_NAMES):\n"
                      + "\n".join(uses))


def test_a_planted_private_use_is_named(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO\n"
        "from torch.distributed.fsdp._flat_param import HandleShardingStrategy\n"
        "import os\n\n\n"
        "class CLI:\n"
        "    def f(self, trainer, parser):\n"
        "        trainer._signal_connector.received_sigterm = True\n"
        "        x = getattr(trainer, '_checkpoint_connector', None)\n"
        "        y = self._get(self.config, 'ckpt_path')  # LightningCLI's, on self\n"
        "        z = {a.dest for a in parser._actions}\n"
        "        w = self._own, self._engine_missing, '_not_code', '# trainer._x'\n"
        "        os._exit(0)\n")
    uses = private_uses(planted, tmp_path, seam_names(SEAM))
    where = "planted.py"
    assert uses == [
        f"{where}:1: from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO",
        f"{where}:2: from torch.distributed.fsdp._flat_param import HandleShardingStrategy",
        f"{where}:8: trainer._signal_connector",
        f"{where}:9: getattr(trainer, '_checkpoint_connector')",
        f"{where}:10: self._get",
        f"{where}:11: parser._actions",
    ]


def test_the_seam_names_what_it_wraps_and_imports_nothing_of_the_package():
    names = seam_names(SEAM)
    assert {"_signal_connector", "_get", "_parser", "_subcommand_parsers", "_actions", "_WrappingCheckpointIO",
            "_should_update", "_prefix", "_flat_param", "_trainer", "_train_progress_bar"} <= names
    source = SEAM.read_text()
    assert "import rloo_lightning" not in source and "from rloo_lightning" not in source
    for name in framework.__all__:
        obj = getattr(framework, name)
        if callable(obj):
            assert "Wraps" in (inspect.getdoc(obj) or ""), f"framework.{name}'s docstring names no private API"
