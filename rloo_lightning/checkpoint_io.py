"""Moved: the writing to :mod:`rloo_lightning.runtime.atomic_checkpoint`, the checking to
:mod:`rloo_lightning.runtime.checkpoint_check`; this path will be removed."""
from rloo_lightning._moved import moved

_CHECKING = ("check_checkpoint_path", "checkpoint_file_problem", "local_checkpoint_path", "LIGHTNING_KEYS",
             "optimizer_state_ratio")

__getattr__ = moved(__name__, "rloo_lightning.runtime.atomic_checkpoint",
                    dict.fromkeys(_CHECKING, "rloo_lightning.runtime.checkpoint_check"))
