"""The ``rloo-lightning`` command: a LightningCLI over RLOOModule and PromptDataModule."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path

from lightning.pytorch.callbacks.progress import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rloo_lightning.callbacks.checkpoint import FAILURE_CHECKPOINT
from rloo_lightning.callbacks.predict import PredictionWriter
from rloo_lightning.callbacks.progress import StepProgressBar
from rloo_lightning.cli_errors import error_line, parser_message, renamed_message, set_where, unknown_option_message
from rloo_lightning.runtime import console, framework, sigterm
from rloo_lightning.runtime.atomic_checkpoint import install_atomic_checkpoint_io
from rloo_lightning.runtime.checkpoint_check import check_checkpoint_path, local_checkpoint_path
from rloo_lightning.options import check_learning_rate
from rloo_lightning.data import PromptDataModule
from rloo_lightning.engines import engine_class
from rloo_lightning.export import checkpoint_hparams, main as export_main
from rloo_lightning.runtime.importpath import add_cwd_to_sys_path
from rloo_lightning.runtime.renamed import renamed_path
from rloo_lightning.module import RLOOModule

__all__ = ["RLOOCLI", "main", "TRACEBACK_ENV"]

TRACEBACK_ENV = "RLOO_TRACEBACK"  # set to 1: an error propagates with its full traceback
# Lightning's two adverts, logged on every run (logger and checkpoint connectors); dropped by their text.
_LIGHTNING_TIPS = ("💡 Tip: For seamless cloud logging and experiment tracking",
                   "💡 Tip: For seamless cloud uploads and versioning")
# torchao (the int8 extra), which transformers imports at every model load once it is installed: its GPU kernels
# missing on a CPU machine, and torch noting that its enums need no registration. Dropped by their text.
_THIRD_PARTY_NOISE = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}
# Lightning's own use of a torch API that torch deprecated (lightning/pytorch/utilities/_pytree.py).
_PYTREE_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


# (module option, data option) pairs the CLI links: one source of truth. The prompts are tokenized by the
# policy's tokenizer, their lengths checked against its context and completion budget; under rollout reuse the
# data repeats each batch for the updates made on its rollout.
LINKS = (("model.model_name_or_path", "data.tokenizer_name_or_path"),
         ("model.sampling.max_new_tokens", "data.max_new_tokens"),
         ("model.policy.trust_remote_code", "data.trust_remote_code"),
         ("model.policy.gguf_file", "data.gguf_file"),
         ("model.update.updates_per_rollout", "data.repeat_batches"))


class RLOOCLI(LightningCLI):
    """LightningCLI with the data module's tokenizer and budgets linked to the model's options.

    ``only``: the subcommand the command line names (None: it names none). Only that one's parser is built: each
    is built from the signatures of the trainer, the module and the data module, about 0.2 s apiece here, and a
    command runs one. Without a subcommand (``rloo-lightning --help``, a misspelt one) all four are built."""

    def __init__(self, *args, only: str | None = None, **kwargs) -> None:
        self.only = only
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        return _subcommands_built(self.only)

    def add_arguments_to_parser(self, parser) -> None:
        for source, target in LINKS:
            parser.link_arguments(source, target)

    def instantiate_trainer(self, **kwargs):
        """The trainer, with :class:`StepProgressBar` in place of the progress bar Lightning adds by default.

        Only Lightning's own default is replaced: a progress bar among the configured callbacks, or
        ``enable_progress_bar: false``, is left as it is.
        """
        config = framework.cli_get(self, self.config_init, "trainer", default={}) or {}
        given = [*_as_list(config.get("callbacks")), *_as_list(kwargs.get("callbacks")),
                 *_as_list(self.trainer_defaults.get("callbacks")),
                 *[framework.cli_get(self, self.config_init, key)
                   for key in framework.cli_parser(self, self.subcommand).callback_keys]]
        enabled = kwargs.get("enable_progress_bar", config.get("enable_progress_bar"))
        default_bar = enabled is not False and not any(isinstance(c, ProgressBar) for c in given)
        if (self.subcommand in ("validate", "test", "predict") and config.get("logger") in (None, True)
                and config.get("default_root_dir") is None and "logger" not in kwargs):
            logger = _logger_beside_checkpoint(framework.cli_get(self, self.config_init, "ckpt_path"), self.subcommand)
            if logger is not None:
                kwargs["logger"] = logger
        trainer = super().instantiate_trainer(**kwargs)
        # Checkpoint files written beside their destination and renamed into place (never half-written), unless
        # a checkpoint IO plugin of the user's is configured.
        install_atomic_checkpoint_io(trainer.strategy)
        if default_bar:
            at = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, ProgressBar)]
            if len(at) == 1 and type(trainer.callbacks[at[0]]) in (RichProgressBar, TQDMProgressBar):
                trainer.callbacks[at[0]] = StepProgressBar()
        output_file = self.model.cfg.predict.output_file if isinstance(self.model, RLOOModule) else None
        if self.subcommand == "predict" and (output_file or trainer.world_size == 1):
            # An existing predictions file (any rank's: ranks are not numbered yet): refused now, before the log
            # folder or the model. PredictionWriter's setup checks again on every rank, where with several
            # processes the default file's folder is known.
            where = set_where(getattr(self, "_argv", []), "model.predict.output_file", self.subcommand)
            PredictionWriter(output_file).check(trainer, option=where, every_rank=True)
        return trainer

    def parse_arguments(self, parser, args) -> None:
        # `--ckpt_path X` alone is enough for test / predict / validate: the checkpoint's module options become
        # the defaults, so a config file and explicit --model.* options still win (Lightning's own loader, which
        # runs after parsing, needs --model.model_name_or_path given and then overrides what was given).
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, list):
            subcommand = _subcommand_of(argv)
            ckpt = _option_value(argv, "--ckpt_path")
            if subcommand in framework.cli_subcommand_parsers(self) and ckpt:
                check_checkpoint_path(ckpt)  # a truncated or non-checkpoint file: one line naming it
                self._checked_ckpt_path = ckpt
                local = local_checkpoint_path(ckpt)  # None: Lightning's "last" / "best" / "hpc" / "registry" / a URL
                if local is not None:
                    model, data = checkpoint_hparams(local)
                    self._checkpoint_engine = model.get("generation_engine")
                    self._engine_missing = _set_checkpoint_defaults(framework.cli_subcommand_parsers(self)[subcommand],
                                                                    model, data)
        self._argv = [str(a) for a in argv] if isinstance(argv, list) else []  # errors say where an option was set
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as exc:  # an unknown option: named with where it was given and the closest valid one;
            subcommand = _subcommand_of(self._argv)  # a class path of an old module: its new path
            subparser = framework.cli_subcommand_parsers(self).get(subcommand)
            message = parser_message(exc)
            better = (unknown_option_message(message, self._argv, subparser or parser, subcommand)
                      or renamed_message(message, self._argv, subcommand))
            if better is None:
                raise
            raise ArgumentError(None, better) from exc

    def before_instantiate_classes(self) -> None:
        """``ckpt_path`` given in a config file: checked as the command line's is, before the model is built; so is
        the optimizer's learning rate (``fit``), named as the user set it."""
        ckpt = framework.cli_get(self, self.config, "ckpt_path")
        if ckpt is not None and ckpt != getattr(self, "_checked_ckpt_path", None):
            check_checkpoint_path(ckpt)
        self._check_checkpoint_engine()
        if self.subcommand == "fit":  # the only command that builds the optimizer
            for key in ("model.optimizer", "optimizer"):  # the module's, or LightningCLI's own --optimizer
                init_args = getattr(framework.cli_get(self, self.config, key), "init_args", None)
                if init_args is not None and "lr" in init_args:
                    where = set_where(getattr(self, "_argv", []), f"{key}.init_args.lr", self.subcommand,
                                       aliases=(f"{key}.lr",))
                    check_learning_rate(init_args["lr"], where)

    def before_fit(self) -> None:
        """A resume that writes into another folder than its checkpoint's says so in one line (Lightning's "dirpath
        has changed" warning, dropped in :func:`_run`, says it in terms of its own bookkeeping)."""
        line = console.resume_line(self.trainer, framework.cli_get(self, self.config_init, "ckpt_path"))
        if line is not None:
            rank_zero_info(line)

    def _parse_ckpt_path(self) -> None:
        """Done in :meth:`parse_arguments`, as defaults (see there). Overrides a private method of LightningCLI: a
        known dependency, listed and tested in :mod:`rloo_lightning.runtime.framework`."""

    def _check_checkpoint_engine(self) -> None:
        """The checkpoint's generation engine, when its class cannot be imported here and no other is given: fit (a
        resume) stops, since another sampler would change the run; validate, test and predict use the default
        engine. One line either way."""
        missing = getattr(self, "_engine_missing", None)
        if missing is None or framework.cli_get(self, self.config, "model.generation_engine") is not None:
            return
        if self.subcommand == "fit":
            raise ValueError(f"the checkpoint was trained with {missing}; resuming with another engine would change "
                             "the run: name the engine to use with --model.generation_engine")
        warnings.warn(f"the checkpoint was trained with {missing}: {self.subcommand} samples with the default "
                      "engine, DecodeLoopEngine (--model.generation_engine chooses another)", stacklevel=2)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        stored = getattr(self, "_checkpoint_engine", None)
        given = framework.cli_get(self, self.config, "model.generation_engine")
        if isinstance(self.model, RLOOModule) and stored is not None and given is not None:
            # Rebuilt from the checkpoint (the same class and arguments as stored): the module may fall back to
            # the default engine for validate, test and predict when it cannot run here (RLOOModule.setup).
            given = given.as_dict() if hasattr(given, "as_dict") else dict(given)
            self.model.engine_from_checkpoint = (given.get("class_path") == stored["class_path"] and
                                                 _same_args(given.get("init_args"), stored.get("init_args")))


