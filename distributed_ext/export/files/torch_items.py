"""Where a ``torch.save`` item's tensor bytes lie in its file, without loading it: the item's
zip read by torch's own reader (``PyTorchFileReader``, over a window of the file), its
``data.pkl`` read as opcodes by :mod:`pickletools` (never run), and every field checked: one
storage, uncompressed, holding exactly the tensor's elements in row-major order."""

from __future__ import annotations

import io
import math
import os
import pickletools
from dataclasses import dataclass
from typing import Any

import torch

# The storage classes ``torch.save`` names in a pickle (``torch FloatStorage``), by dtype.
_DTYPE_OF_STORAGE = {name: dtype for dtype, name in
                     torch.storage._dtype_to_storage_type_map().items()}
_PICKLE_BYTES = 1 << 20  # a tensor's pickle is a few hundred bytes: more is not one


class ItemError(ValueError):
    """An item that is not one plain tensor saved by ``torch.save`` (the message says why)."""


class _Window(io.RawIOBase):
    """Bytes ``start .. start + length`` of an open file, as a seekable file of their own
    (what ``PyTorchFileReader`` reads an item's zip from)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class Located:
    """Where an item's tensor bytes lie: ``offset`` in the file, ``nbytes`` long."""

    offset: int
    nbytes: int


def locate_tensor(fd: int, start: int, length: int, dtype: torch.dtype,
                  shape: tuple[int, ...]) -> Located:
    """The file offset of the raw row-major bytes of the tensor ``torch.save`` wrote as the
    zip at ``start .. start + length`` of ``fd``; ItemError unless the item is one tensor of
    ``dtype`` and ``shape``, contiguous, at storage offset 0, in one storage that holds
    exactly its elements, stored uncompressed inside the item."""
    try:
        reader = torch._C.PyTorchFileReader(_Window(fd, start, length))
        pickled_size = reader.get_record_size("data.pkl")
        if pickled_size > _PICKLE_BYTES:
            raise ItemError(f"its data.pkl is {pickled_size} bytes, not one tensor's")
        call = _tensor_call(reader.get_record("data.pkl"))
    except ItemError:
        raise
    except Exception as exc:  # a zip torch cannot read: not an item of ours to locate
        raise ItemError(f"not a torch.save zip torch can read ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    storage, storage_offset, size, stride = call[:4]
    kind, storage_type, key, _location, numel = storage
    want_stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    saved_dtype = _DTYPE_OF_STORAGE.get(storage_type.split(" ")[-1])
    if kind != "storage" or saved_dtype is None:
        raise ItemError(f"its storage is {storage_type!r}, not one torch names")
    if saved_dtype != dtype or tuple(size) != tuple(shape):
        raise ItemError(f"it holds a {saved_dtype} tensor of shape {tuple(size)}, but the "
                        f"metadata says {dtype} {tuple(shape)}")
    if storage_offset != 0 or numel != math.prod(shape) or (
            math.prod(shape) > 1 and tuple(stride) != want_stride):
        raise ItemError(f"its tensor is a strided view (storage offset {storage_offset}, "
                        f"stride {tuple(stride)}, storage of {numel} elements), not the "
                        "contiguous tensor this reads without loading it")
    record = f"data/{key}"
    if not reader.has_record(record):
        raise ItemError(f"it has no record {record!r}")
    nbytes = reader.get_record_size(record)
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise ItemError(f"its record {record!r} is {nbytes} bytes, not the tensor's "
                        f"{math.prod(shape) * dtype.itemsize}")
    at = reader.get_record_offset(record)
    if not 0 <= at <= length - nbytes:
        raise ItemError(f"its record {record!r} lies at bytes {at}..{at + nbytes}, outside "
                        f"the item's {length}")
    return Located(start + at, nbytes)


# The opcodes a tensor's pickle uses; anything else is refused (it is not read as a pickle).
_PUSH_CONST = {"BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINUNICODE",
               "BINUNICODE8", "BINFLOAT"}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "EMPTY_TUPLE": 0}
