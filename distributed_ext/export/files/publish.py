"""Publishing a checkpoint: files written into a hidden stage inside the directory, made
durable, then renamed in an order that makes a partial state fail to load (never a mix that
loads), the user's directory and everything in it that is not the checkpoint's untouched;
the directory argument's checks; and the commit round that agrees it was published."""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import functools
import os
import re
import socket
import stat
import uuid
from typing import Any

import torch
import torch.nn as nn

from distributed_ext import _agree, _watch
from distributed_ext.export.plan.quantized import Quantized, config_text
from distributed_ext.export.plan.safetensors import _SHARD_RE, INDEX_NAME, WEIGHTS_NAME

# Files an export publishes; whatever else a directory holds (a tokenizer, a README) is kept.
_CONFIG_NAMES = ("config.json", "generation_config.json")


_STAGE_TAG = ".dext-export-"


# Temporary files of versions that staged inside the directory (".model.safetensors.<hex>.tmp").
_LEGACY_TMP_RE = re.compile(r"^\.(model.*\.safetensors|model\.safetensors\.index\.json|config\.json"
                            r"|generation_config\.json)\.[0-9a-f]{32}\.tmp$")


def _config_texts(model: nn.Module | None, quantized: Quantized | None = None) -> dict[str, str]:
    """``config.json``/``generation_config.json`` as ``save_pretrained`` writes them (with
    its ``dtype`` -- the model's -- and ``architectures`` -- its class, ``FSDP`` prefix
    removed -- set on a copy: the model's own config is left as it was), computed before any
    byte moves (a config that does not serialize fails the preparing round). For a
    ModelOpt-quantized model, as ModelOpt's export writes them: ``hf_quant_config.json`` and
    ``config.json`` with its ``quantization_config`` (:func:`plan.quantized.config_text`)."""
    out = {}
    for name, attr in zip(_CONFIG_NAMES, ("config", "generation_config")):
        obj = getattr(model, attr, None) if model is not None else None
        if obj is not None and hasattr(obj, "to_json_string"):
            if attr == "config":
                obj = copy.copy(obj)
                dtype = getattr(model, "dtype", None)
                if isinstance(dtype, torch.dtype):
                    obj.dtype = str(dtype).removeprefix("torch.")
                obj.architectures = [type(model).__name__.removeprefix("FSDP")]
            try:
                out[name] = obj.to_json_string(use_diff=True)
            except Exception as exc:
                raise ValueError(f"model.{attr} does not serialize to JSON ({type(exc).__name__}: "
                                 f"{exc}); make its attributes JSON-serializable (or delete the "
                                 "offending attribute) before exporting") from exc
    if quantized is not None and model is not None and "config.json" in out:
        out["config.json"] = config_text(out["config.json"], model, quantized)
        out.update(quantized.files)
    return out


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: str) -> None:
    """Removes a file, link or directory tree of ours (a stage); a missing one is fine. Never
    descends into another filesystem: a mount found inside is left where it is (and with
    it the directories above it, which are then not empty)."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    _remove_tree(path, top.st_dev)


def _remove_tree(path: str, device: int) -> None:
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    if entry.stat(follow_symlinks=False).st_dev == device:
                        _remove_tree(entry.path, device)
                else:
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.rmdir(path)  # fails, leaving it, where a mount is inside


def check_directory(directory: str, what: str, on_dst: bool) -> None:
    """Refuses a ``directory`` no checkpoint can be published into, naming the argument:
    on every rank the empty string (it names no directory: ``save_pretrained("")`` refuses
    too); on dst (``on_dst``) a path that is or crosses a symlink loop, a dangling link, a
    file, or a place where a directory cannot be made or written. Run in the metadata round,
    so that nothing moves for an export that cannot be published; leaves nothing behind."""
    if directory == "":
        raise ValueError(f"{what}: directory='' names no directory; pass a path ('.' for the "
                         "current directory, or a new directory such as 'out/')")
    if "\0" in directory:
        raise ValueError(f"{what}: directory={directory!r} holds a NUL byte; pass a path "
                         "without one")
    if not on_dst:
        return
    # The nearest existing directory on the way to it, and the first component to make.
    probe, missing = os.path.abspath(directory), None
    while True:
        try:
            st = os.stat(probe)
            break
        except FileNotFoundError:
            if os.path.lexists(probe):
                raise ValueError(f"{what}: directory={directory!r}: {probe!r} is a symbolic "
                                 "link to a missing path; remove the link or point it at a "
                                 "directory") from None
            probe, missing = os.path.dirname(probe), probe
        except OSError as exc:
            why = ("is or crosses a symbolic link loop" if exc.errno == errno.ELOOP else
                   "crosses a file that is not a directory" if exc.errno == errno.ENOTDIR
                   else f"cannot be looked up ({exc.strerror})")
            raise ValueError(f"{what}: directory={directory!r} {why}; pass a path to a "
                             "directory (it is created if missing)") from None
    if not stat.S_ISDIR(st.st_mode):
        where = "exists and is not a directory" if missing is None else \
            f"lies under {probe!r}, which is not a directory"
        raise ValueError(f"{what}: directory={directory!r} {where}; pass a directory path "
                         "(it is created if missing)")
    # Whether a directory can be made there: the one to create, or a stage inside it.
    trial = missing or os.path.join(probe, f"{_STAGE_TAG}check-{uuid.uuid4().hex}")
    try:
        os.mkdir(trial)
    except FileExistsError:
        # Made meanwhile (another rank that takes itself for dst, or another export, checking
        # the same path): a directory can be made there, and this check must not remove it.
        return
    except OSError as exc:
        raise ValueError(f"{what}: directory={directory!r} cannot be written here "
                         f"({exc.strerror} making {trial!r}); pass a directory you can "
                         "write") from None
    with contextlib.suppress(OSError):
        os.rmdir(trial)


def _refuse_non_files(directory: str, names: tuple[str, ...]) -> None:
    """ValueError naming the first of ``names`` in ``directory`` that exists and is neither a
    file nor a link: publishing would move it aside and remove it with the stage (a
    directory the user named ``model.safetensors`` or ``config.json``, with what it holds).
    ``save_pretrained`` fails on such an entry too."""
    for name in dict.fromkeys(names):
        try:
            mode = os.lstat(os.path.join(directory, name)).st_mode
        except FileNotFoundError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ValueError(
                f"export_hf_checkpoint: directory={directory!r} holds {name!r}, which is {kind}; "
                "the checkpoint writes a file of that name there. Move or rename it, or export "
                "into another directory (nothing was written)")


class ExportLock:
    """The lock of one live export of a directory: ``flock`` on ``.dext-export.lock`` in it,
    which the kernel releases when its holder dies (a crash, SIGKILL), so that a crashed
    export's stage is found unlocked and removed by the next export, and a live one's never.
    A second export of the directory while one is live is refused at once (ValueError naming
    the directory and the holder's pid and host). The file is removed by its holder on
    release (after checking, as every taker does, that the locked file is still the one the
    name points at). Where the filesystem refuses locks (ENOLCK, EOPNOTSUPP), :attr:`held`
    is False: no lock, and so no stage but this export's own is ever removed there."""

    NAME = ".dext-export.lock"

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, self.NAME)
        self.fd: int | None = None
        self.held = False
        for _attempt in range(16):  # (each retry: a holder removed the file under us)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise ValueError(
                    f"export_hf_checkpoint: another export into directory={directory!r} is live "
                    f"({holder}); wait for it to finish, or export into another directory "
                    "(nothing was written)") from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    return  # no locks on this filesystem: held stays False
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd, self.held = fd, True
                note = f"pid {os.getpid()} on host {socket.gethostname()}".encode()
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, note, 0)
                return
            os.close(fd)  # locked a file its holder had just removed: take the new one
        raise ValueError(f"export_hf_checkpoint: directory={directory!r}: its export lock "
                         f"{self.path!r} kept changing under this export; another process "
                         "is churning it -- export into another directory")

    @classmethod
    def remove_if_free(cls, directory: str) -> None:
        """Removes the lock file a dead export left in ``directory`` (a writer's cleanup after
        dst died): taken first, so that a live export's is never removed (best effort)."""
        if not os.path.lexists(os.path.join(directory, cls.NAME)):
            return  # (none left: never make one)
        with contextlib.suppress(OSError, ValueError):
            cls(directory).release()

    def release(self) -> None:
        """Removes the lock file (while still holding it) and releases it; idempotent."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)  # (releases the flock)
        self.fd, self.held = None, False


def _read_holder(fd: int) -> str:
    """The holder's note in a lock file (its pid and host), or a placeholder."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "its holder's pid is not written yet"


