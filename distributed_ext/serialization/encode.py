"""Encoding a state: a header and the segments that view its tensors' own memory (nothing
copied), and writing them to a file or a buffer."""

from __future__ import annotations

import collections
import os
import weakref
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from distributed_ext import _native
from distributed_ext._atomic import replacing
from distributed_ext._device_spans import spans_to_host
from distributed_ext._dtensor import is_dtensor
from distributed_ext._source import ByteSource
from distributed_ext.serialization import format as fmt


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
        if depth > fmt.MAX_DEPTH:
            raise TypeError(f"encode_state: {fmt._path(path)} nests deeper than {fmt.MAX_DEPTH} levels "
                            "(a container that contains itself?); flatten the state")
        out = self.out
        if obj is None:
            out.append(fmt.T_NONE)
        elif obj is True or obj is False:
            out.append(fmt.T_TRUE if obj else fmt.T_FALSE)
        elif isinstance(obj, int) and not isinstance(obj, bool):
            value = int(obj)
            if -(2**63) <= value < 2**63:
                out.append(fmt.T_INT)
                out += fmt._I64.pack(value)
            else:
                raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
                out.append(fmt.T_BIGINT)
                out += fmt._U32.pack(len(raw)) + raw
        elif isinstance(obj, float):
            out.append(fmt.T_FLOAT)
            out += fmt._F64.pack(float(obj))
        elif isinstance(obj, str):
            try:
                raw = str(obj).encode("utf-8")
            except UnicodeEncodeError as exc:
                raise TypeError(
                    f"encode_state: {fmt._path(path)} is a str that is not valid Unicode text "
                    f"({exc.reason} at index {exc.start}); the format carries UTF-8 only -- "
                    "remove the lone surrogate or store the raw bytes instead"
                ) from None
            out.append(fmt.T_STR)
            out += fmt._U32.pack(len(raw)) + raw
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            raw = bytes(obj)
            out.append(fmt.T_BYTES)
            out += fmt._U64.pack(len(raw)) + raw
        elif isinstance(obj, torch.Tensor):
            out.append(fmt.T_TENSOR)
            out += fmt._U32.pack(self.tensor(obj, path))
        elif isinstance(obj, torch.dtype):
            if obj not in fmt.DTYPE_CODES:
                raise TypeError(f"encode_state: {fmt._path(path)} is the dtype {obj}, which the "
                                "format does not carry; store its name as a str instead")
            out.append(fmt.T_DTYPE)
            out.append(fmt.DTYPE_CODES[obj])
        elif isinstance(obj, torch.Size):
            out.append(fmt.T_SIZE)
            out += fmt._U32.pack(len(obj))
            for d in obj:
                out += fmt._I64.pack(int(d))
        elif isinstance(obj, torch.device):
            raw = obj.type.encode("ascii")  # torch's device type names are ASCII
            out.append(fmt.T_DEVICE)
            out += fmt._U32.pack(len(raw)) + raw + fmt._I64.pack(-1 if obj.index is None else obj.index)
        elif isinstance(obj, dict):
            out.append(fmt.T_ODICT if isinstance(obj, collections.OrderedDict) else fmt.T_DICT)
            out += fmt._U32.pack(len(obj))
            for key, item in obj.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise TypeError(
                        f"encode_state: {fmt._path(path)} has a key {key!r} of type "
                        f"{type(key).__name__}; keys must be str or int -- convert it, e.g. "
                        "str(key)"
                    )
                self.value(key, path, depth + 1)
                self.value(item, fmt._key_path(path, key), depth + 1)
        elif isinstance(obj, (list, tuple)):
            out.append(fmt.T_TUPLE if isinstance(obj, tuple) else fmt.T_LIST)
            out += fmt._U32.pack(len(obj))
            for i, item in enumerate(obj):
                self.value(item, f"{fmt._path(path)}[{i}]", depth + 1)
        else:
            raise TypeError(
                f"encode_state: {fmt._path(path)} is a {type(obj).__module__}."
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
        where = fmt._path(path)
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
        if t.dtype not in fmt.DTYPE_CODES:
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
    aligned = lo_abs // fmt.ALIGNMENT * fmt.ALIGNMENT
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
            storage, offset, strides = fmt._NO_STORAGE, 0, tuple(t.stride())
        records.append((fmt.DTYPE_CODES[t.dtype], storage, offset, tuple(t.shape), strides))

    # Lay the data region out: every storage span 64-byte aligned.
    storage_table = bytearray(fmt._U32.pack(len(storages)))
    data_offsets, pos = [], 0
    for _seg, nbytes in storages:
        data_offsets.append(pos)
        storage_table += fmt._STORAGE.pack(pos, nbytes)
        pos = fmt._align(pos + nbytes)
    data_len = data_offsets[-1] + storages[-1][1] if storages else 0

    tensor_table = bytearray(fmt._U32.pack(len(records)))
    for code, storage, offset, shape, strides in records:
        tensor_table += fmt._TENSOR.pack(code, len(shape), storage, offset)
        for d in shape:
            tensor_table += fmt._I64.pack(d)
        for s in strides:
            tensor_table += fmt._I64.pack(s)

    blob = bytes(storage_table) + bytes(tensor_table) + tree
    data_off = fmt._align(fmt._PREAMBLE.size + len(blob))
    preamble = fmt._PREAMBLE.pack(fmt.MAGIC, fmt.VERSION, 0, len(blob), data_off, data_len)
    head = bytearray(data_off)
    head[: fmt._PREAMBLE.size + len(blob)] = preamble + blob

    zeros = torch.zeros(fmt.ALIGNMENT, dtype=torch.uint8)
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
