"""The one write-then-rename helper: a file appears whole under its name, or not at all."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], durable: bool = False) -> Iterator[BinaryIO]:
    """A new file, written in the block, that replaces ``path`` whole when the block ends.

    The bytes go to a hidden sibling with a name no other writer shares (threads, processes,
    containers sharing a pid), renamed over ``path`` at the end, so a reader sees the old
    file or the new one, never a part. Any exception in the block (Ctrl-C included) removes
    the sibling and leaves ``path`` as it was. ``durable``: fsync the bytes before the rename.
    """
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