def _logger_beside_checkpoint(ckpt_path: str | None, subcommand: str):
    """The logger of ``validate`` / ``test`` / ``predict`` from a fit's checkpoint (``<run>/checkpoints/x.ckpt``):
    Lightning's default one (TensorBoard's, else CSV), in ``<run>/<subcommand>/version_N``, so that these runs sit
    beside the fit they evaluate, not among the fit runs of the working folder. None (Lightning's default, in the
    working folder) for a checkpoint elsewhere, not on this machine, or in a run folder this process cannot write to
    (a shared model's)."""
    local = local_checkpoint_path(ckpt_path) if ckpt_path else None
    folder = Path(local).resolve().parent if local is not None else None
    if folder is None or folder.name != "checkpoints" or not os.access(folder.parent, os.W_OK):
        return None
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    logger = TensorBoardLogger if framework.tensorboard_available() else CSVLogger
    return logger(save_dir=str(folder.parent), name=subcommand)


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


class _DropLightningTips(logging.Filter):
    """Drops Lightning's two "💡 Tip: ..." adverts (litlogger, litmodels); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_LIGHTNING_TIPS)


class _DropMessages(logging.Filter):
    """Drops the records whose message contains one of ``fragments``; every other record passes."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        return not any(fragment in message for fragment in self.fragments)


