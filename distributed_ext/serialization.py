"""The pickle-free state format: encode a state to segments, decode a buffer to views.

A state is a tree of plain values (dict with str/int keys, OrderedDict, list, tuple, str, int,
float, bool, None, bytes, torch.dtype, torch.Size, torch.device) and dense tensors. Encoding
copies no tensor bytes: it returns a header and a list of *segments*, flat uint8 views of the
tensors' own memory, which the transport (or :func:`write_state`) copies straight to their
destination with the compiled core. Decoding copies no tensor bytes either: the tensors of a
decoded state are views of the buffer, which stays alive as long as any of them does.

The byte layout is specified in ``docs/format.md``. Decoding never runs pickle and checks every
length, offset, dtype, shape, stride and nesting depth against the buffer before use;
malformed input raises ValueError.

Tensors sharing a storage (tied weights, views of one buffer) travel once, as the byte span of
the storage they cover, and arrive sharing one storage with their strides, as ``torch.save``
keeps them. A tensor alone on its storage travels as its own bytes, contiguous. Parameters
arrive as plain tensors and CUDA tensors as CPU tensors (``requires_grad`` is not kept).
"""

from __future__ import annotations

import array
import collections
import io
import os
import stat
import struct
import warnings
import weakref
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from distributed_ext import _native
from distributed_ext._atomic import replacing
from distributed_ext._device_spans import spans_to_host
from distributed_ext._dtensor import is_dtensor
from distributed_ext._source import ByteSource

__all__ = [
    "ALIGNMENT",
    "EncodedState",
    "decode_state",
    "encode_state",
    "read_state",
    "write_state",
    "write_state_into",
]

MAGIC = b"DXST"
VERSION = 1
ALIGNMENT = 64
MAX_DEPTH = 100
MAX_NDIM = 64
_NO_STORAGE = 0xFFFFFFFF
_MAX_DEVICE_INDEX = 127  # torch.device's index is an int8; a wider one would wrap

