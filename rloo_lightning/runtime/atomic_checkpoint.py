"""Checkpoints that cannot be half-written, and a write that fails for lack of space said in one line.

**Writing.** Lightning's :class:`~lightning.fabric.plugins.io.torch_io.TorchCheckpointIO` saves through an
fsspec transaction: the whole checkpoint goes to a temporary file made by ``tempfile.mkstemp()`` (in
``$TMPDIR``), which is then moved into place. On the checkpoint's own filesystem the move is a rename; across
filesystems (``$TMPDIR`` on a local disk or ``/dev/shm``, checkpoints on a shared one: the usual case on
clusters) it is a copy that writes the destination in place, and a kill during it leaves a truncated file.

:func:`atomic_write` writes next to the destination instead, whatever ``$TMPDIR`` is: the data goes to an
anonymous file of the destination's folder (Linux ``O_TMPFILE``: it has no name, so a kill while it is written
leaves nothing behind) or, where the filesystem has no ``O_TMPFILE`` or the file cannot be given a name
afterwards, to a hidden ``.<name>.tmp-<pid>@<host>-<random>`` file; it is flushed and ``fsync``-ed, renamed
over the destination (``os.replace``: atomic on a POSIX filesystem) and the folder is ``fsync``-ed. A kill at
any moment leaves the old file or the new one under the destination's name, never a part of one. A hidden
temporary file that a kill left behind is never mistaken for a checkpoint (it does not end in ``.ckpt``); the
next save into the same folder removes those of dead processes of this host (:func:`remove_stale_temps`).

:class:`AtomicCheckpointIO` is Lightning's ``TorchCheckpointIO`` with that write (a remote fsspec URL still goes
through Lightning's own save); :func:`install_atomic_checkpoint_io` puts it on a strategy that has Lightning's
default one. :func:`replace_path` swaps a staged folder (a sharded checkpoint) in with renames
(``renameat2(RENAME_EXCHANGE)`` where the kernel and filesystem have it: one atomic step).

**Space.** A write that fails for lack of space (``ENOSPC``/``EDQUOT``, or the ``RuntimeError`` of torch's zip writer,
``unexpected pos ...``, that hides it: told by the free space left) raises :class:`NoSpaceError`, one line saying
where, how large the checkpoint and how much is free, and that the previous checkpoint is whole (its temporary
file is gone). :func:`free_bytes` serves the check made before training
(:class:`~rloo_lightning.callbacks.FinalCheckpoint`).

What is wrong with a checkpoint that does not load (a ``--ckpt_path``), and the estimate of a checkpoint's size for
the check before training, are :mod:`rloo_lightning.runtime.checkpoint_check`'s.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from rloo_lightning.runtime import framework

__all__ = ["AtomicCheckpointIO", "atomic_write", "atomic_copy", "replace_path", "staging_path", "remove_stale_temps",
           "install_atomic_checkpoint_io", "saves_a_folder", "local_path", "NoSpaceError", "no_space_error",
           "free_bytes", "nearest_existing", "storage_bytes", "MB"]

_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)@(?P<host>.*)-[0-9a-f]{8}$")
_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
_AT_FDCWD, _AT_EMPTY_PATH, _RENAME_EXCHANGE = -100, 0x1000, 2
# How an O_TMPFILE file is given a name, per filesystem (st_dev): "empty_path", "proc", or None (named temp files).
_LINK_METHOD: dict[int, str | None] = {}
_USE_TMPFILE = hasattr(os, "O_TMPFILE") and sys.platform.startswith("linux")
MB = 1e6  # sizes in messages, as `df -H` and the issue trackers write them
_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


# -- writing -----------------------------------------------------------------------------------------------------
def staging_path(target: str | os.PathLike, kind: str = "tmp") -> str:
    """A hidden name next to ``target`` for its next version: ``.<name>.tmp-<pid>@<host>-<random>``."""
    target = os.path.abspath(os.fspath(target))
    folder, name = os.path.split(target)
    return os.path.join(folder, f".{name}.{kind}-{os.getpid()}@{_HOST}-{secrets.token_hex(4)}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process, or no way to tell: keep its file
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_stale_temps(folder: str | os.PathLike) -> list[str]:
    """Remove the hidden temporary files and folders that a killed save of this host left in ``folder``.

    Only those of processes that no longer run (their pid is in the name; another host's are left alone). A
    ``.<name>.old-...`` one is the previous checkpoint of a folder swap cut off between its two renames: it is
    renamed back to ``<name>`` when nothing took that name since, else removed. Returns the names handled.
    """
    handled = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return handled
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if not m or m["host"] != _HOST or _pid_alive(int(m["pid"])):
            continue
        target = os.path.join(folder, m["name"])
        try:
            if m["kind"] == "old" and not os.path.lexists(target):
                os.rename(entry.path, target)
            else:
                _remove(entry.path)
        except OSError:
            continue
        handled.append(entry.name)
    return handled


def _fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened or synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _link_anonymous(fd: int, path: str, method: str) -> None:
    """Give the ``O_TMPFILE`` file open as ``fd`` the name ``path``."""
    if method == "empty_path":
        libc = _libc()
        if libc is None or libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) != 0:
            err = ctypes.get_errno() if libc is not None else errno.ENOSYS
            raise OSError(err, os.strerror(err), path)
    else:
        os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)


def _link_method(folder: str) -> str | None:
    """How an anonymous file of ``folder`` can be named, probed once per filesystem: ``linkat(AT_EMPTY_PATH)``
    (privileged on older kernels), ``/proc/self/fd`` (the unprivileged way, absent in some sandboxes), or None."""
    if not _USE_TMPFILE:
        return None
    try:
        dev = os.stat(folder).st_dev
    except OSError:
        return None
    if dev not in _LINK_METHOD:
        _LINK_METHOD[dev] = None
        for method in ("empty_path", "proc"):
            probe = staging_path(os.path.join(folder, "probe"))
            try:
                fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            except OSError:
                break  # no O_TMPFILE on this filesystem
            try:
                _link_anonymous(fd, probe, method)
                os.unlink(probe)
                _LINK_METHOD[dev] = method
                break
            except OSError:
                continue
            finally:
                os.close(fd)
    return _LINK_METHOD[dev]


def _open_anonymous(folder: str) -> tuple[int, str] | None:
    method = _link_method(folder)
    if method is None:
        return None
    try:
        return os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666), method  # mode: as a plain file's
    except OSError:
        return None


def atomic_write(target: str | os.PathLike, write: Callable[[IO[bytes]], Any], size: int | None = None) -> None:
    """Write ``target`` through ``write(file)`` so that it holds the old content or the new, never a part.

    The data is written next to ``target`` (never in ``$TMPDIR``), synced to disk, and renamed over it. On
    any error (or ``KeyboardInterrupt``) the temporary file is removed and ``target`` is left as it was; an error
    for lack of space is raised as :class:`NoSpaceError` (``size``: about how many bytes ``write`` writes, for its
    message and to tell a torch write error on a full filesystem from another one; see :func:`no_space_error`).
    A ``target`` that is a symlink is replaced by the file (the link's target is left alone), as Lightning does.
    ``write`` is called once, or twice where naming an anonymous file fails after the probe said it works.
    """
    target = os.path.abspath(os.fspath(target))
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    remove_stale_temps(folder)
    tmp: str | None = None
    try:
        tmp = _write_beside(target, folder, write)
        replace_path(tmp, target)
        tmp = None
    except Exception as exc:
        if tmp is not None:
            _remove(tmp)  # first: the free space the message reports is what the failed write had
            tmp = None
        error = no_space_error(exc, target, size)
        if error is not None:
            raise error from exc
        raise
    finally:
        if tmp is not None:
            _remove(tmp)


def _write_beside(target: str, folder: str, write: Callable[[IO[bytes]], Any]) -> str:
    """Write the next version of ``target`` into a file of ``folder``, synced; returns its (hidden) name. On an
    error nothing is left: the anonymous file has no name, a named one is removed."""
    tmp: str | None = None
    try:
        anonymous = _open_anonymous(folder)
        if anonymous is not None:
            fd, method = anonymous
            with os.fdopen(fd, "wb") as f:  # no name yet: a kill now leaves nothing behind
                write(f)
                f.flush()
                os.fsync(f.fileno())
                name = staging_path(target)
                try:
                    _link_anonymous(f.fileno(), name, method)
                    tmp = name
                except OSError:
                    _LINK_METHOD[os.stat(folder).st_dev] = None  # named temporary files from now on
        if tmp is None:
            tmp = staging_path(target)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        written, tmp = tmp, None
        return written
    finally:
        if tmp is not None:
            _remove(tmp)


def _exchange(a: str, b: str) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    func = getattr(libc, "renameat2", None) if libc is not None else None
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
        return False
    raise OSError(err, os.strerror(err), b)


def replace_path(staged: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put ``staged`` (a file or a folder next to ``target``) in ``target``'s place, and drop the old one.

    A file over a file or a symlink: one ``os.replace``. A folder involved: the two are exchanged in one
    atomic step where the kernel and filesystem support it (Linux ``renameat2``; ext4, xfs, btrfs, tmpfs...),
    else ``target`` is renamed aside to ``.<name>.old-...`` and ``staged`` into its place: a kill between
    those two renames leaves the previous checkpoint under the ``.old-`` name, which the next save into the
    folder renames back (:func:`remove_stale_temps`). The folder is synced after the rename.
    """
    staged, target = os.fspath(staged), os.fspath(target)
    if not os.path.lexists(target):
        os.rename(staged, target)
    elif not os.path.isdir(staged) and (os.path.islink(target) or not os.path.isdir(target)):
        os.replace(staged, target)
    elif _exchange(staged, target):
        _remove(staged)  # it holds the old checkpoint now
    else:
        old = staging_path(target, "old")
        os.rename(target, old)
        os.rename(staged, target)
        _remove(old)
    _fsync_dir(os.path.dirname(os.path.abspath(target)))


def _fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def atomic_copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy a checkpoint file, or a sharded checkpoint folder, to ``target`` through a copy staged next to it
    (never in ``$TMPDIR``) and renamed into place: a kill leaves the old ``target`` or the whole copy."""
    source, target = os.fspath(source), os.path.abspath(os.fspath(target))
    if not os.path.isdir(source):
        with open(source, "rb") as src:
            def copy(f: IO[bytes]) -> None:
                src.seek(0)
                shutil.copyfileobj(src, f, 16 * 1024 * 1024)

            atomic_write(target, copy, size=os.fstat(src.fileno()).st_size)
        return
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    remove_stale_temps(folder)
    staged = staging_path(target)
    try:
        shutil.copytree(source, staged, symlinks=True)
        _fsync_tree(staged)
        replace_path(staged, target)
    finally:
        if os.path.lexists(staged):
            _remove(staged)


# -- space -------------------------------------------------------------------------------------------------------
class NoSpaceError(OSError):
    """A checkpoint that does not fit where it goes (``errno.ENOSPC``); its message is the whole line."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(errno.ENOSPC, message, path)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # pickled (ddp_spawn): rebuilt from its own arguments, not OSError's
        return type(self), (self.message, self.filename)


def nearest_existing(path: str | os.PathLike) -> str:
    """``path``, or its nearest folder that exists (a checkpoint folder is made at its first save)."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free for this user on the filesystem that holds ``path`` (or would: its nearest existing folder)."""
    return shutil.disk_usage(nearest_existing(path)).free


def storage_bytes(obj: Any) -> int:
    """The bytes of the tensors ``torch.save(obj)`` writes: each storage once (tied weights, views), found in
    nested dicts, lists and tuples. The file is larger by its zip records and pickled structure
    (measured: see ``docs/reliability.md``, "A full disk")."""
    seen: set[tuple[int, int]] = set()
    total, stack = 0, [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
            except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (a subclass)
                total += item.numel() * item.element_size()
                continue
            if key not in seen:
                seen.add(key)
                total += key[1]
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _errnos(exc: BaseException) -> set[int]:
    """The ``errno`` of every OSError in ``exc``'s chain (torch's zip writer raises a ``RuntimeError`` while
    handling the file's ``ENOSPC``), and in the per-rank failures a ``torch.distributed.checkpoint`` save gathers."""
    found: set[int] = set()
    stack, seen = [exc], set()
    while stack:
        item = stack.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno is not None:
            found.add(item.errno)
        failures = getattr(item, "failures", None)  # CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            stack.extend(f[0] if isinstance(f, tuple) and f else f for f in failures.values())
        stack.extend([item.__cause__, item.__context__])
    return found


def no_space_error(exc: BaseException, target: str | os.PathLike, size: int | None = None) -> NoSpaceError | None:
    """The :class:`NoSpaceError` to raise for ``exc``, a failed write of checkpoint ``target``, when it failed for
    lack of space; else None. Called after the failed write's temporary file is removed (the free space is then
    what the write had), on the process that wrote.

    Lack of space: an ``ENOSPC`` or ``EDQUOT`` in the error's chain, or a ``RuntimeError`` (torch's zip writer:
    ``unexpected pos ...``, ``file write failed``, which may hide the errno) while the filesystem has less free than
    ``size`` (the checkpoint's bytes) and its overhead (1 MiB + 1%): such a write cannot have succeeded. The message
    names the folder, the checkpoint's size and the free space, and says that the previous checkpoint is whole."""
    if isinstance(exc, NoSpaceError):
        return exc
    target = os.path.abspath(os.fspath(target))
    folder, name = os.path.split(target)
    try:
        free = free_bytes(folder)
    except OSError:
        return None
    codes = _errnos(exc)
    quota = getattr(errno, "EDQUOT", None) in codes and errno.ENOSPC not in codes
    if not codes & _SPACE_ERRNOS and not (
            isinstance(exc, RuntimeError) and size is not None and free < size + size // 100 + 2 ** 20):
        return None
    of = f" of ~{size / MB:.1f} MB" if size else ""
    previous = (f"the previous {name} is whole (not replaced)" if os.path.lexists(target)
                else f"no {name} was written")
    where = "the disk quota is used up on" if quota else "no space left on"
    return NoSpaceError(f"{where} {folder} (checkpoint {name}{of}, {free / MB:.1f} MB free): {previous}; free some "
                        "space or write checkpoints elsewhere (trainer.default_root_dir)", folder)


def local_path(path: str | os.PathLike) -> str | None:
    """The local path of ``path`` (a plain path or a ``file://`` URL), else None (a remote fsspec URL)."""
    text = os.fspath(path)
    if "://" not in text and "::" not in text:
        return text
    if text.startswith("file://"):
        return text[len("file://"):]
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose saves cannot be half-written (:func:`atomic_write`): ``torch.save``
    straight into a temporary file next to the destination (no in-memory copy of the whole checkpoint, no
    ``$TMPDIR``), ``fsync``, then a rename over the destination. A remote fsspec URL goes through Lightning's own
    save. Loading and removing are Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`. Please implement your custom `CheckpointIO`"
                " to define how you'd like to use `storage_options`.")
        local = local_path(path)
        if local is None:
            super().save_checkpoint(checkpoint, path)
            return
        atomic_write(local, lambda f: torch.save(checkpoint, f), size=storage_bytes(checkpoint))


def install_atomic_checkpoint_io(strategy: Any) -> bool:
    """Give ``strategy`` an :class:`AtomicCheckpointIO` where it has Lightning's default ``TorchCheckpointIO``
    (none configured yet, exactly that class, or inside a wrapper such as ``AsyncCheckpointIO``). A checkpoint IO
    plugin of the user's (any other class) is left alone. Returns whether it installed one."""
    io = framework.checkpoint_io_of(strategy)
    if io is None or type(io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
        return True
    if framework.is_wrapping_checkpoint_io(io):
        inner = io.checkpoint_io
        if inner is None:
            io.checkpoint_io = AtomicCheckpointIO()
            return True
        if type(inner) is TorchCheckpointIO:
            framework.set_wrapped_checkpoint_io(io, AtomicCheckpointIO())  # the setter only fills an empty slot
            return True
    return False


def saves_a_folder(strategy: Any) -> bool:
    """Whether ``strategy.save_checkpoint`` writes a folder (torch.distributed.checkpoint shards and ``meta.pt``,
    or DeepSpeed's files) rather than one file through its checkpoint IO."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return framework.saves_distributed_checkpoint(strategy)
    if isinstance(strategy, FSDPStrategy):
        return framework.fsdp_state_dict_type(strategy) == "sharded"
    return isinstance(strategy, DeepSpeedStrategy)