class Stage:
    """A hidden stage directory inside ``directory``, published into it (:meth:`publish`).

    The user's directory itself is never replaced, re-created or re-permissioned, and
    nothing in it but the checkpoint's own files is touched: its shards, index,
    ``config.json``/``generation_config.json`` (those this export writes) and stale shards of
    an earlier checkpoint (as ``save_pretrained`` removes them); a tokenizer, a README, a log
    being written into a subdirectory, a filesystem mounted inside are left as they are. The
    stage (``.dext-export-<hex>``, inside the directory, so on its filesystem whatever the
    parent is, and 45 bytes whatever the directory's name) takes the new files; publishing
    first moves the earlier checkpoint's entry points aside into the stage (index, then
    single-file weights), then the files it replaces by name, then renames the new files in,
    its entry point (the index, or the single file) last, then removes stale shards. So a
    crash at any instant leaves the earlier checkpoint (before the first move), the new one
    (once its entry point is in), or between the two a directory with no entry point, which
    every loader refuses ("no model.safetensors or index"): never a mix that loads. The
    earlier files then wait in the stage's ``.earlier`` folder until the next export of the
    directory removes what crashed ones left. A failure that is not a crash (an I/O error,
    Ctrl-C) puts the earlier files back before raising: the directory is as it was. One
    export of a directory is live at a time (:class:`ExportLock`, held from the stage's
    making to its publishing or removal): a stage is removed as a crashed export's only
    while its export holds no lock, so two exports never remove each other's.
    """

    def __init__(self, directory: str, names: tuple[str, ...] = ()) -> None:
        """Takes the directory's export lock (:class:`ExportLock`: another live export of it
        is refused), refuses an entry of ``names`` (the files this export publishes) or of
        the entry points it moves aside that is not a file (a user's directory named
        ``model.safetensors``), then removes what crashed exports left and makes the stage."""
        self.directory = directory
        # The directories this export makes (the deepest last): removed again if it fails.
        self._made: list[str] = []
        probe = os.path.abspath(directory)
        while not os.path.lexists(probe):
            self._made.insert(0, probe)
            probe = os.path.dirname(probe)
        self._lock: ExportLock | None = None
        try:
            os.makedirs(directory, exist_ok=True)  # as save_pretrained, parents are made
            self._lock = ExportLock(directory)
            _refuse_non_files(directory, (INDEX_NAME, WEIGHTS_NAME, *names))
            if self._lock.held:  # (else live exports cannot be told from crashed ones)
                self._remove_stale()
            self.path = os.path.join(directory, f"{_STAGE_TAG}{uuid.uuid4().hex}")
            os.mkdir(self.path)
        except OSError as exc:
            self._release()
            raise ValueError(f"export_hf_checkpoint: directory={directory!r} cannot take a checkpoint "
                             f"({exc.strerror}); pass a directory you can write") from exc
        except BaseException:
            self._release()
            raise
        self.published = False

    def _release(self) -> None:
        """The lock released (after the stage is gone or published), the directories this
        export made removed where empty."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._unmake()

    def abort(self) -> None:
        """Removes the stage; the directory is as it was (unless already published): one
        this export made is removed again (if nothing else was put there meanwhile)."""
        if not self.published:
            _remove(self.path)
            self._release()

    def _unmake(self) -> None:
        """Removes the directories this export made, deepest first (each only if empty)."""
        for made in reversed(self._made):
            with contextlib.suppress(OSError):
                os.rmdir(made)

    def publish(self, names: list[str], entry_point: str) -> None:
        """Publishes ``names`` (files in the stage, fsynced by the caller; the config files
        this checkpoint writes among them, replacing earlier ones) into the directory in the
        order of the class docstring."""
        _fsync_path(self.path, directory=True)
        target = functools.partial(os.path.join, self.directory)
        earlier = os.path.join(self.path, ".earlier")
        os.mkdir(earlier)
        # The earlier checkpoint's files this one replaces by name, its entry points first.
        aside = [n for n in (INDEX_NAME, WEIGHTS_NAME) if os.path.lexists(target(n))]
        aside += [n for n in names if n not in aside and os.path.lexists(target(n))]
        moved: list[str] = []
        placed: list[str] = []
        try:
            for name in aside:
                os.rename(target(name), os.path.join(earlier, name))
                moved.append(name)
            for name in [n for n in names if n != entry_point] + [entry_point]:
                os.rename(os.path.join(self.path, name), target(name))
                placed.append(name)
            _fsync_path(self.directory, directory=True)
        except BaseException as exc:
            self._put_back(moved, placed, earlier, exc)
            raise
        self.published = True
        # Published. Best effort from here: a failure to tidy up is not a failed export.
        try:
            for name in os.listdir(self.directory):  # stale shards of an earlier checkpoint
                if _SHARD_RE.match(name) and name not in names:
                    with contextlib.suppress(OSError):
                        if not stat.S_ISDIR(os.lstat(target(name)).st_mode):  # (never a user's
                            os.unlink(target(name))                         # directory)
            _remove(self.path)
            with contextlib.suppress(OSError):
                _fsync_path(self.directory, directory=True)
        finally:
            self._release()

    def _put_back(self, moved: list[str], placed: list[str], earlier: str,
                  cause: BaseException) -> None:
        """Undoes a failed publish: the new files back into the stage, the earlier ones
        back in place, entry points last. A failure here is added to ``cause``'s notes."""
        try:
            for name in reversed(placed):
                os.rename(os.path.join(self.directory, name), os.path.join(self.path, name))
            for name in reversed(moved):
                os.rename(os.path.join(earlier, name), os.path.join(self.directory, name))
        except OSError as exc:
            cause.add_note(f"(and putting the earlier checkpoint back failed: {exc}; its "
                           f"files are in {earlier!r})")

    def _remove_stale(self) -> None:
        """Removes what crashed exports of this directory left: stages inside it, old temp
        files, and the sibling stages of versions that staged beside it (never through a
        mount)."""
        parent, base = os.path.split(os.path.abspath(self.directory).rstrip(os.sep) or os.sep)
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                if name.startswith(f".{base}{_STAGE_TAG}"):
                    _remove(os.path.join(parent, name))
        for name in os.listdir(self.directory):
            if name.startswith(_STAGE_TAG) or _LEGACY_TMP_RE.match(name):
                _remove(os.path.join(self.directory, name))