_REBUILD = "torch._utils _rebuild_tensor_v2"


def _tensor_call(data: bytes) -> tuple:
    """The arguments of the one ``torch._utils._rebuild_tensor_v2`` call a tensor's pickle
    makes -- ``(storage, storage_offset, size, stride, ...)``, ``storage`` the persistent id
    tuple ``("storage", "torch FloatStorage", key, location, numel)`` -- read by walking the
    opcodes with a stack of plain values (tuples, ints, strings; a call is a marker tuple):
    no object is made, no name is imported. ItemError for anything else."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    result: Any = None
    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name == "PROTO" or name == "FRAME":
            continue
        if name in _PUSH_CONST:
            stack.append(arg)
        elif name == "GLOBAL":
            stack.append(("global", arg))
        elif name in ("NEWTRUE", "NEWFALSE", "NONE"):
            stack.append({"NEWTRUE": True, "NEWFALSE": False, "NONE": None}[name])
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "TUPLE":
            if not marks:
                raise ItemError("its data.pkl is malformed (TUPLE without MARK)")
            at = marks.pop()
            stack[at:] = [tuple(stack[at:])]
        elif name in _TUPLES:
            n = _TUPLES[name]
            if len(stack) < n:
                raise ItemError("its data.pkl is malformed (a tuple of missing values)")
            items = tuple(stack[len(stack) - n:]) if n else ()
            del stack[len(stack) - n:]
            stack.append(items)
        elif name in ("EMPTY_DICT", "EMPTY_LIST"):
            stack.append(("container",))
        elif name in ("BINPUT", "LONG_BINPUT"):
            if stack:
                memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            if stack:
                memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            if arg not in memo:
                raise ItemError("its data.pkl is malformed (a memo it never stored)")
            stack.append(memo[arg])
        elif name == "BINPERSID":
            if not stack or not isinstance(stack[-1], tuple) or len(stack[-1]) != 5:
                raise ItemError("its data.pkl names a storage that is not torch's")
            pid = stack.pop()
            kind, storage_type, key, location, numel = pid
            if not (isinstance(storage_type, tuple) and storage_type[:1] == ("global",)):
                raise ItemError("its data.pkl names a storage that is not torch's")
            stack.append((kind, storage_type[1], key, location, numel))
        elif name == "REDUCE":
            if len(stack) < 2 or not isinstance(stack[-1], tuple):
                raise ItemError("its data.pkl is malformed (a call without arguments)")
            args, func = stack.pop(), stack.pop()
            stack.append(("call", func, args))
        elif name in ("SETITEMS", "APPENDS"):
            if not marks:
                raise ItemError("its data.pkl is malformed")
            del stack[marks.pop():]
        elif name == "BUILD":
            if len(stack) < 2:
                raise ItemError("its data.pkl is malformed")
            stack.pop()
        elif name == "STOP":
            result = stack[-1] if stack else None
            break
        else:
            raise ItemError(f"its data.pkl uses the opcode {name}, which no tensor's pickle "
                            "needs")
    if not (isinstance(result, tuple) and len(result) == 3 and result[0] == "call"
            and result[1] == ("global", _REBUILD)):
        raise ItemError("its data.pkl is not one tensor (torch._utils._rebuild_tensor_v2)")
    args = result[2]
    if len(args) < 4 or not (isinstance(args[0], tuple) and len(args[0]) == 5
                             and isinstance(args[1], int) and isinstance(args[2], tuple)
                             and isinstance(args[3], tuple)):
        raise ItemError("its data.pkl's tensor has arguments torch does not write")
    if not all(isinstance(v, int) for v in (*args[2], *args[3], args[0][4])):
        raise ItemError("its data.pkl's tensor has a size or stride that is not integers")
    return args