def _quiet_third_party() -> None:
    """The CLI run's noise off: Lightning's adverts, its pytree deprecation warning, the weight-loading bar."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
        logger.addFilter(_DropLightningTips())
    for name, fragments in _THIRD_PARTY_NOISE.items():
        other = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in other.filters):
            other.addFilter(_DropMessages(fragments))
    warnings.filterwarnings("ignore", message=_PYTREE_DEPRECATION)
    # transformers' "Loading weights" bar off; the hub's download bars stay as they were.
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    hub_bars_off = are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    if not hub_bars_off:
        enable_progress_bars()


def _option_value(argv: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in ``argv`` (the last one given), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value if value not in (None, "null", "None") else None


def _same_args(given: dict | None, stored: dict | None) -> bool:
    """Whether an engine's parsed ``init_args`` are those stored (what the parser filled in as defaults aside)."""
    given, stored = dict(given or {}), dict(stored or {})
    return all(given.get(name) == value for name, value in stored.items())


def _set_checkpoint_defaults(parser, model: dict, data: dict) -> str | None:
    """Each module and data option stored in the checkpoint becomes the parser's default for ``model.<name>``
    or ``data.<name>`` (the data's linked options follow the model's); so does its generation engine, when its
    class imports here. Returns what names that engine and why it cannot be rebuilt, else None."""
    linked = {target for _, target in LINKS}
    model = dict(model)
    engine, missing = model.pop("generation_engine", None), None
    if engine is not None:
        try:
            engine_class(engine["class_path"])
        except (ImportError, TypeError) as err:
            new = renamed_path(engine["class_path"])  # a path of an old module: the spec that rebuilds it
            spec = json.dumps({"class_path": new, "init_args": engine.get("init_args") or {}})
            missing = (f"{engine['class_path']}, renamed {new} since (--model.generation_engine '{spec}' names it)"
                       if new else f"{engine['class_path']}, which cannot be rebuilt here ({err})")
        else:
            parser.set_defaults({"model.generation_engine": engine})
    items = [(f"model.{name}", value) for name, value in model.items()]
    items += [(f"data.{name}", value) for name, value in data.items() if f"data.{name}" not in linked]
    defaults = {}
    for prefix, value in items:
        for field, v in value.items() if isinstance(value, dict) and prefix.startswith("model.") else [(None, value)]:
            key = prefix + (f".{field}" if field else "")
            try:
                parser.get_default(key)
            except KeyError:
                continue  # an option this version does not have
            defaults[key] = v
    parser.set_defaults(defaults)
    return missing


def run() -> None:
    """The ``rloo-lightning`` command and ``python -m rloo_lightning``: :func:`main`, then a quick exit.

    When a process ends, Python's last garbage collections scan every object of every module imported (torch,
    lightning and transformers leave about 360,000 of them). So once the command is over, what is garbage is
    collected as at any exit (files closed, buffers flushed), and what is left, all reachable from the modules, is
    frozen out of those scans (``gc.freeze``): a 4-step tiny fit's process takes 5.72 s instead of 6.64 s on this
    project's 2-core machine (medians of 5; benchmarks/README.md). Every file the command wrote is closed by then;
    only a cycle that the interpreter's own teardown would have freed keeps its finalizer unrun. :func:`main`
    itself, called in a process that goes on, leaves the collector alone."""
    try:
        main()
    finally:
        gc.collect()
        gc.freeze()


