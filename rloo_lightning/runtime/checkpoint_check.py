"""What is wrong with a checkpoint that does not load, said before torch reads it: a ``--ckpt_path`` check.

:func:`check_checkpoint_path` tells a truncated file, a file that is not a checkpoint and an
incomplete sharded folder apart without loading the weights: a zip archive's central directory sits at its
end (a cut-off save has none), and the archive's small ``data.pkl`` (the pickled structure: keys and
hyperparameters, tensors by reference) is scanned, not unpickled, for the keys every Lightning checkpoint has.
A missing file whose previous version a cut-off folder swap left under a ``.<name>.old-...`` name
(:mod:`rloo_lightning.runtime.atomic_checkpoint`) is named in the error.

:func:`optimizer_state_ratio` serves the other check, made before training
(:class:`~rloo_lightning.callbacks.FinalCheckpoint`): whether a fit's checkpoints will fit where they go.
"""

from __future__ import annotations

import inspect
import os
import pickletools
import struct
import zipfile
from pathlib import Path

import torch

from rloo_lightning.runtime.atomic_checkpoint import local_path

__all__ = ["check_checkpoint_path", "checkpoint_file_problem", "local_checkpoint_path", "LIGHTNING_KEYS",
           "optimizer_state_ratio"]

# Every checkpoint Lightning writes has both (Lightning itself reads the version before anything else).
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")
# ``ckpt_path`` values that Lightning resolves itself ("registry:<name>" too).
_SPECIAL = ("last", "best", "hpc")
_LEGACY_TORCH = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # the legacy format's magic number
_TRUNCATED = "truncated (the file ends before its zip directory; a save was cut off?)"


def _describe(head: bytes) -> str:
    """What a file that is no zip archive looks like, from its first bytes."""
    if head.startswith(b"GGUF"):
        return "a GGUF model file"
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 1:
        return "a safetensors file: weights only"
    if head[:1] == b"\x80":
        return "a pickle file, not one written by torch.save"
    try:
        text = head.decode("utf-8").lstrip()
    except UnicodeDecodeError:
        return "not a zip archive, which is what torch.save writes"
    if text[:1] in ("{", "["):
        return "a JSON file"
    return "a text file"


def _pickle_strings(data: bytes) -> set[str]:
    """The string constants of a pickle, read with ``pickletools`` (nothing is executed or built)."""
    return {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}


