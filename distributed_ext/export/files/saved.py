"""A DCP checkpoint on disk, read without loading a tensor: each key's dtype, global shape
and saved chunks (:class:`SavedTensor`), and each chunk's bytes read box by box
(:class:`SavedSource`, what the export's transport reads a piece from).

Two layouts: what ``dcp.save`` writes with ``FileSystemWriter`` (``.metadata``, read by
torch's own ``FileSystemReader.read_metadata`` -- a pickle: the user's own checkpoint is the
trust boundary -- and ``__<rank>_<n>.distcp`` files of ``torch.save`` items or safetensors),
and what ``HuggingFaceStorageWriter`` writes unconsolidated (``*.safetensors`` files whose
``__metadata__["DCP_SHARDING_INFO"]`` gives each key's ``saved_offsets``; the headers are
JSON, parsed and checked here). Every offset and size read is checked against the files
before a byte moves (:meth:`Saved.check_files`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass

import torch

from distributed_ext import _native
from distributed_ext.export.files.torch_items import ItemError, locate_tensor
from distributed_ext.export.plan.safetensors import MAX_HEADER_BYTES, SAFETENSORS_DTYPES
from distributed_ext.export.plan.saved import Chunk, SavedTensor

_DTYPE_OF_CODE = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_ZIP_MAGIC = b"PK\x03\x04"
_SHARDING_KEY = "DCP_SHARDING_INFO"
# What a read asks the kernel to read ahead after it (:meth:`SavedSource._read`)
PREFETCH_BYTES = 32 * 2**20


@dataclass
class Saved:
    """A DCP checkpoint's tensors under a prefix (keys without it), and its digest."""

    directory: str
    tensors: dict[str, SavedTensor]
    digest: str = ""

    def check_files(self, keys: list[str]) -> None:
        """ValueError naming the file and the key where a chunk of one of ``keys`` lies in a
        file that is missing, not a regular file, or shorter than the chunk reaches (a
        truncated save)."""
        sizes: dict[str, int | None] = {}
        for key in keys:
            for c in self.tensors[key].chunks:
                if c.path not in sizes:
                    try:
                        st = os.stat(c.path)
                        sizes[c.path] = st.st_size if stat.S_ISREG(st.st_mode) else None
                    except FileNotFoundError:
                        raise ValueError(
                            f"{_show(c.path, self.directory)} is missing, but the checkpoint's "
                            f"key {key!r} (chunk at offsets {list(c.offsets)}) is saved in it; "
                            "copy the whole checkpoint directory") from None
                size = sizes[c.path]
                if size is None:
                    raise ValueError(f"{_show(c.path, self.directory)} is not a regular file; "
                                     f"the checkpoint's key {key!r} is saved in it")
                if c.start + c.length > size:
                    raise ValueError(
                        f"{_show(c.path, self.directory)} is {size} bytes, but the checkpoint's "
                        f"key {key!r} (chunk at offsets {list(c.offsets)}) lies at bytes "
                        f"{c.start}..{c.start + c.length}: the file is truncated; save the "
                        "checkpoint again (or copy it whole)")


def read_saved(directory: str, prefix: str) -> Saved:
    """The checkpoint's tensors under ``prefix`` (the key ``prefix + k`` as ``k``).

    ValueError naming what is wrong: no checkpoint in ``directory``, a layout this cannot
    read (a storage transform, a header that is not safetensors'), a header field out of
    range."""
    if not os.path.isdir(directory):
        raise ValueError(f"dcp_dir: {directory!r} is not a directory; pass the directory "
                         "dcp.save wrote")
    if os.path.isfile(os.path.join(directory, ".metadata")):
        saved = _read_dcp_metadata(directory, prefix)
    else:
        saved = _read_hf_shards(directory, prefix)
    h = hashlib.blake2b(digest_size=16)
    for key, t in saved.tensors.items():
        h.update(json.dumps([key, str(t.dtype), t.shape, [
            (c.offsets, c.sizes, os.path.relpath(c.path, directory), c.start, c.length, c.raw)
            for c in t.chunks]]).encode())
    saved.digest = h.hexdigest()
    return saved