def _commit_round(sink: Any, ctx: _agree.GroupContext,
                  deferred: _watch.DeferredInterrupts, what: str) -> None:
    """dst publishes the checkpoint; every rank then learns whether it did (a failed commit
    -- a config that does not serialize, an fsync or rename error, Ctrl-C -- raises on every
    rank, naming dst's error; the directory then holds the earlier checkpoint). An agreed
    round (:func:`_agree.agree`) whose step on dst is the commit."""
    committed = False

    def step() -> None:
        nonlocal committed
        try:
            if sink is not None:
                interrupted = deferred.take()
                if interrupted is not None:
                    raise interrupted  # before anything is published: nothing changes
                sink.commit()
                committed = True
            # A Ctrl-C during the commit (or, on a sender, while it waited for it): carried
            # in this round like any failure, so that every rank raises alike.
            late = deferred.take()
            if late is not None:
                raise late
        except BaseException:
            if sink is not None and not committed:
                sink.abort()
            raise

    try:
        _agree.agree(what, ctx, step, stage="commit")
    except RuntimeError as exc:
        if committed:
            # A peer failed or died after the data had all arrived: the checkpoint is
            # complete and in place (the group may be unusable).
            raise RuntimeError(f"{exc} (the checkpoint itself is complete: it was published "
                               "before the failure)") from exc
        raise