def checkpoint_file_problem(path: str | os.PathLike, keys: tuple[str, ...] = LIGHTNING_KEYS) -> str | None:
    """What is wrong with a checkpoint file, as the end of a sentence; None when it looks whole.

    Cheap whatever the file's size: the zip's central directory (at its end: a save cut off has none) and its
    ``data.pkl`` (the pickled structure without the tensors' bytes: a few KB to a few MB), scanned for
    ``keys``. A file in torch's legacy (non-zip) format is passed on unchecked.
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        return "truncated (an empty file; a save was cut off?)"
    with open(path, "rb") as f:
        head = f.read(64)
    if not zipfile.is_zipfile(path):
        if head.startswith(b"PK\x03\x04") or b"PK\x03\x04".startswith(head):
            return _TRUNCATED  # a zip's first entry, and no central directory after it
        if head.startswith(_LEGACY_TORCH):
            return None
        return f"is not a checkpoint ({_describe(head)})"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            pickles = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
            if not pickles:
                return "is not a checkpoint (a zip archive, but not one written by torch.save)"
            strings = _pickle_strings(archive.read(pickles[0]))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as exc:
        return f"is damaged (its zip archive does not read: {exc})"
    missing = [k for k in keys if k not in strings]
    if missing:
        return f"is not a checkpoint (a torch.save file without Lightning's {' and '.join(map(repr, missing))})"
    return None


def _folder_problem(path: Path) -> str | None:
    meta, dcp = path / "meta.pt", path / ".metadata"
    if (path / "latest").is_file():  # DeepSpeed's folder: its own loader checks it
        return None
    if meta.is_file():
        problem = checkpoint_file_problem(meta, keys=LIGHTNING_KEYS[:1])
        if problem:
            return f"is a sharded checkpoint whose meta.pt {problem if problem.startswith('is ') else 'is ' + problem}"
        if not dcp.is_file():
            return "is an incomplete sharded checkpoint (no .metadata: a save was cut off?)"
        return None
    if dcp.is_file() or any(p.suffix == ".distcp" for p in path.iterdir()):
        return "is an incomplete sharded checkpoint (no meta.pt: a save was cut off?)"
    return "is a folder, not a checkpoint (a sharded checkpoint folder holds meta.pt and .metadata)"


def local_checkpoint_path(path: str | os.PathLike) -> str | None:
    """The local path a ``ckpt_path`` names; None for Lightning's special values (``last``, ``best``, ``hpc``,
    ``registry[:...]``) and remote fsspec URLs, which Lightning resolves itself."""
    text = os.fspath(path)
    lowered = text.lower()
    if text in _SPECIAL or lowered == "registry" or lowered.startswith("registry:"):
        return None
    return local_path(text)


def check_checkpoint_path(path: str | os.PathLike | None, option: str = "--ckpt_path",
                          lightning_values: bool = True, keys: tuple[str, ...] = LIGHTNING_KEYS) -> None:
    """Raise one clear error when ``path`` is not a checkpoint that loads: ``<option> <path>: truncated (...)``,
    ``... is not a checkpoint (...)``, ``... does not exist`` (a ``FileNotFoundError``; the others are
    ``ValueError``). Remote URLs are left to Lightning, and so are its special values unless
    ``lightning_values`` is False (``export``: no trainer resolves them there, ``last`` is a file name). ``keys``:
    what the pickled structure must name (export reads a plain state dict too: none)."""
    if path is None:
        return
    local = local_checkpoint_path(path) if lightning_values else local_path(path)
    if local is None:
        return
    text = os.fspath(path)
    p = Path(local)
    if not p.exists():
        old = sorted(p.parent.glob(f".{p.name}.old-*")) if p.parent.is_dir() else []
        hint = (f" (a save was cut off while swapping it in: the previous one is {old[-1]}; rename it back)"
                if old else "")
        raise FileNotFoundError(f"{option} {text}: does not exist{hint}")
    problem = _folder_problem(p) if p.is_dir() else checkpoint_file_problem(p, keys)
    if problem:
        raise ValueError(f"{option} {text}: {problem}")


def optimizer_state_ratio(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of state ``optimizer`` keeps per byte of the parameters it steps (AdamW: 2, its two moments; SGD with
    momentum: 1; plain SGD: 0), measured by one step of the same class and settings on a probe parameter: its state
    exists only after a first step. An optimizer that cannot be probed so (its constructor takes other arguments,
    a device-only option) counts as 0: the estimate it serves stays a lower bound."""
    probe = torch.zeros(8, 8, requires_grad=True)  # a matrix: factored states (Adafactor) stay small, as they do
    try:
        settings = dict(optimizer.defaults)  # a wrapper (DeepSpeed's) may have none
        for key, off in (("fused", None), ("foreach", None), ("capturable", False), ("differentiable", False)):
            if key in settings:
                settings[key] = off  # device-specific ways of stepping, not what is stored
        accepted = inspect.signature(type(optimizer)).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            # defaults the constructor sets itself (AdamW's decoupled_weight_decay) are no argument of it
            settings = {key: value for key, value in settings.items() if key in accepted}
        trial = type(optimizer)([probe], **settings)
        probe.grad = torch.zeros_like(probe)
        trial.step()
        state = trial.state.get(probe, {})
    except Exception:  # any optimizer's own refusal: no estimate for it
        return 0.0
    per_element = [t for t in state.values() if isinstance(t, torch.Tensor) and t.numel() >= probe.numel()]
    return sum(t.numel() * t.element_size() for t in per_element) / (probe.numel() * probe.element_size())