def _show(path: str, directory: str) -> str:
    return f"the saved file {os.path.relpath(path, directory)!r} (in {directory})"


def _read_dcp_metadata(directory: str, prefix: str) -> Saved:
    """``.metadata`` read by torch's own reader; each chunk's item located: a torch.save zip
    (its tensor found on first read), or a tensor of a safetensors file (from its header)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as exc:
        raise ValueError(f"dcp_dir: torch's FileSystemReader cannot read {directory}/.metadata "
                         f"({type(exc).__name__}: {exc}); pass a directory dcp.save "
                         "wrote") from exc
    headers: dict[str, tuple[dict, int] | None] = {}
    out: dict[str, SavedTensor] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        key = fqn[len(prefix):]
        if not isinstance(md, TensorStorageMetadata):  # (a step counter, an object)
            continue
        shape = tuple(int(s) for s in md.size)
        dtype = md.properties.dtype
        chunks = []
        for c in md.chunks:
            info = metadata.storage_data.get(MetadataIndex(fqn, c.offsets))
            if info is None:
                raise ValueError(f"the checkpoint's .metadata names no file for key {fqn!r} "
                                 f"(chunk at offsets {list(c.offsets)}); save it again")
            if info.transform_descriptors:
                raise ValueError(f"the checkpoint's key {fqn!r} was saved through storage "
                                 f"transforms {list(info.transform_descriptors)} (an "
                                 "extension such as compression), which this cannot read "
                                 "without loading it; save without extensions")
            path = os.path.join(directory, info.relative_path)
            if os.path.dirname(os.path.normpath(path)) != os.path.normpath(directory):
                raise ValueError(f"the checkpoint's .metadata places key {fqn!r} in "
                                 f"{info.relative_path!r}, outside {directory}")
            offsets = tuple(int(o) for o in c.offsets)
            sizes = tuple(int(s) for s in c.sizes)
            if path not in headers:
                headers[path] = _safetensors_header_if_any(path)
            header = headers[path]
            if header is None:  # torch.save items: located on first read
                chunks.append(Chunk(offsets, sizes, path, int(info.offset), int(info.length),
                                    raw=False))
            else:
                chunks.append(_header_chunk(header, fqn, path, dtype, offsets, sizes))
        out[key] = SavedTensor(key, dtype, shape, chunks)
    return Saved(directory, out)


def _read_hf_shards(directory: str, prefix: str) -> Saved:
    """The ``*.safetensors`` files ``HuggingFaceStorageWriter`` wrote unconsolidated: each
    key's chunks from the files' headers and their ``DCP_SHARDING_INFO``; the global shape
    the chunks' extent."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    found: dict[str, list[tuple[Chunk, torch.dtype]]] = {}
    for name in names:
        path = os.path.join(directory, name)
        found_header = _safetensors_header_if_any(path)
        if found_header is None:
            raise ValueError(f"{_show(path, directory)} is not a safetensors file")
        header = found_header[0]
        metadata = header.get("__metadata__")
        info = metadata.get(_SHARDING_KEY) if isinstance(metadata, dict) else None
        if info is None:
            raise ValueError(
                f"{_show(path, directory)} has no {_SHARDING_KEY} in its metadata: it is not "
                "what dcp.save wrote (a consolidated Hugging Face checkpoint needs no "
                "converting); pass a directory with DCP's .metadata or its sharded "
                "safetensors")
        try:
            sharding = json.loads(info)
        except ValueError:
            raise ValueError(f"{_show(path, directory)}: its {_SHARDING_KEY} is not JSON") from None
        for fqn, entry in header.items():
            if fqn == "__metadata__" or not fqn.startswith(prefix):
                continue
            info = sharding.get(fqn) if isinstance(sharding, dict) else None
            offsets = info.get("saved_offsets") if isinstance(info, dict) else None
            if offsets is None:
                raise ValueError(f"{_show(path, directory)}: key {fqn!r} has no saved_offsets "
                                 f"in its {_SHARDING_KEY}")
            dtype = _header_dtype(entry, fqn, path)
            shape = _int_tuple(entry.get("shape"), f"{fqn!r}'s shape", path)
            offsets = _int_tuple(offsets, f"{fqn!r}'s saved_offsets", path)
            if len(offsets) != len(shape):
                raise ValueError(f"{_show(path, directory)}: key {fqn!r} has saved_offsets "
                                 f"{list(offsets)} for a tensor of shape {list(shape)}")
            found.setdefault(fqn, []).append(
                (_header_chunk(found_header, fqn, path, dtype, offsets, shape), dtype))
    if not names:
        raise ValueError(f"dcp_dir: {directory} holds no .metadata and no .safetensors files; "
                         "pass the directory dcp.save wrote")
    out = {}
    for fqn, chunks in found.items():
        dtypes = {d for _c, d in chunks}
        if len(dtypes) > 1:
            raise ValueError(f"the checkpoint's key {fqn!r} is saved in several dtypes "
                             f"({sorted(map(str, dtypes))}); save it again")
        rank = len(chunks[0][0].sizes)
        if any(len(c.sizes) != rank for c, _d in chunks):
            raise ValueError(f"the checkpoint's key {fqn!r} is saved in chunks of different "
                             "ranks (numbers of dims)")
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c, _d in chunks) for d in range(rank))
        out[fqn[len(prefix):]] = SavedTensor(fqn[len(prefix):], chunks[0][1], shape,
                                             [c for c, _d in chunks])
    return Saved(directory, out)


