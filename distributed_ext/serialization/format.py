"""The state format's constants, shared by the encoder and the decoder: magic, version,
alignment and limits, the fixed dtype codes, the value tags and the binary records (the
layout: ``docs/format.md``)."""

from __future__ import annotations

import struct

import torch

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