def main(args: list[str] | None = None) -> None:
    """The CLI: ``args`` (default ``sys.argv[1:]``) as ``rloo-lightning`` takes them (:func:`run` is the command)."""
    # Reward functions and class_path values in the working directory (myreward.py next to the
    # data) are importable; appended, so a user's datasets.py cannot shadow a dependency. DDP ranks
    # re-run this command, so they get it too; reward workers get the parent's directory.
    add_cwd_to_sys_path()
    _quiet_third_party()
    console.install()  # warnings as `warning: <message>` lines; nothing glued to a progress bar
    sigterm.install()  # from here a SIGTERM or Ctrl-C ends the run promptly at any point, keeping what there is to keep
    try:
        _run_reporting_errors(args)
    except SIGTERMException:  # a SystemExit with no code (status 0): a scheduler that preempted the run must
        if sigterm.phase() == "setup" and sigterm.rank_zero():
            sys.stderr.write(f"stopped by {sigterm.signal_name()} before the first training step of this run: "
                             "nothing to save\n")
        sys.exit(sigterm.exit_code())  # not read it as success: 143 or 130, as a process killed by the signal


def _run_reporting_errors(args: list[str] | None) -> None:
    if os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        _run(args)  # errors propagate with their traceback
        return
    try:
        _run(args)
    except ArgumentError as exc:  # a parse error: one line instead of the usage and the line
        sys.stderr.write(f"error: {exc.message if getattr(exc, 'message', None) else exc}\n"
                         f"(see rloo-lightning {_subcommand(args)}--help for the options)\n")
        sys.exit(2)
    except Exception as exc:  # KeyboardInterrupt and SystemExit are no Exception: they pass
        if sigterm.phase() == "setup" and sigterm.peer_stopped():  # another node's stop ended a collective here
            raise SIGTERMException("a peer rank was stopped") from exc
        # A fit that failed after its first step: the line names the checkpoint it left (FinalCheckpoint).
        kept = FAILURE_CHECKPOINT
        where = f"; {kept['path']} holds step {kept['step']}: resume with --ckpt_path {kept['path']}" if kept else ""
        sys.stderr.write(f"{error_line(exc)}{where}\n(set {TRACEBACK_ENV}=1 for the full traceback)\n")
        sys.exit(1)


def _subcommands_built(only: str | None) -> dict[str, set[str]]:
    """LightningCLI's subcommands whose parsers a command builds: ``only`` if it is one, else all four."""
    every = LightningCLI.subcommands()
    return {only: every[only]} if only in every else every


def _subcommand_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (``fit``, ``test``, ..., ``export``, ``serve``), wherever it stands: a top-level
    ``--config file.yaml`` may come before it."""
    return next((a for a in argv if a in (*LightningCLI.subcommands(), "export", "serve")), None)


def _subcommand(args: list[str] | None) -> str:
    first = _subcommand_of(sys.argv[1:] if args is None else args)
    return f"{first} " if first in LightningCLI.subcommands() else ""


def _run(args: list[str] | None) -> None:
    argv = sys.argv[1:] if args is None else args
    subcommand = _subcommand_of(argv)
    if subcommand == "export":  # not a Trainer method, so not a LightningCLI subcommand
        export_main(argv[argv.index("export") + 1:])
        return
    if subcommand == "serve":  # a vLLM server for VLLMServerEngine: this process becomes it
        from rloo_lightning.serve import main as serve_main

        serve_main(argv[argv.index("serve") + 1:])
        return
    # A run from a checkpoint has a folder of its own. Lightning's note that the checkpoint callback's folder
    # changed (so its list of best checkpoints starts again there) is left out: test / predict / validate save
    # nothing, and a resumed fit that writes into a new folder says so in a line of its own (before_fit).
    warnings.filterwarnings("ignore", message="The dirpath has changed from")
    # exit_on_error=False: a parse error raises (main prints it as one line) instead of printing the usage.
    # allow_abbrev=False: a misspelt option is an error, never another option's prefix (--trainer.max_step).
    strict = {"exit_on_error": False, "allow_abbrev": False}
    parser_kwargs = {**strict, **{name: dict(strict) for name in _subcommands_built(subcommand)}}
    # seed_everything 0 unless configured: what Lightning falls back to anyway, without its "No seed found" warning.
    cli = RLOOCLI(RLOOModule, PromptDataModule, save_config_kwargs={"overwrite": True}, parser_kwargs=parser_kwargs,
                  seed_everything_default=0, args=args, only=subcommand)
    console.report_outputs(cli.trainer, cli.subcommand)  # one line: where the checkpoint, logs, predictions went
