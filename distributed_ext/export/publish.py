"""Publishing a checkpoint whole: files written into a hidden stage next to the directory,
made durable, then swapped in at once (``renameat2(RENAME_EXCHANGE)``) or renamed in an order
that makes a partial state fail to load; and the commit round that agrees it was."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import uuid
from typing import Any

import torch.nn as nn

from distributed_ext import _agree, _native, _watch
from distributed_ext.export.safetensors import _SHARD_RE, INDEX_NAME, WEIGHTS_NAME

# Files an export publishes; whatever else a directory holds (a tokenizer, a README) is kept.
_CONFIG_NAMES = ("config.json", "generation_config.json")


_STAGE_TAG = ".dext-export-"


# Temporary files of versions that staged inside the directory (".model.safetensors.<hex>.tmp").
_LEGACY_TMP_RE = re.compile(r"^\.(model.*\.safetensors|model\.safetensors\.index\.json|config\.json"
                            r"|generation_config\.json)\.[0-9a-f]{32}\.tmp$")


def _config_texts(model: nn.Module | None) -> dict[str, str]:
    """``config.json``/``generation_config.json`` as ``save_pretrained`` writes them, computed
    before any byte moves (a config that does not serialize fails the preparing round)."""
    out = {}
    for name, attr in zip(_CONFIG_NAMES, ("config", "generation_config")):
        obj = getattr(model, attr, None) if model is not None else None
        if obj is not None and hasattr(obj, "to_json_string"):
            try:
                out[name] = obj.to_json_string(use_diff=True)
            except Exception as exc:
                raise ValueError(f"model.{attr} does not serialize to JSON ({type(exc).__name__}: "
                                 f"{exc}); make its attributes JSON-serializable (or delete the "
                                 "offending attribute) before exporting") from exc
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
    """Removes a file, link or directory tree; a missing one is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _link_tree(src: str, dst: str) -> None:
    """``src`` (a file, link or directory tree) at ``dst`` too: hard links, a copy where the
    filesystem refuses them."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.mkdir(dst)
        for name in os.listdir(src):
            _link_tree(os.path.join(src, name), os.path.join(dst, name))
    else:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


class Stage:
    """A hidden stage directory beside ``directory``, published whole (:meth:`publish`).

    The stage is a sibling of the directory (``.<name>.dext-export-<hex>``, so that it is on
    the same filesystem); whatever is written into it is made durable and published in one
    step: a new directory is renamed into place; an existing one is swapped with the stage by
    ``renameat2(RENAME_EXCHANGE)`` after the files of it that the checkpoint does not replace
    (a tokenizer, a README) are hard-linked into the stage. A crash at any instant therefore
    leaves the earlier checkpoint or the new one, never a mix. Where the swap is not available
    (not Linux, a filesystem without it, a directory that is a mount point or whose parent is
    not writable), the stage is made inside the directory and its files are renamed in an
    order that makes a partial state fail to load loudly: the index and a single-file
    checkpoint's weights removed first, the shards and configs renamed in, the entry point
    (the index, or the single file) last. Stages of earlier crashed exports of the same
    directory are removed when a new one starts: one export per directory at a time.
    """

    def __init__(self, directory: str) -> None:
        # Resolved: a directory reached through a symlink is published in place of its
        # target's contents, the link kept.
        self.directory = os.path.realpath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"directory={directory!r} exists and is not a directory; pass a "
                             "directory path (it is created if missing)")
        parent, base = os.path.split(self.directory.rstrip(os.sep) or os.sep)
        os.makedirs(parent, exist_ok=True)  # as save_pretrained, missing parents are made
        self._remove_stale(parent, base)
        token = uuid.uuid4().hex
        self.swap = os.path.isdir(parent) and os.access(parent, os.W_OK) and not (
            os.path.isdir(self.directory)
            and os.stat(self.directory).st_dev != os.stat(parent).st_dev)  # a mount point
        if self.swap:
            self.path = os.path.join(parent, f".{base}{_STAGE_TAG}{token}")
        else:
            os.makedirs(self.directory, exist_ok=True)
            self.path = os.path.join(self.directory, f"{_STAGE_TAG}{token}")
        os.mkdir(self.path)
        self.published = False
        self._texts: set[str] = set()

    def abort(self) -> None:
        """Removes the stage; the directory is as it was (unless already published)."""
        if not self.published:
            _remove(self.path)

    def publish(self, names: list[str], entry_point: str, texts: set[str]) -> None:
        """Makes the stage durable and publishes ``names`` (files in it, fsynced by the
        caller): the whole stage at once, else in the order of the class docstring.
        ``texts``: the config files this checkpoint writes (an earlier one is replaced)."""
        self._texts = texts
        _fsync_path(self.path, directory=True)
        if self.swap and self._publish_swap():
            return
        self._publish_in_place(names, entry_point)

    def _remove_stale(self, parent: str, base: str) -> None:
        """Removes what crashed exports of this directory left: stages, old temp files."""
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                if name.startswith(f".{base}{_STAGE_TAG}"):
                    _remove(os.path.join(parent, name))
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                if name.startswith(_STAGE_TAG) or _LEGACY_TMP_RE.match(name):
                    _remove(os.path.join(self.directory, name))

    def _replaced(self, name: str) -> bool:
        """Whether ``name`` in the directory belongs to the checkpoint this one replaces."""
        return bool(_SHARD_RE.match(name)) or name == INDEX_NAME or name in self._texts or \
            name.startswith(_STAGE_TAG) or bool(_LEGACY_TMP_RE.match(name))

    def _publish_swap(self) -> bool:
        """The stage becomes the directory in one step; False where it cannot be swapped."""
        parent = os.path.dirname(self.directory)
        if not os.path.lexists(self.directory):
            os.rename(self.path, self.directory)  # nothing was there: one atomic rename
            self.published = True
            _fsync_path(parent, directory=True)
            return True
        carried = []
        for name in os.listdir(self.directory):
            if not self._replaced(name):
                _link_tree(os.path.join(self.directory, name), os.path.join(self.path, name))
                carried.append(name)
        if not _native.exchange_paths(self.path, self.directory):
            for name in carried:
                _remove(os.path.join(self.path, name))
            return False
        # Published. The stage path now holds the earlier directory: anything written into
        # it since the links were made moves over, the rest (the earlier checkpoint) goes.
        # Best effort from here: a failure to tidy up is not a failed export.
        with contextlib.suppress(OSError):
            _fsync_path(parent, directory=True)
            for name in os.listdir(self.path):
                if not self._replaced(name) and not os.path.lexists(
                        os.path.join(self.directory, name)):
                    with contextlib.suppress(OSError):
                        os.rename(os.path.join(self.path, name),
                                  os.path.join(self.directory, name))
        _remove(self.path)
        self.published = True  # nothing of ours is left to abort
        return True

    def _publish_in_place(self, published: list[str], last: str) -> None:
        """Renames the stage's files into the directory, the entry point last (see the class
        docstring), then removes stale shards of the earlier checkpoint."""
        os.makedirs(self.directory, exist_ok=True)
        target = functools.partial(os.path.join, self.directory)
        # First what makes a partial state load: the index, a single-file checkpoint.
        for name in (INDEX_NAME, WEIGHTS_NAME):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target(name))
        for name in [n for n in published if n != last] + [last]:
            os.replace(os.path.join(self.path, name), target(name))
        _fsync_path(self.directory, directory=True)
        for name in os.listdir(self.directory):  # stale shards of an earlier checkpoint
            if _SHARD_RE.match(name) and name not in published:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target(name))
        self.published = True
        _remove(self.path)


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
