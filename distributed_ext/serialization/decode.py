"""Decoding a buffer or a file into a state whose tensors are views of the buffer: every
length, offset, dtype, shape, stride and nesting depth checked before use (never pickle);
malformed input raises ValueError."""

from __future__ import annotations

import array
import collections
import io
import os
import stat
import struct
import warnings
from typing import IO, Any

import torch

from distributed_ext import _native
from distributed_ext.serialization import format as fmt


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
        (n,) = self.unpack(fmt._U32, what)
        # Every item takes at least min_item_bytes: a count the header cannot hold is a lie,
        # and rejecting it here bounds every allocation by the buffer's size.
        if n * min_item_bytes > len(self.blob) - self.pos:
            raise ValueError(f"decode_state: {what} count {n} exceeds what the header holds")
        return n


def _check_preamble(buf: memoryview, exact: bool = True) -> tuple[int, int, int]:
    if len(buf) < fmt._PREAMBLE.size:
        raise ValueError(f"decode_state: buffer of {len(buf)} bytes is shorter than the "
                         f"{fmt._PREAMBLE.size}-byte preamble")
    magic, version, flags, header_len, data_off, data_len = fmt._PREAMBLE.unpack_from(buf)
    if magic != fmt.MAGIC:
        raise ValueError(f"decode_state: bad magic {bytes(magic)!r}; this is not a "
                         "distributed_ext state (expected b'DXST')")
    if version != fmt.VERSION or flags != 0:
        raise ValueError(f"decode_state: format version {version} flags {flags} is not "
                         f"supported (this reader knows version {fmt.VERSION}, flags 0)")
    if fmt._PREAMBLE.size + header_len > data_off or data_off % fmt.ALIGNMENT:
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
    reader = _Reader(buf[fmt._PREAMBLE.size : fmt._PREAMBLE.size + header_len])
    tensor_cap = resolve_max_tensors(len(buf), max_tensors)
    logical_cap = max_expansion * len(buf)

    # Storages: 64-byte aligned, in increasing order, never overlapping (as the writer lays
    # them out), so their number is bounded by the data region; kept as two flat int arrays.
    n_storages = reader.count("storage table", fmt._STORAGE.size)
    if n_storages > data_len // fmt.ALIGNMENT + 1:
        raise ValueError(f"decode_state: {n_storages} storages cannot fit a data region of "
                         f"{data_len} bytes at 64-byte alignment")
    storage_starts = array.array("q")
    storage_lens = array.array("q")
    previous_end = 0
    for i in range(n_storages):
        offset, nbytes = reader.unpack(fmt._STORAGE, "storage record")
        if offset > data_len or nbytes > data_len - offset or nbytes == 0:
            raise ValueError(f"decode_state: storage {i} [{offset}, +{nbytes}) lies outside "
                             f"the data region of {data_len} bytes")
        if offset % fmt.ALIGNMENT or offset < previous_end:
            raise ValueError(f"decode_state: storage {i} at {offset} is not 64-byte aligned "
                             "after the previous one (storages overlap or are out of order)")
        previous_end = offset + nbytes
        storage_starts.append(data_off + offset)
        storage_lens.append(nbytes)

    n_tensors = reader.count("tensor table", fmt._TENSOR.size)
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
        code, ndim, storage, offset = reader.unpack(fmt._TENSOR, "tensor record")
        dtype = fmt.CODE_DTYPES.get(code)
        if dtype is None:
            raise ValueError(f"decode_state: tensor {i} has unknown dtype code {code}")
        if ndim > fmt.MAX_NDIM:
            raise ValueError(f"decode_state: tensor {i} has {ndim} dims (at most {fmt.MAX_NDIM})")
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
                if storage != fmt._NO_STORAGE:
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
    if depth > fmt.MAX_DEPTH:
        raise ValueError(f"decode_state: values nest deeper than {fmt.MAX_DEPTH}")
    (tag,) = r.take(1, "value tag")
    if tag == fmt.T_NONE:
        return None
    if tag == fmt.T_FALSE:
        return False
    if tag == fmt.T_TRUE:
        return True
    if tag == fmt.T_INT:
        return r.unpack(fmt._I64, "int")[0]
    if tag == fmt.T_BIGINT:
        (n,) = r.unpack(fmt._U32, "bigint length")
        return int.from_bytes(r.take(n, "bigint"), "little", signed=True)
    if tag == fmt.T_FLOAT:
        return r.unpack(fmt._F64, "float")[0]
    if tag == fmt.T_STR:
        (n,) = r.unpack(fmt._U32, "str length")
        try:
            return str(r.take(n, "str"), "utf-8")  # strict: encoded surrogates are refused
        except UnicodeDecodeError as exc:
            raise ValueError(f"decode_state: a str is not valid UTF-8 ({exc})") from None
    if tag == fmt.T_BYTES:
        (n,) = r.unpack(fmt._U64, "bytes length")
        return bytes(r.take(n, "bytes"))
    if tag in (fmt.T_LIST, fmt.T_TUPLE):
        n = r.count("list", 1)
        items = [_decode_value(r, tensors, depth + 1) for _ in range(n)]
        return tuple(items) if tag == fmt.T_TUPLE else items
    if tag in (fmt.T_DICT, fmt.T_ODICT):
        n = r.count("dict", 2)
        out: dict[Any, Any] = collections.OrderedDict() if tag == fmt.T_ODICT else {}
        for _ in range(n):
            key = _decode_value(r, tensors, depth + 1)
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise ValueError(f"decode_state: a dict key is a {type(key).__name__}, not "
                                 "str or int")
            out[key] = _decode_value(r, tensors, depth + 1)
        return out
    if tag == fmt.T_DTYPE:
        (code,) = r.take(1, "dtype")
        if code not in fmt.CODE_DTYPES:
            raise ValueError(f"decode_state: unknown dtype code {code}")
        return fmt.CODE_DTYPES[code]
    if tag == fmt.T_SIZE:
        n = r.count("size", 8)
        dims = struct.unpack(f"<{n}q", r.take(8 * n, "size"))
        return torch.Size(dims)
    if tag == fmt.T_DEVICE:
        (n,) = r.unpack(fmt._U32, "device type length")
        if n > 64:
            raise ValueError("decode_state: device type name too long")
        try:
            kind = bytes(r.take(n, "device type")).decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("decode_state: a device type name is not ASCII") from None
        (index,) = r.unpack(fmt._I64, "device index")
        if not -1 <= index <= fmt._MAX_DEVICE_INDEX:
            raise ValueError(f"decode_state: device index {index} is out of range (-1 for "
                             f"none, else 0..{fmt._MAX_DEVICE_INDEX}, torch's DeviceIndex)")
        try:
            return torch.device(kind) if index == -1 else torch.device(kind, index)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"decode_state: bad device {kind!r}:{index} ({exc})") from None
    if tag == fmt.T_TENSOR:
        (i,) = r.unpack(fmt._U32, "tensor index")
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
    preamble = bytearray(fmt._PREAMBLE.size)
    _read_into(file, preamble, 0, fmt._PREAMBLE.size, fmt._PREAMBLE.size)
    header_len, data_off, data_len = _check_preamble(memoryview(preamble), exact=False)
    total = data_off + data_len
    available = _remaining_bytes(file)
    if available is not None and total - fmt._PREAMBLE.size > available:
        raise ValueError(f"read_state: the preamble declares a {total}-byte state, but only "
                         f"{fmt._PREAMBLE.size + available} bytes are left in the file (truncated?)")
    if available is not None:  # a regular file: one exact allocation
        buf = _native.empty_bytearray(total)
        buf[: fmt._PREAMBLE.size] = preamble
        _read_into(file, buf, fmt._PREAMBLE.size, total, total)
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
