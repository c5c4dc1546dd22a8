"""The ``rloo-lightning`` command: a LightningCLI over RLOOModule and PromptDataModule."""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path

from lightning.pytorch.callbacks.progress import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from rloo_lightning import stop
from rloo_lightning.callbacks.progress import StepProgressBar
from rloo_lightning.checkpoint_io import check_checkpoint_path, install_atomic_checkpoint_io, local_checkpoint_path
from rloo_lightning.config import RENAMED
from rloo_lightning.data import PromptDataModule
from rloo_lightning.export import checkpoint_hparams, main as export_main
from rloo_lightning.importpath import add_cwd_to_sys_path
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
# Exception types whose message says it all; other types are named on the error line (NonFiniteError: ...).
_PLAIN_ERRORS = (ValueError, RuntimeError, OSError, FileNotFoundError, ImportError, ModuleNotFoundError, TypeError,
                 NotImplementedError, MisconfigurationException)


# (module option, data option) pairs the CLI links: one source of truth. The prompts are tokenized by the
# policy's tokenizer, their lengths checked against its context and completion budget; under rollout reuse the
# data repeats each batch for the updates made on its rollout.
LINKS = (("model.model_name_or_path", "data.tokenizer_name_or_path"),
         ("model.sampling.max_new_tokens", "data.max_new_tokens"),
         ("model.policy.trust_remote_code", "data.trust_remote_code"),
         ("model.policy.gguf_file", "data.gguf_file"),
         ("model.update.updates_per_rollout", "data.repeat_batches"))


class RLOOCLI(LightningCLI):
    """LightningCLI with the data module's tokenizer and budgets linked to the model's options."""

    def add_arguments_to_parser(self, parser) -> None:
        for source, target in LINKS:
            parser.link_arguments(source, target)

    def instantiate_trainer(self, **kwargs):
        """The trainer, with :class:`StepProgressBar` in place of the progress bar Lightning adds by default.

        Only Lightning's own default is replaced: a progress bar among the configured callbacks, or
        ``enable_progress_bar: false``, is left as it is.
        """
        config = self._get(self.config_init, "trainer", default={}) or {}
        given = [*_as_list(config.get("callbacks")), *_as_list(kwargs.get("callbacks")),
                 *_as_list(self.trainer_defaults.get("callbacks")),
                 *[self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys]]
        enabled = kwargs.get("enable_progress_bar", config.get("enable_progress_bar"))
        default_bar = enabled is not False and not any(isinstance(c, ProgressBar) for c in given)
        trainer = super().instantiate_trainer(**kwargs)
        # Checkpoint files written beside their destination and renamed into place (never half-written), unless
        # a checkpoint IO plugin of the user's is configured.
        install_atomic_checkpoint_io(trainer.strategy)
        if default_bar:
            at = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, ProgressBar)]
            if len(at) == 1 and type(trainer.callbacks[at[0]]) in (RichProgressBar, TQDMProgressBar):
                trainer.callbacks[at[0]] = StepProgressBar()
        return trainer

    def parse_arguments(self, parser, args) -> None:
        # `--ckpt_path X` alone is enough for test / predict / validate: the checkpoint's module options become
        # the defaults, so a config file and explicit --model.* options still win (Lightning's own loader, which
        # runs after parsing, needs --model.model_name_or_path given and then overrides what was given).
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, list):
            subcommand = _subcommand_of(argv)
            ckpt = _option_value(argv, "--ckpt_path")
            if subcommand in getattr(self, "_subcommand_parsers", {}) and ckpt:
                check_checkpoint_path(ckpt)  # a truncated or non-checkpoint file: one line naming it
                self._checked_ckpt_path = ckpt
                local = local_checkpoint_path(ckpt)  # None: Lightning's "last" / "best" / "hpc" / "registry" / a URL
                if local is not None:
                    _set_checkpoint_defaults(self._subcommand_parsers[subcommand], *checkpoint_hparams(local))
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        """``ckpt_path`` given in a config file: checked as the command line's is, before the model is built."""
        ckpt = self._get(self.config, "ckpt_path")
        if ckpt is not None and ckpt != getattr(self, "_checked_ckpt_path", None):
            check_checkpoint_path(ckpt)

    def _parse_ckpt_path(self) -> None:
        """Done in :meth:`parse_arguments`, as defaults (see there)."""


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


def _error_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    chain, seen = [exc], {id(exc)}
    while True:
        last = chain[-1]
        inner = last.__cause__ if last.__cause__ is not None else (
            None if last.__suppress_context__ else last.__context__)
        if inner is None or id(inner) in seen:
            return chain
        chain.append(inner)
        seen.add(id(inner))


