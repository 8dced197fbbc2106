"""The safetensors format as the export writes it: the dtypes it stores, file names, the
header, how tensors are laid out over files, and the one parser of ``max_shard_size``."""

from __future__ import annotations

import json
import re

import torch

from distributed_ext._direct_io import ALIGN
from distributed_ext.export.plan.types import Entry

# What safetensors stores (its dtype names); anything else is refused before bytes move.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}


for _name, _code in (("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES}


# The largest header safetensors' reader takes (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000


WEIGHTS_NAME = "model.safetensors"


INDEX_NAME = "model.safetensors.index.json"


_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_shard_size(value: int | str) -> int:
    """``5GB`` / ``500MiB`` / ``1000`` -> bytes (HF's units: KB/MB/GB decimal, KiB/MiB/GiB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"max_shard_size must be positive, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", value.upper())
        if m:
            units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                     "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
            n = int(float(m.group(1)) * units[m.group(2)])
            if n > 0:
                return n
    raise ValueError(f"max_shard_size={value!r}: pass a positive int of bytes or a size such "
                     "as '5GB' or '500MiB'")


def layout_files(entries: list[Entry], max_shard: int) -> list[list[Entry]]:
    """Keys into files in order, a new file when the next would pass ``max_shard`` (as HF)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


_json_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


# The file's block (the direct writes' unit): the data starts at a multiple of it (the header
# padded with spaces, as safetensors pads it to 8 bytes), and tensors of whole blocks come first.
DATA_ALIGN = ALIGN


def _laid_out(entries: list[Entry]) -> list[Entry]:
    """``entries`` in the order their data is laid out: those of whole blocks
    (:data:`DATA_ALIGN`) first, then the rest, each in order.

    Why: every tensor then starts at a block boundary, but for the small odd-sized ones
    (scales, biases, norms) that go last together; so does each rank's share of a tensor
    split evenly in whole blocks. A block that two ranks' runs share is written by its
    owner from their fragments (``writers="all"``), through the page cache; a 1 GiB FP8
    Llama laid out in key order, its scales between its weights, shared ~250 blocks a rank
    (each a stall of the disk's direct writes: ``files.regions``). Readers find tensors by
    their offsets (safetensors' own writer orders them by dtype)."""
    whole: list[Entry] = []
    rest: list[Entry] = []
    for e in entries:
        (whole if e.nbytes and e.nbytes % DATA_ALIGN == 0 else rest).append(e)
    return whole + rest


def safetensors_header(entries: list[Entry]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``entries`` and each key's data offset in the file: the
    header (its records in order) padded to whole :data:`DATA_ALIGN` blocks, the data laid
    out as :func:`_laid_out` says."""
    # The JSON written out directly (keys escaped by json's own encoder): the same text
    # json.dumps(separators=(",", ":")) makes of the dict, at a third of its cost -- a
    # checkpoint of 100k tensors has a header of 100k records.
    parts = ['{"__metadata__":{"format":"pt"}']
    offsets, pos = {}, 0
    for e in _laid_out(entries):
        offsets[e.key] = pos
        pos += e.nbytes
    quote = _json_string
    for e in entries:
        pos = offsets[e.key]
        end = pos + e.nbytes
        shape = ",".join(map(str, e.shape))
        parts.append(f'{quote(e.key)}:{{"dtype":"{SAFETENSORS_DTYPES[e.dtype]}",'
                     f'"shape":[{shape}],"data_offsets":[{pos},{end}]}}')
    raw = (",".join(parts) + "}").encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % DATA_ALIGN)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"a file's safetensors header would be {len(raw)} bytes for "
                         f"{len(entries)} tensors, over the {MAX_HEADER_BYTES} bytes safetensors "
                         "readers accept; pass a smaller max_shard_size (fewer tensors per file)")
    head = len(raw).to_bytes(8, "little") + raw
    return head, {k: v + len(head) for k, v in offsets.items()}