# Fixed codes: the wire must mean the same thing in every version. Codes of dtypes a torch
# build lacks are simply never produced (and rejected when read).
_DTYPE_NAMES = [
    "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128",
    "uint8", "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]  # fmt: skip
DTYPE_CODES: dict[torch.dtype, int] = {}
CODE_DTYPES: dict[int, torch.dtype] = {}
for _code, _name in enumerate(_DTYPE_NAMES, start=1):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_CODES[_dt] = _code
        CODE_DTYPES[_code] = _dt

# Value tags.
T_NONE, T_FALSE, T_TRUE, T_INT, T_BIGINT, T_FLOAT, T_STR, T_BYTES = range(8)
T_LIST, T_TUPLE, T_DICT, T_ODICT, T_DTYPE, T_SIZE, T_DEVICE, T_TENSOR = range(8, 16)

_PREAMBLE = struct.Struct("<4sHHQQQ")  # magic, version, flags, header_len, data_off, data_len
_STORAGE = struct.Struct("<QQ")  # offset in data region, nbytes
_TENSOR = struct.Struct("<BBIQ")  # dtype code, ndim, storage index, byte offset in storage
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _path(path: str) -> str:
    return path or "state"


def _key_path(path: str, key: object) -> str:
    return f"{_path(path)}[{key!r}]"


@dataclass
class EncodedState:
    """A state encoded without copying tensor bytes.

    Attributes:
        segments: flat uint8 CPU tensors whose concatenation is the encoded bytes (the header
            first, then each storage span, with zero padding between). Tensor segments view
            the state's own tensors: keep the state unmodified while the segments are in use.
        nbytes: the total encoded size (the sum of the segments' sizes).
        tensor_bytes: how many of those bytes are tensor data.
    """

    segments: list[torch.Tensor]
    nbytes: int
    tensor_bytes: int
    _keepalive: list[Any] = field(default_factory=list, repr=False)

    def source(self) -> ByteSource:
        """The segments as one byte stream for the transport (views; nothing copied)."""
        return ByteSource(self.segments)


class _Encoder:
    def __init__(self) -> None:
        self.out = bytearray()
        self.tensor_index: dict[int, int] = {}  # id(tensor) -> index
        self.tensors: list[torch.Tensor] = []  # as given (kept alive for id() stability)

    # -- values --------------------------------------------------------------------------
    def value(self, obj: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise TypeError(f"encode_state: {_path(path)} nests deeper than {MAX_DEPTH} levels "
                            "(a container that contains itself?); flatten the state")
        out = self.out
        if obj is None:
            out.append(T_NONE)
        elif obj is True or obj is False:
            out.append(T_TRUE if obj else T_FALSE)
        elif isinstance(obj, int) and not isinstance(obj, bool):
            value = int(obj)
            if -(2**63) <= value < 2**63:
                out.append(T_INT)
                out += _I64.pack(value)
            else:
                raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
                out.append(T_BIGINT)
                out += _U32.pack(len(raw)) + raw
        elif isinstance(obj, float):
            out.append(T_FLOAT)
            out += _F64.pack(float(obj))
        elif isinstance(obj, str):
            try:
                raw = str(obj).encode("utf-8")
            except UnicodeEncodeError as exc:
                raise TypeError(
                    f"encode_state: {_path(path)} is a str that is not valid Unicode text "
                    f"({exc.reason} at index {exc.start}); the format carries UTF-8 only -- "
                    "remove the lone surrogate or store the raw bytes instead"
                ) from None
            out.append(T_STR)
            out += _U32.pack(len(raw)) + raw
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            raw = bytes(obj)
            out.append(T_BYTES)
            out += _U64.pack(len(raw)) + raw
        elif isinstance(obj, torch.Tensor):
            out.append(T_TENSOR)
            out += _U32.pack(self.tensor(obj, path))
        elif isinstance(obj, torch.dtype):
            if obj not in DTYPE_CODES:
                raise TypeError(f"encode_state: {_path(path)} is the dtype {obj}, which the "
                                "format does not carry; store its name as a str instead")
            out.append(T_DTYPE)
            out.append(DTYPE_CODES[obj])
        elif isinstance(obj, torch.Size):
            out.append(T_SIZE)
            out += _U32.pack(len(obj))
            for d in obj:
                out += _I64.pack(int(d))
        elif isinstance(obj, torch.device):
            raw = obj.type.encode("ascii")  # torch's device type names are ASCII
            out.append(T_DEVICE)
            out += _U32.pack(len(raw)) + raw + _I64.pack(-1 if obj.index is None else obj.index)
        elif isinstance(obj, dict):
            out.append(T_ODICT if isinstance(obj, collections.OrderedDict) else T_DICT)
            out += _U32.pack(len(obj))
            for key, item in obj.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise TypeError(
                        f"encode_state: {_path(path)} has a key {key!r} of type "
                        f"{type(key).__name__}; keys must be str or int -- convert it, e.g. "
                        "str(key)"
                    )
                self.value(key, path, depth + 1)
                self.value(item, _key_path(path, key), depth + 1)
        elif isinstance(obj, (list, tuple)):
            out.append(T_TUPLE if isinstance(obj, tuple) else T_LIST)
            out += _U32.pack(len(obj))
            for i, item in enumerate(obj):
                self.value(item, f"{_path(path)}[{i}]", depth + 1)
        else:
            raise TypeError(
                f"encode_state: {_path(path)} is a {type(obj).__module__}."
                f"{type(obj).__qualname__}, which the format does not carry (it holds only "
                "dicts, lists, tuples, str, int, float, bool, None, bytes, dtypes, sizes, "
                "devices and dense tensors); convert it to one of those, e.g. a dict of its "
                "fields"
            )

    # -- tensors -------------------------------------------------------------------------
    def tensor(self, t: torch.Tensor, path: str) -> int:
        key = id(t)
        if key in self.tensor_index:
            return self.tensor_index[key]
        where = _path(path)
        if is_dtensor(t):
            raise TypeError(f"encode_state: {where} is a DTensor; to assemble a sharded model "
                            "on one rank use distributed_ext.gather_full_state (or "
                            "export_hf_checkpoint to write it), or pass .to_local() for this "
                            "rank's shard")
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(
            t, torch.nn.Parameter
        ):
            raise TypeError(f"encode_state: {where} is a tensor subclass "
                            f"{type(t).__qualname__}; pass a plain tensor (e.g. t.detach() or "
                            "torch.Tensor(t))")
        if t.is_nested:
            raise TypeError(f"encode_state: {where} is a nested tensor; unbind it into a list "
                            "of tensors first")
        if t.layout != torch.strided:
            raise TypeError(f"encode_state: {where} is a {t.layout} (sparse) tensor; call "
                            ".to_dense() first")
        if t.is_quantized:
            raise TypeError(f"encode_state: {where} is a quantized tensor; call "
                            ".dequantize() first")
        if t.device.type == "meta":
            raise TypeError(f"encode_state: {where} is a meta tensor and has no data; "
                            "materialize it (e.g. module.to_empty(device=...) and load) first")
        if t.dtype not in DTYPE_CODES:
            raise TypeError(f"encode_state: {where} has dtype {t.dtype}, which the format "
                            "does not carry; convert it with .to(...) first")
        index = len(self.tensors)
        self.tensor_index[key] = index
        self.tensors.append(t)
        return index


def _resolve_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with lazy conjugate/negative bits applied (a copy only then)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _reach(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element ``t`` can address."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _byte_view(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of ``storage[start : start + nbytes]`` on the storage's device."""
    base = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return base.set_(storage, start, (nbytes,))


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The absolute address range ``[lo, hi)`` of the bytes ``t`` can address."""
    lo = t.data_ptr()
    return lo, lo + _reach(t) * t.element_size()


def _lay_out_storages(
    plain: list[torch.Tensor],
) -> tuple[list[tuple[torch.Tensor, int]], dict[int, tuple[int, int, tuple[int, ...]]]]:
    """Which tensors travel in which storage span, and where.

    Tensors whose bytes overlap in memory -- tied weights, views of one buffer, and also two
    tensors over the same memory through different storage objects (``torch.from_numpy`` of
    a slice and of the whole array) -- travel in one span and arrive sharing one storage, in
    any order of the state. Tensors of one storage object travel together even when their
    bytes do not overlap (as ``torch.save`` keeps them). A tensor alone travels as its own
    bytes, contiguous. The span of a group is assembled from the members' storages piece by
    piece, so no single storage has to cover it all.

    Returns:
        ``storages``: ``(flat uint8 segment, nbytes)`` per span (a CUDA span comes back on
        its device); ``placement``: tensor index -> (span index, byte offset, strides).
    """
    # Union-find over tensors: same storage object, or overlapping byte ranges (per device).
    parent = list(range(len(plain)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    by_storage: dict[tuple[str, int], int] = {}
    ranges: list[tuple[str, int, int, int]] = []
    for i, t in enumerate(plain):
        if t.numel() == 0:
            continue
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key in by_storage:
            parent[find(i)] = find(by_storage[key])
        else:
            by_storage[key] = i
        lo, hi = _byte_range(t)
        ranges.append((str(t.device), lo, hi, i))
    ranges.sort()
    reach_end, reach_owner, reach_device = -1, -1, ""
    for device, lo, hi, i in ranges:
        if device == reach_device and lo < reach_end:
            parent[find(i)] = find(reach_owner)
        if device != reach_device or hi > reach_end:
            reach_end, reach_owner, reach_device = hi, i, device
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(plain):
        if t.numel():
            groups.setdefault(find(i), []).append(i)

    storages: list[tuple[torch.Tensor, int]] = []
    placement: dict[int, tuple[int, int, tuple[int, ...]]] = {}
    for members in sorted(groups.values()):
        span = _group_span(plain, members) if len(members) > 1 else None
        if span is None:  # alone, or sharing at a misaligned offset: each member on its own
            for i in members:
                t = plain[i].contiguous()
                seg = _byte_view(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                 t.numel() * t.element_size())
                placement[i] = (len(storages), 0, _contiguous_strides(t.shape))
                storages.append((seg, seg.numel()))
            continue
        seg, lo = span
        for i in members:
            placement[i] = (len(storages), plain[i].data_ptr() - lo, tuple(plain[i].stride()))
        storages.append((seg, seg.numel()))
    return storages, placement


def _group_span(plain: list[torch.Tensor], members: list[int]
                ) -> tuple[torch.Tensor, int] | None:
    """The bytes covering every member, as one segment, and the address it starts at.

    The start is aligned down to 64 bytes where a member's storage covers that far, so that
    every member's offset stays a multiple of its itemsize. Pieces come from the members'
    storages, each as long as one storage covers; pieces from several storages are joined
    (one copy, only for a span no single storage covers). None if some member's offset would
    be misaligned (the caller then sends each member on its own).
    """
    owners = {}
    for i in members:
        st = plain[i].untyped_storage()
        owners[(st.data_ptr(), st.nbytes())] = (st.data_ptr(), st.nbytes(), st)
    covers = sorted(owners.values(), key=lambda o: o[0])
    lo_abs = min(_byte_range(plain[i])[0] for i in members)
    hi = max(_byte_range(plain[i])[1] for i in members)
    aligned = lo_abs // ALIGNMENT * ALIGNMENT
    lo = aligned if any(b <= aligned < b + n for b, n, _s in covers) else lo_abs
    if any((plain[i].data_ptr() - lo) % plain[i].element_size() for i in members):
        return None
    pieces: list[torch.Tensor] = []
    cursor = lo
    while cursor < hi:
        best = max(((min(b + n, hi), b, st) for b, n, st in covers if b <= cursor < b + n),
                   default=None, key=lambda c: c[0])
        if best is None:  # cannot happen: members' bytes lie in their storages
            return None
        end, base, st = best
        pieces.append(_byte_view(st, cursor - base, end - cursor))
        cursor = end
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)), lo


def encode_state(state: Any) -> EncodedState:
    """Encodes ``state`` into segments without copying tensor bytes.

    Peak memory: the header (small: values and tensor metadata) plus, for CUDA, conjugate or
    negative-bit tensors only, a CPU copy of those tensors. CPU tensors are viewed, not copied.

    Args:
        state: A tree of supported values and tensors (see the module docstring).

    Returns:
        The EncodedState; its segments view the state's tensors, so keep the state alive and
        unmodified until the segments have been copied.

    Raises:
        TypeError: a value or tensor the format does not carry, naming its key path and the fix.
    """
    enc = _Encoder()
    enc.value(state, "", 0)
    tree = bytes(enc.out)

    plain = [_resolve_bits(t) for t in enc.tensors]
    storages, placement = _lay_out_storages(plain)

    # Device-resident spans cross to the host together (packed on the device, few copies),
    # into pinned staging leased until this EncodedState is dropped.
    on_device = [k for k, (seg, _n) in enumerate(storages) if seg.device.type != "cpu"]
    leases: list[Any] = []
    if on_device:
        hosted, leases = spans_to_host([storages[k][0] for k in on_device])
        for k, seg in zip(on_device, hosted):
            storages[k] = (seg, storages[k][1])

    records: list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = []
    for i, t in enumerate(plain):
        if i in placement:
            storage, offset, strides = placement[i]
        else:
            storage, offset, strides = _NO_STORAGE, 0, tuple(t.stride())
        records.append((DTYPE_CODES[t.dtype], storage, offset, tuple(t.shape), strides))

    # Lay the data region out: every storage span 64-byte aligned.
    storage_table = bytearray(_U32.pack(len(storages)))
    data_offsets, pos = [], 0
    for _seg, nbytes in storages:
        data_offsets.append(pos)
        storage_table += _STORAGE.pack(pos, nbytes)
        pos = _align(pos + nbytes)
    data_len = data_offsets[-1] + storages[-1][1] if storages else 0

    tensor_table = bytearray(_U32.pack(len(records)))
    for code, storage, offset, shape, strides in records:
        tensor_table += _TENSOR.pack(code, len(shape), storage, offset)
        for d in shape:
            tensor_table += _I64.pack(d)
        for s in strides:
            tensor_table += _I64.pack(s)

    blob = bytes(storage_table) + bytes(tensor_table) + tree
    data_off = _align(_PREAMBLE.size + len(blob))
    preamble = _PREAMBLE.pack(MAGIC, VERSION, 0, len(blob), data_off, data_len)
    head = bytearray(data_off)
    head[: _PREAMBLE.size + len(blob)] = preamble + blob

    zeros = torch.zeros(ALIGNMENT, dtype=torch.uint8)
    segments = [torch.frombuffer(head, dtype=torch.uint8)]
    cursor = 0
    for (seg, nbytes), off in zip(storages, data_offsets):
        if off > cursor:
            segments.append(zeros[: off - cursor])
        segments.append(seg)
        cursor = off + nbytes
    total = data_off + data_len
    tensor_bytes = sum(n for _s, n in storages)
    encoded = EncodedState(segments, total, tensor_bytes, [head, zeros, plain, enc.tensors, storages])
    for lease in leases:  # the pinned segments live exactly as long as the EncodedState
        weakref.finalize(encoded, lease.release)
    return encoded


def pack_encoded(encoded: EncodedState, dst: torch.Tensor, start: int = 0) -> None:
    """Copies encoded bytes ``[start, start + dst.numel())`` into ``dst`` (native, GIL released)."""
    encoded.source().pack(start, dst)


def write_state(state: Any, file: str | os.PathLike[str] | IO[bytes] | None = None,
                chunk_bytes: int = 64 * 2**20) -> bytearray | None:
    """Writes ``state`` encoded, into one new bytearray (``file`` None) or to a file.

    Peak memory: the returned buffer (exactly the encoded size) when writing to memory; a
    ``chunk_bytes`` staging buffer when writing to a file. A file given by path is written to
    a temporary file of its own in the same directory (a unique name, created exclusively) and
    renamed into place, so a failure never leaves a half-written file behind, and of two
    writers of one path the last rename wins whole. A stream is written in full: a raw stream
    that takes part of a write is called again for the rest, and one that takes nothing
    raises OSError.

    Returns:
        The bytearray when ``file`` is None, else None.
    """
    encoded = encode_state(state)
    if file is None:
        return encoded.source().to_bytearray()
    if isinstance(file, (str, os.PathLike)):
        with replacing(file) as f:
            _write_chunks(encoded, f, chunk_bytes)
        return None
    _write_chunks(encoded, file, chunk_bytes)
    return None


def write_state_into(state: Any, buffer: bytearray | memoryview) -> int:
    """Writes ``state`` encoded into the start of an existing writable ``buffer``.

    For writing many states through one buffer (a checkpoint loop): a reused buffer skips the
    page faults a fresh allocation pays (about 0.2 s per GiB on a small VM). Decode the result
    with ``decode_state(memoryview(buffer)[:n])``; its tensors then view ``buffer``, so do not
    overwrite it while they are in use. Peak memory: nothing beyond ``buffer``.

    Returns:
        ``n``, the number of bytes written.

    Raises:
        ValueError: ``buffer`` is smaller than the encoded state (the message gives both sizes).
        TypeError: ``buffer`` is not a writable contiguous byte buffer.
    """
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        raise TypeError("write_state_into: buffer must be a writable, contiguous byte buffer "
                        "(e.g. a bytearray)")
    view = view.cast("B") if (view.format != "B" or view.ndim != 1) else view
    encoded = encode_state(state)
    if encoded.nbytes > len(view):
        raise ValueError(f"write_state_into: the state encodes to {encoded.nbytes} bytes but "
                         f"buffer has {len(view)}; pass a buffer of at least that size")
    if encoded.nbytes:
        pack_encoded(encoded, torch.frombuffer(view, dtype=torch.uint8, count=encoded.nbytes))
    return encoded.nbytes


def _write_chunks(encoded: EncodedState, f: IO[bytes], chunk_bytes: int) -> None:
    staging = _native.empty_bytearray(min(chunk_bytes, max(encoded.nbytes, 1)))
    view = torch.frombuffer(staging, dtype=torch.uint8)
    for start in range(0, encoded.nbytes, len(staging)):
        n = min(len(staging), encoded.nbytes - start)
        pack_encoded(encoded, view[:n], start)
        write_fully(f, memoryview(staging)[:n], "write_state")


def write_fully(f: IO[bytes], data: memoryview, what: str) -> None:
    """Writes every byte of ``data`` to ``f``, calling ``write`` again after a short write.

    Raises:
        OSError: ``f.write`` took nothing (returned 0, or None: a non-blocking stream that
            would block), naming how far it got.
    """
    done, total = 0, len(data)
    while done < total:
        n = f.write(data[done:])
        if n is None or not isinstance(n, int) or n <= 0:
            raise OSError(
                f"{what}: the stream took no bytes after {done} of {total} (write returned "
                f"{n!r}); pass a blocking binary stream (a file, io.BufferedWriter, or a "
                "socket's makefile('wb'))"
            )
        done += n


# -- decoding ------------------------------------------------------------------------------


class _Reader:
    """Bounds-checked reads from the header blob."""

    def __init__(self, blob: memoryview) -> None:
        self.blob = blob
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > len(self.blob) - self.pos:
            raise ValueError(f"decode_state: truncated header: {what} needs {n} bytes at "
                             f"{self.pos}, {len(self.blob) - self.pos} left")
        out = self.blob[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, s: struct.Struct, what: str) -> tuple[Any, ...]:
        return s.unpack(self.take(s.size, what))

    def count(self, what: str, min_item_bytes: int) -> int:
        (n,) = self.unpack(_U32, what)
        # Every item takes at least min_item_bytes: a count the header cannot hold is a lie,
        # and rejecting it here bounds every allocation by the buffer's size.
        if n * min_item_bytes > len(self.blob) - self.pos:
            raise ValueError(f"decode_state: {what} count {n} exceeds what the header holds")
        return n


def _check_preamble(buf: memoryview, exact: bool = True) -> tuple[int, int, int]:
    if len(buf) < _PREAMBLE.size:
        raise ValueError(f"decode_state: buffer of {len(buf)} bytes is shorter than the "
                         f"{_PREAMBLE.size}-byte preamble")
    magic, version, flags, header_len, data_off, data_len = _PREAMBLE.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError(f"decode_state: bad magic {bytes(magic)!r}; this is not a "
                         "distributed_ext state (expected b'DXST')")
    if version != VERSION or flags != 0:
        raise ValueError(f"decode_state: format version {version} flags {flags} is not "
                         f"supported (this reader knows version {VERSION}, flags 0)")
    if _PREAMBLE.size + header_len > data_off or data_off % ALIGNMENT:
        raise ValueError("decode_state: header length and data offset disagree")
    if exact and data_off + data_len != len(buf):
        raise ValueError(f"decode_state: the preamble says {data_off + data_len} bytes, the "
                         f"buffer has {len(buf)} (truncated or padded?)")
    return header_len, data_off, data_len


DEFAULT_MAX_EXPANSION = 1024
_TENSORS_PER_BYTE = 64  # the default tensor cap: one tensor per 64 buffer bytes, plus 1024
_MIN_TENSORS = 1024


def resolve_max_tensors(nbytes: int, max_tensors: int | None) -> int:
    """The tensor-count cap for a buffer of ``nbytes``: ``max_tensors`` or the default."""
    if max_tensors is not None:
        return max_tensors
    return _MIN_TENSORS + nbytes // _TENSORS_PER_BYTE


def decode_state(buffer: bytes | bytearray | memoryview, *,
                 max_expansion: int = DEFAULT_MAX_EXPANSION,
                 max_tensors: int | None = None) -> Any:
    """Decodes an encoded state; its tensors are views of ``buffer`` (no tensor bytes copied).

    The buffer stays alive as long as any decoded tensor does. Tensors decoded from a
    read-only buffer (``bytes``) must not be written to; pass a bytearray for writable ones.

    Bounds, so that a hostile buffer cannot make the decoder or its consumer allocate without
    limit:

    - Peak memory: no tensor data, and Python objects of at most about 16x the buffer's size
      plus 1 MiB. A decoded tensor costs ~0.9 KiB of Python and torch objects, so the number of
      tensors is capped at ``max_tensors`` (default: one per 64 buffer bytes, plus 1024: every
      tensor that owns its storage takes at least 64 bytes of data region anyway); values
      of the tree cost at most ~16x their encoded bytes (an 8-byte list slot per 1-byte None).
    - Logical size: a tensor may address more elements than its bytes (an ``expand``-ed view,
      stride 0), but its logical size (``numel x itemsize``) may not exceed ``max_expansion``
      times the buffer's size (default 1024), so no consumer is handed, say, 2**62 elements
      from 192 bytes. Raise it for states of heavily expanded views.

    Args:
        buffer: The encoded bytes (bytes, bytearray, memoryview, or any contiguous buffer).
        max_expansion: The largest logical tensor size, as a multiple of ``len(buffer)``.
        max_tensors: The most tensor records accepted (None: the default above).

    Raises:
        ValueError: the buffer is malformed (truncated, mutated, hostile): every length,
            offset, dtype, shape, stride, device index, string and nesting depth is checked
            before use, and the bounds above are enforced; the message names what is wrong.
        TypeError: ``buffer`` is not a contiguous byte buffer.
    """
    try:
        buf = memoryview(buffer)
    except TypeError:
        raise TypeError(f"decode_state: expected bytes, bytearray or memoryview, got "
                        f"{type(buffer).__name__}") from None
    if not buf.c_contiguous:
        raise TypeError("decode_state: the buffer must be contiguous")
    buf = buf.cast("B") if (buf.format != "B" or buf.ndim != 1) else buf
    header_len, data_off, data_len = _check_preamble(buf)
    reader = _Reader(buf[_PREAMBLE.size : _PREAMBLE.size + header_len])
    tensor_cap = resolve_max_tensors(len(buf), max_tensors)
    logical_cap = max_expansion * len(buf)

    # Storages: 64-byte aligned, in increasing order, never overlapping (as the writer lays
    # them out), so their number is bounded by the data region; kept as two flat int arrays.
    n_storages = reader.count("storage table", _STORAGE.size)
    if n_storages > data_len // ALIGNMENT + 1:
        raise ValueError(f"decode_state: {n_storages} storages cannot fit a data region of "
                         f"{data_len} bytes at 64-byte alignment")
    storage_starts = array.array("q")
    storage_lens = array.array("q")
    previous_end = 0
    for i in range(n_storages):
        offset, nbytes = reader.unpack(_STORAGE, "storage record")
        if offset > data_len or nbytes > data_len - offset or nbytes == 0:
            raise ValueError(f"decode_state: storage {i} [{offset}, +{nbytes}) lies outside "
                             f"the data region of {data_len} bytes")
        if offset % ALIGNMENT or offset < previous_end:
            raise ValueError(f"decode_state: storage {i} at {offset} is not 64-byte aligned "
                             "after the previous one (storages overlap or are out of order)")
        previous_end = offset + nbytes
        storage_starts.append(data_off + offset)
        storage_lens.append(nbytes)

    n_tensors = reader.count("tensor table", _TENSOR.size)
    if n_tensors > tensor_cap:
        raise ValueError(f"decode_state: {n_tensors} tensor records exceed the cap of "
                         f"{tensor_cap} for a buffer of {len(buf)} bytes; pass max_tensors= "
                         "to accept more if the buffer is trusted")
    storage_views: dict[int, torch.Tensor] = {}

    def storage_view(index: int) -> torch.Tensor:
        view = storage_views.get(index)
        if view is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffers: see above
                view = torch.frombuffer(buf, dtype=torch.uint8, count=storage_lens[index],
                                        offset=storage_starts[index])
            storage_views[index] = view
        return view

    tensors: list[torch.Tensor] = []
    for i in range(n_tensors):
        code, ndim, storage, offset = reader.unpack(_TENSOR, "tensor record")
        dtype = CODE_DTYPES.get(code)
        if dtype is None:
            raise ValueError(f"decode_state: tensor {i} has unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise ValueError(f"decode_state: tensor {i} has {ndim} dims (at most {MAX_NDIM})")
        dims = struct.unpack(f"<{2 * ndim}q", reader.take(16 * ndim, "tensor shape"))
        shape, strides = dims[:ndim], dims[ndim:]
        if any(d < 0 for d in shape) or any(s < 0 for s in strides):
            raise ValueError(f"decode_state: tensor {i} has a negative size or stride")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = dtype.itemsize
        if numel * itemsize > logical_cap:
            raise ValueError(
                f"decode_state: tensor {i} ({dtype}, shape {list(shape)}) has a logical size "
                f"of {numel * itemsize} bytes, over max_expansion={max_expansion} times the "
                f"{len(buf)}-byte buffer; pass a larger max_expansion if the buffer is trusted"
            )
        try:
            if numel == 0:
                if storage != _NO_STORAGE:
                    raise ValueError(f"decode_state: empty tensor {i} names a storage")
                tensors.append(torch.empty(shape, dtype=dtype).as_strided(shape, strides))
                continue
            if storage >= n_storages:
                raise ValueError(f"decode_state: tensor {i} names storage {storage} of "
                                 f"{n_storages}")
            reach = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
            span_len = storage_lens[storage]
            if offset % itemsize or offset > span_len or reach * itemsize > span_len - offset:
                raise ValueError(f"decode_state: tensor {i} ({dtype}, shape {list(shape)}, "
                                 f"strides {list(strides)}) at byte {offset} does not fit its "
                                 f"storage of {span_len} bytes")
            flat = storage_view(storage)[offset : offset + reach * itemsize].view(dtype)
            tensors.append(flat.as_strided(shape, strides))
        except (RuntimeError, OverflowError) as exc:
            raise ValueError(f"decode_state: tensor {i} cannot be built: {exc}") from None

    value = _decode_value(reader, tensors, 0)
    if reader.pos != len(reader.blob):
        raise ValueError(f"decode_state: {len(reader.blob) - reader.pos} stray bytes after "
                         "the value tree")
    return value


def _decode_value(r: _Reader, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"decode_state: values nest deeper than {MAX_DEPTH}")
    (tag,) = r.take(1, "value tag")
    if tag == T_NONE:
        return None
    if tag == T_FALSE:
        return False
    if tag == T_TRUE:
        return True
    if tag == T_INT:
        return r.unpack(_I64, "int")[0]
    if tag == T_BIGINT:
        (n,) = r.unpack(_U32, "bigint length")
        return int.from_bytes(r.take(n, "bigint"), "little", signed=True)
    if tag == T_FLOAT:
        return r.unpack(_F64, "float")[0]
    if tag == T_STR:
        (n,) = r.unpack(_U32, "str length")
        try:
            return str(r.take(n, "str"), "utf-8")  # strict: encoded surrogates are refused
        except UnicodeDecodeError as exc:
            raise ValueError(f"decode_state: a str is not valid UTF-8 ({exc})") from None
    if tag == T_BYTES:
        (n,) = r.unpack(_U64, "bytes length")
        return bytes(r.take(n, "bytes"))
    if tag in (T_LIST, T_TUPLE):
        n = r.count("list", 1)
        items = [_decode_value(r, tensors, depth + 1) for _ in range(n)]
        return tuple(items) if tag == T_TUPLE else items
    if tag in (T_DICT, T_ODICT):
        n = r.count("dict", 2)
        out: dict[Any, Any] = collections.OrderedDict() if tag == T_ODICT else {}
        for _ in range(n):
            key = _decode_value(r, tensors, depth + 1)
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise ValueError(f"decode_state: a dict key is a {type(key).__name__}, not "
                                 "str or int")
            out[key] = _decode_value(r, tensors, depth + 1)
        return out
    if tag == T_DTYPE:
        (code,) = r.take(1, "dtype")
        if code not in CODE_DTYPES:
            raise ValueError(f"decode_state: unknown dtype code {code}")
        return CODE_DTYPES[code]
    if tag == T_SIZE:
        n = r.count("size", 8)
        dims = struct.unpack(f"<{n}q", r.take(8 * n, "size"))
        return torch.Size(dims)
    if tag == T_DEVICE:
        (n,) = r.unpack(_U32, "device type length")
        if n > 64:
            raise ValueError("decode_state: device type name too long")
        try:
            kind = bytes(r.take(n, "device type")).decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("decode_state: a device type name is not ASCII") from None
        (index,) = r.unpack(_I64, "device index")
        if not -1 <= index <= _MAX_DEVICE_INDEX:
            raise ValueError(f"decode_state: device index {index} is out of range (-1 for "
                             f"none, else 0..{_MAX_DEVICE_INDEX}, torch's DeviceIndex)")
        try:
            return torch.device(kind) if index == -1 else torch.device(kind, index)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"decode_state: bad device {kind!r}:{index} ({exc})") from None
    if tag == T_TENSOR:
        (i,) = r.unpack(_U32, "tensor index")
        if i >= len(tensors):
            raise ValueError(f"decode_state: tensor index {i} of {len(tensors)}")
        return tensors[i]
    raise ValueError(f"decode_state: unknown value tag {tag}")


_READ_PIECE = 64 * 2**20


def read_state(file: str | os.PathLike[str] | IO[bytes], *,
               max_expansion: int = DEFAULT_MAX_EXPANSION,
               max_tensors: int | None = None) -> Any:
    """Reads one state written by :func:`write_state` from a path or a binary stream; decodes it.

    The 32-byte preamble is read and checked first (magic, version, lengths), then exactly the
    length it declares, from the stream's current position; the stream is left just after the
    state, so several states can be read from one stream in turn. A regular file shorter than
    the declared length is refused before anything is allocated; from a pipe or socket the
    buffer grows only as bytes arrive (64 MiB at a time), so a lying preamble cannot make it
    allocate more than was sent. The decoded tensors are views of one bytearray of exactly the
    state's size (see :func:`decode_state` for ``max_expansion`` and ``max_tensors``).

    Raises:
        ValueError: not a state (bad magic or version), a truncated stream, or malformed bytes.
    """
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return read_state(f, max_expansion=max_expansion, max_tensors=max_tensors)
    preamble = bytearray(_PREAMBLE.size)
    _read_into(file, preamble, 0, _PREAMBLE.size, _PREAMBLE.size)
    header_len, data_off, data_len = _check_preamble(memoryview(preamble), exact=False)
    total = data_off + data_len
    available = _remaining_bytes(file)
    if available is not None and total - _PREAMBLE.size > available:
        raise ValueError(f"read_state: the preamble declares a {total}-byte state, but only "
                         f"{_PREAMBLE.size + available} bytes are left in the file (truncated?)")
    if available is not None:  # a regular file: one exact allocation
        buf = _native.empty_bytearray(total)
        buf[: _PREAMBLE.size] = preamble
        _read_into(file, buf, _PREAMBLE.size, total, total)
    else:  # a pipe or socket: grow with what actually arrives
        buf = preamble
        while len(buf) < total:
            start = len(buf)
            buf.extend(bytes(min(_READ_PIECE, total - start)))
            _read_into(file, buf, start, len(buf), total)
    return decode_state(buf, max_expansion=max_expansion, max_tensors=max_tensors)


def _remaining_bytes(file: IO[bytes]) -> int | None:
    """Bytes from the position to the end of a regular file or BytesIO; None for streams."""
    if isinstance(file, io.BytesIO):
        return len(file.getbuffer()) - file.tell()
    try:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        return st.st_size - file.tell()
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None


def _read_into(file: IO[bytes], buf: bytearray, start: int, end: int, total: int) -> None:
    """Fills ``buf[start:end]`` from ``file``; ValueError if the stream ends first."""
    view, pos = memoryview(buf), start
    while pos < end:
        if hasattr(file, "readinto"):
            k = file.readinto(view[pos:end])  # type: ignore[attr-defined]
        else:
            chunk = file.read(end - pos)
            k = len(chunk) if chunk else 0
            view[pos : pos + k] = chunk
        if not k:
            raise ValueError(f"read_state: the stream ended after {pos} of {total} bytes "
                             "(truncated?)")
        pos += k