def _is_wrapper(exc: BaseException) -> bool:
    """An exception that only carries another: raised by the argument parser, or with no message of its own."""
    module = type(exc).__module__ or ""
    from_parser = isinstance(exc, ArgumentError) or module.split(".")[0] in ("jsonargparse", "argparse")
    return from_parser or not str(exc).strip()


def error_line(exc: BaseException) -> str:
    """The one line that says what went wrong: the innermost useful message of ``exc``'s chain."""
    chain = _error_chain(exc)
    useful = next((e for e in chain if not _is_wrapper(e)), None)
    if useful is None:  # only wrappers: the innermost one with a message
        useful = next((e for e in reversed(chain) if str(e).strip()), exc)
    message = str(useful).strip()  # a message written on several lines keeps them
    name = type(useful).__name__
    if type(useful) in _PLAIN_ERRORS and message:
        return f"error: {message}"
    return f"error: {name}: {message}" if message else f"error: {name}"


def _option_value(argv: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in ``argv`` (the last one given), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value if value not in (None, "null", "None") else None


def _set_checkpoint_defaults(parser, model: dict, data: dict) -> None:
    """Each module and data option stored in the checkpoint becomes the parser's default for ``model.<name>``
    or ``data.<name>`` (the data's linked options follow the model's)."""
    linked = {target for _, target in LINKS}
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


def _renamed_options(args: list[str]) -> list[str]:
    """Old flat module options in ``args``: ``--model.beta``, or ``model: {beta: ...}`` in a ``--config`` file."""
    found = []
    for i, arg in enumerate(args):
        name = arg[len("--model."):].split("=", 1)[0] if arg.startswith("--model.") else None
        if name in RENAMED:
            found.append(name)
        if arg == "--config" and i + 1 < len(args) or arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1] if "=" in arg else args[i + 1])
            if path.is_file():
                import yaml

                try:
                    model = (yaml.safe_load(path.read_text()) or {}).get("model")
                except yaml.YAMLError:
                    continue  # jsonargparse reports it
                found += [key for key in model or {} if isinstance(model, dict) and key in RENAMED]
    return found


def main(args: list[str] | None = None) -> None:
    """Entry point of ``rloo-lightning`` and ``python -m rloo_lightning``."""
    # Reward functions and class_path values in the working directory (myreward.py next to the
    # data) are importable; appended, so a user's datasets.py cannot shadow a dependency. DDP ranks
    # re-run this command, so they get it too; reward workers get the parent's directory.
    add_cwd_to_sys_path()
    renamed = _renamed_options(sys.argv[1:] if args is None else args)
    if renamed:
        lines = "\n".join(f"  model.{name} -> model.{RENAMED[name]}" for name in renamed)
        sys.exit(f"error: RLOOModule's options are grouped now; rename:\n{lines}")
    _quiet_third_party()
    stop.install()  # from here a SIGTERM ends the run promptly at any point, keeping what there is to keep
    try:
        _run_reporting_errors(args)
    except SIGTERMException:  # a SystemExit with no code (status 0): a scheduler that preempted the run must
        if stop.phase() == "setup" and os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
            sys.stderr.write("stopped by SIGTERM before the first training step of this run: nothing to save\n")
        sys.exit(128 + signal.SIGTERM)  # not read it as success; 143, as a process killed by the signal


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
        sys.stderr.write(f"{error_line(exc)}\n(set {TRACEBACK_ENV}=1 for the full traceback)\n")
        sys.exit(1)


def _subcommand_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (``fit``, ``test``, ..., ``export``), wherever it stands: a top-level
    ``--config file.yaml`` may come before it."""
    return next((a for a in argv if a in (*LightningCLI.subcommands(), "export")), None)


def _subcommand(args: list[str] | None) -> str:
    first = _subcommand_of(sys.argv[1:] if args is None else args)
    return f"{first} " if first in LightningCLI.subcommands() else ""


def _run(args: list[str] | None) -> None:
    argv = sys.argv[1:] if args is None else args
    subcommand = _subcommand_of(argv)
    if subcommand == "export":  # not a Trainer method, so not a LightningCLI subcommand
        export_main(argv[argv.index("export") + 1:])
        return
    if subcommand != "fit":
        # test / predict / validate from a checkpoint run in a new log folder: the checkpoint callback's note
        # that its folder changed is true and harmless there (nothing is saved).
        warnings.filterwarnings("ignore", message="The dirpath has changed from")
    # exit_on_error=False: a parse error raises (main prints it as one line) instead of printing the usage.
    parser_kwargs = {"exit_on_error": False, **{name: {"exit_on_error": False} for name in LightningCLI.subcommands()}}
    # seed_everything 0 unless configured: what Lightning falls back to anyway, without its "No seed found" warning.
    RLOOCLI(RLOOModule, PromptDataModule, save_config_kwargs={"overwrite": True}, parser_kwargs=parser_kwargs,
            seed_everything_default=0, args=args)