def _safetensors_header_if_any(path: str) -> tuple[dict, int] | None:
    """The file's safetensors header (its JSON) and where its data starts, or None for a
    torch.save zip; ValueError for a file that is neither (or is unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head[:4] == _ZIP_MAGIC:
                return None
            if len(head) < 8:
                raise ValueError(f"{path}: {len(head)} bytes, shorter than any saved file; "
                                 "the file is truncated")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"{path}: its header claims {n} bytes (most: "
                                 f"{MAX_HEADER_BYTES}): not a safetensors file")
            raw = f.read(n)
    except FileNotFoundError:
        raise ValueError(f"{path} is missing; the checkpoint's metadata names it") from None
    if len(raw) != n:
        raise ValueError(f"{path}: its header is cut short ({len(raw)} of {n} bytes): the "
                         "file is truncated")
    try:
        header = json.loads(raw)
    except ValueError:
        raise ValueError(f"{path}: neither a torch.save item file nor safetensors") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its safetensors header is not a JSON object")
    return header, 8 + n


def _header_chunk(header: tuple[dict, int], fqn: str, path: str, dtype: torch.dtype,
                  offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Chunk:
    """A chunk saved as tensor ``fqn`` of a safetensors file, checked against its header."""
    header, data_start = header
    entry = header.get(fqn)
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: its header has no tensor {fqn!r}, which the checkpoint's "
                         "metadata places there; save the checkpoint again")
    where = f"{path}: tensor {fqn!r}"
    if _header_dtype(entry, fqn, path) != dtype or _int_tuple(
            entry.get("shape"), "shape", path) != sizes:
        raise ValueError(f"{where} is {entry.get('dtype')} {entry.get('shape')} in its header, "
                         f"but the metadata says {dtype} {list(sizes)}")
    begin, end = _int_tuple(entry.get("data_offsets"), "data_offsets", path)
    if end - begin != math.prod(sizes) * dtype.itemsize or begin < 0:
        raise ValueError(f"{where}: its data_offsets {[begin, end]} do not hold "
                         f"{math.prod(sizes)} elements of {dtype}")
    start = data_start + begin
    return Chunk(offsets, sizes, path, start, end - begin, raw=True)


def _header_dtype(entry: dict, fqn: str, path: str) -> torch.dtype:
    dtype = _DTYPE_OF_CODE.get(entry.get("dtype")) if isinstance(entry, dict) else None
    if dtype is None:
        raise ValueError(f"{path}: tensor {fqn!r} has dtype {entry.get('dtype')!r}, which "
                         "safetensors does not name")
    return dtype


def _int_tuple(value: object, what: str, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"{path}: {what} is {value!r}, not a list of non-negative ints")
    return tuple(value)


class SavedSource:
    """The saved chunks of one key, read box by box where the transport slices a piece out
    of it (:func:`~distributed_ext.export.transport.stager._piece_tensor`; its blocks always
    name their box, :func:`plan.saved.saved_blocks`): a box lies inside one
    chunk (the plan cuts its blocks so), and is read from the file as the chunk's rows that
    hold it -- at most the plan's block, whatever the chunk's size -- then cast to ``dtype``
    where the output's dtype differs from the saved one. A plain CPU source to the transport
    (``is_cuda`` False, no autograd)."""

    is_cuda = False
    is_cpu = True
    requires_grad = False
    device = torch.device("cpu")

    def __init__(self, saved: SavedTensor, dtype: torch.dtype, directory: str) -> None:
        self.saved, self.dtype, self.directory = saved, dtype, directory
        self.located: dict[int, int] = {}  # chunk index -> file offset of its raw bytes
        self.last = 0  # the chunk of the last box read (pieces come in its rows' order)

    def __getitem__(self, local: tuple[slice, ...]) -> torch.Tensor:
        """``source[local]``, as the transport slices a local block: :meth:`read_box`."""
        return self.read_box(local)

    def read_box(self, local: tuple[slice, ...] | None) -> torch.Tensor:
        """The elements of the box ``local`` (slices in the tensor's global coordinates;
        None: the whole tensor, which then is one chunk) as a tensor of the output dtype."""
        saved = self.saved
        if local is None:
            local = tuple(slice(0, n) for n in saved.shape)
        index, chunk = saved.chunk_holding([s.start for s in local], [s.stop for s in local],
                                           self.last)
        self.last = index
        strides = [math.prod(chunk.sizes[d + 1:]) for d in range(len(chunk.sizes))]
        shape = [s.stop - s.start for s in local]
        if 0 in shape:
            return torch.empty(shape, dtype=self.dtype)
        # The span of the chunk (row-major) from the box's first element to its last: the
        # plan's blocks are contiguous in their chunk, so this is at most the block.
        first = sum((s.start - o) * st for s, o, st in zip(local, chunk.offsets, strides))
        last = sum((s.stop - 1 - o) * st for s, o, st in zip(local, chunk.offsets, strides))
        span = self._read(index, chunk, first, last + 1 - first)
        box = span.as_strided(shape, strides) if local else span.view(())
        return box.to(self.dtype) if box.dtype != self.dtype else box

    def _read(self, index: int, chunk: Chunk, first: int, count: int) -> torch.Tensor:
        """Elements ``first .. first + count`` of a chunk (row-major), read from its file."""
        itemsize = self.saved.dtype.itemsize
        fd = os.open(chunk.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            base = self.located.get(index)
            if base is None:
                if chunk.raw:
                    base = chunk.start
                else:
                    try:
                        base = locate_tensor(fd, chunk.start, chunk.length, self.saved.dtype,
                                             chunk.sizes).offset
                    except ItemError as exc:
                        raise ValueError(
                            f"{_show(chunk.path, self.directory)}: the item of key "
                            f"{self.saved.key!r} at bytes {chunk.start}.."
                            f"{chunk.start + chunk.length} cannot be read without loading "
                            f"it: {exc}") from None
                self.located[index] = base
            out = torch.empty(count, dtype=self.saved.dtype)
            at = base + first * itemsize
            got = _native.pread_into(fd, out.view(torch.uint8), at)
            # The bytes after these are most likely the next piece's (blocks are read in
            # file order): asked of the disk now, read while these are written.
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, at + got, PREFETCH_BYTES, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        if got != count * itemsize:
            raise ValueError(f"{_show(chunk.path, self.directory)}: a short read of key "
                             f"{self.saved.key!r} ({got} of {count * itemsize} bytes at byte "
                             f"{at}): the file is truncated")
        return out
