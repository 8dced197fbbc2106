"""ModelOpt's row arithmetic for its two main formats done by the compiled core, in one pass
per row into the final bytes, where it gives ModelOpt's bytes.

ModelOpt computes a quantized weight with a chain of torch ops over float32 temporaries and
costs a few hundred microseconds of Python per call; a rank calls it once per MiB of its
rows. Here:

- **FP8 per-tensor** (``fp8``): each written byte is a function of one 2-byte weight value
  and the tensor's scale (``(w / scale).to(float8_e4m3fn)``). For bfloat16 weights under a
  finite positive float32 scale, torch's division and cast restated
  (:func:`distributed_ext._native.fp8_divide`, 1.2-1.6x the lookup below); else tabulated by
  ModelOpt's own export over all 65536 values of the weight's dtype, once per weight, and
  applied by table lookup (:func:`distributed_ext._native.map_through_table`): ModelOpt's
  bytes by construction.
- **NVFP4** (``nvfp4``, ``w4a16_nvfp4``) with scales computed from the weight (not a static
  quantizer's): :func:`distributed_ext._native.nvfp4_rows` restates its arithmetic in C++.
  (A block holding a NaN gets a NaN scale whose sign bit ModelOpt's own arithmetic sets
  differently with how many rows torch computes at once; no other byte differs.)
- **INT4 AWQ** (``int4_awq``): the per-group scales are ModelOpt's own (from the calibrated
  amax of those rows, no weight read); the codes and their packing in pairs of rows by
  :func:`distributed_ext._native.int4_rows`, which restates ``pack_int4_in_uint8``.

Each is compared, once per process and dtype, with ModelOpt's export of the same rows
(every finite value of the dtype and the infinities, shuffled) before it is used; where it
differs (another ModelOpt or torch), ModelOpt's arithmetic is used (for the FP8 division,
the table), with a warning. The FP8 tables of every weight looked up in one are kept where
they fit in 32 MiB, else those of the last 64 computed (4 MiB: :func:`keep_tables_for`);
nothing else.
"""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
from collections.abc import Callable

import torch

from distributed_ext._native import (
    fp8_divide,
    int4_rows,
    map_through_table,
    nvfp4_rows,
    nvfp4_scales,
)

# (fmt, dtype, block) -> whether the kernel gave ModelOpt's bytes in this process.
_CHECKED: dict[tuple, bool] = {}
_LOCK = threading.Lock()
_NVFP4 = ("nvfp4", "w4a16_nvfp4")

RowsFn = Callable[[torch.Tensor, int], dict[str, torch.Tensor]]


@functools.lru_cache(maxsize=8)
def _all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every value of a 2-byte ``dtype``, in the order of their bits (a table's index). One
    tensor per dtype, made once (a weight's table is made from it; read only)."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)


def _every_value(dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Every value of a 2-byte ``dtype`` once (infinities included, NaNs as zeros), in a
    fixed shuffled order, as rows of ``cols`` (the last row filled from the start again)."""
    values = _all_values(dtype)
    values = values.masked_fill(values.isnan(), 0)
    values = values[torch.randperm(65536, generator=torch.Generator().manual_seed(0))]
    rows = -(-65536 // cols)
    return torch.cat([values, values[: rows * cols - 65536]]).reshape(rows, cols)


def fast_rows(fmt: str, weight_quantizer: torch.nn.Module, weight_dtype: torch.dtype,
              dtype: torch.dtype, cols: int, one: dict[str, torch.Tensor],
              per_row: list[str], modelopt_rows: RowsFn,
              modelopt_scale: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
              total: int = 0) -> RowsFn | None:
    """The compiled core's version of ``modelopt_rows`` (ModelOpt's export of a weight's
    rows: ``(rows, first) -> {output: tensor}``, its per-row outputs ``per_row``) for one
    weight, or None where there is none or it did not give ModelOpt's bytes. ``one`` is
    ModelOpt's export of a few rows of it (the written dtypes and shapes, the global
    scales); ``modelopt_scale``: ModelOpt's ``weight_scale`` of rows without their weight
    (for INT4 AWQ, whose scales come from the calibration); ``total``: the weight's rows."""
    if fmt == "fp8" and set(per_row) == {"weight"} and weight_dtype.itemsize == 2 and \
            one["weight"].dtype == torch.float8_e4m3fn and "weight_scale" in one and \
            one["weight_scale"].numel() == 1:
        fp8 = _Fp8Rows(one["weight_scale"], weight_dtype, dtype)
        if fp8.quotient is not None and _checked(
                ("fp8 divided", weight_dtype, dtype, fp8.quotient), fp8, modelopt_rows,
                weight_dtype, cols, "fp8 division"):
            return fp8
        fn: RowsFn = fp8 if fp8.quotient is None else \
            _Fp8Rows(one["weight_scale"], weight_dtype, dtype, divide=False)
        block = 0
    elif fmt in _NVFP4 and set(per_row) == {"weight", "weight_scale"} and \
            weight_dtype == dtype and weight_dtype in (
            torch.bfloat16, torch.float16, torch.float32) and _dynamic(weight_quantizer) \
            and "weight_scale_2" in one and one["weight_scale_2"].numel() == 1 \
            and one["weight"].dtype == torch.uint8 \
            and one["weight_scale"].dtype == torch.float8_e4m3fn \
            and one["weight"].shape[1] * 2 == cols and one["weight_scale"].dim() == 2 \
            and cols % one["weight_scale"].shape[1] == 0:
        block = cols // one["weight_scale"].shape[1]
        if block % 2:
            return None
        fn = _Nvfp4Rows(float(one["weight_scale_2"].reshape(())), block)
    elif fmt == "int4_awq" and set(per_row) == {"weight", "weight_scale"} and \
            modelopt_scale is not None and total >= 2 and total % 2 == 0 and \
            weight_dtype == dtype and weight_dtype in (
            torch.bfloat16, torch.float16, torch.float32) \
            and one["weight"].dtype == torch.uint8 and one["weight"].shape[1] == cols \
            and one["weight_scale"].dtype == torch.float32 and one["weight_scale"].dim() == 2 \
            and cols % one["weight_scale"].shape[1] == 0:
        block = cols // one["weight_scale"].shape[1]
        fn = _Int4Rows(block, modelopt_scale)
    else:
        return None
    ok = _checked((fmt, weight_dtype, dtype, block), fn, modelopt_rows, weight_dtype, cols,
                  f"{fmt} arithmetic", *((total, 2) if fmt == "int4_awq" else (0, 1)))
    return fn if ok else None


def _checked(key: tuple, fn: RowsFn, modelopt_rows: RowsFn, weight_dtype: torch.dtype,
             cols: int, what: str, most: int = 0, step: int = 1) -> bool:
    """Whether ``fn`` gave ModelOpt's bytes (:func:`_same_bytes`), asked once per process and
    ``key``; a warning where it did not (the caller then takes a slower way)."""
    with _LOCK:
        ok = _CHECKED.get(key)
    if ok is None:
        ok = _same_bytes(fn, modelopt_rows, weight_dtype, cols, most, step)
        if not ok:
            warnings.warn(f"distributed_ext: the compiled {what} differs from ModelOpt's on "
                          f"{weight_dtype} rows here; a slower way that gives its bytes is "
                          "used", RuntimeWarning, stacklevel=3)
        with _LOCK:
            _CHECKED[key] = ok
    return ok


def _dynamic(weight_quantizer: torch.nn.Module) -> bool:
    """Whether ModelOpt computes the NVFP4 block scales from the weight (not from a static
    quantizer's per-block amax)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return not NVFP4QTensor._is_static_quantizer(weight_quantizer)


def _same_bytes(fn: RowsFn, modelopt_rows: RowsFn, dtype: torch.dtype, cols: int,
                most: int = 0, step: int = 1) -> bool:
    """Whether ``fn`` gives ModelOpt's outputs, byte for byte, on rows of every value of
    ``dtype`` (random float32 rows for a 4-byte dtype); so too each output it computes
    alone (``fn.alone``). Where the weight's scales come from its calibration (rows of it
    and no more: ``most``), the rows are asked ``most`` at a time; ``step``: the rows the
    format takes together (the rows are made a multiple of it)."""
    if dtype.itemsize == 2:
        rows = _every_value(dtype, cols)
    else:
        g = torch.Generator().manual_seed(0)
        rows = (torch.randn((-(-65536 // cols), cols), generator=g) *
                torch.logspace(-8, 8, cols).to(torch.float32)).to(dtype)
    if rows.shape[0] % step:
        rows = torch.cat([rows, rows[: step - rows.shape[0] % step]])
    if most and rows.shape[0] > most:
        return all(_same_bytes_of(fn, modelopt_rows, rows[a : a + most])
                   for a in range(0, rows.shape[0], most))
    return _same_bytes_of(fn, modelopt_rows, rows)


def _same_bytes_of(fn: RowsFn, modelopt_rows: RowsFn, rows: torch.Tensor) -> bool:
    ours, theirs = fn(rows, 0), modelopt_rows(rows, 0)
    for name, alone in getattr(fn, "alone", {}).items():  # (each output it computes alone)
        if name not in ours:
            return False
        ours[f"{name} alone"], theirs[f"{name} alone"] = alone(rows, 0), theirs.get(name)
    return all(k in theirs and theirs[k] is not None and v.dtype == theirs[k].dtype
               and v.shape == theirs[k].shape
               and torch.equal(v.view(torch.uint8), theirs[k].view(torch.uint8))
               for k, v in ours.items())


class _Tables:
    """The FP8 tables of the weights last computed (64 KiB each), at most ``count``, the
    least recently used dropped first: a MoE has a weight per expert and projection (thousands
    for a large MoE: over 100 MiB of tables a rank, were each kept for the export),
    and a weight's rows are mostly computed one message after another; a dropped table is
    made again (cheaply). Thread-safe."""

    def __init__(self, count: int) -> None:
        import collections

        self.count = count
        self.tables: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()

    def get(self, key: int) -> torch.Tensor | None:
        with _LOCK:
            table = self.tables.get(key)
            if table is not None:
                self.tables.move_to_end(key)
            return table

    def resize(self, count: int) -> None:
        with _LOCK:
            self.count = count
            self._trim()

    def put(self, key: int, table: torch.Tensor) -> None:
        with _LOCK:
            self.tables[key] = table
            self._trim()

    def _trim(self) -> None:
        """Drops the least recently used tables past ``count`` (the caller holds the lock)."""
        while len(self.tables) > self.count:
            self.tables.popitem(last=False)


# The tables kept where a model's FP8 weights' do not all fit in TABLES_BYTES (a MoE's).
TABLES_LAST = 64
TABLES = _Tables(TABLES_LAST)
# Where a model's FP8 weights' tables fit in this, each is kept (:func:`keep_tables_for`).
TABLES_BYTES = 32 * 2**20
TABLE_BYTES = 65536
_SERIALS = itertools.count()


def keep_tables_for(fns: list[RowsFn | None]) -> None:
    """Bound :data:`TABLES` by what the export of ``fns`` (its weights' compiled rows)
    needs: each FP8 weight's table where they fit in :data:`TABLES_BYTES`, else the last
    :data:`TABLES_LAST`.

    Why: a rank's own rows and its shared blocks walk the weights at once, so with too few
    kept a dense model makes each table several times a call; every weight's, each is made
    once. A MoE walks them expert by expert: keeping many more only adds memory
    (docs/measurements.md)."""
    needed = sum(isinstance(fn, _Fp8Rows) and fn.quotient is None for fn in fns)
    TABLES.resize(needed if needed * TABLE_BYTES <= TABLES_BYTES else TABLES_LAST)


class _Fp8Rows:
    """FP8 per-tensor rows, ``(w / scale).to(float8_e4m3fn)`` as ModelOpt's
    ``to_quantized_weight`` computes them after casting the weight to the export's dtype.

    For bfloat16 weights exported in bfloat16 under a finite positive float32 scale (the
    usual case), by the compiled core's division (:func:`distributed_ext._native.fp8_divide`;
    ``quotient``: whether the quotient is rounded to bfloat16 first, as torch's for a 0-dim
    scale), an infinite or NaN value's byte from ModelOpt's own table of them
    (:func:`_specials`): no table a weight, 1.2-1.6x the lookup's rate. Checked once per process
    (:func:`fast_rows`). Else (``divide`` False, another dtype or scale) by lookup in a table
    of every value of the weight's dtype, made by that function with the weight's scale
    (kept in :data:`TABLES`): ModelOpt's bytes by construction."""

    def __init__(self, scale: torch.Tensor, weight_dtype: torch.dtype, dtype: torch.dtype,
                 divide: bool = True) -> None:
        self.scale, self.weight_dtype, self.dtype = scale, weight_dtype, dtype
        self.serial = next(_SERIALS)  # (this weight's key among the tables)
        self.quotient: bool | None = None
        if divide and weight_dtype == dtype == torch.bfloat16 and scale.numel() == 1 and \
                scale.dtype == torch.float32:
            value = float(scale.reshape(()))
            if 0.0 < value < float("inf"):
                self.quotient, self.value = scale.dim() == 0, value

    def table(self) -> torch.Tensor:
        table = TABLES.get(self.serial)
        if table is None:  # (two threads may both make it: the same table)
            table = _modelopt_table(self.scale, self.weight_dtype, self.dtype)
            TABLES.put(self.serial, table)
        return table

    def _rows(self, src: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        if self.quotient is None:
            return map_through_table(src, self.table(), into)
        return fp8_divide(src, self.value, self.quotient, _specials(self.quotient), into)

    def __call__(self, rows: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
        src = rows.contiguous()  # (itself where it is)
        return {"weight": self._rows(src, None).view(torch.float8_e4m3fn)}

    def rows_into(self, rows: torch.Tensor, first: int,
                  empty: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The weight's rows, computed into ``empty(nbytes)`` (uint8): no temporaries, so
        every row at once (:meth:`Transform.rows_of`)."""
        src = rows.contiguous()  # (itself where it is)
        out = self._rows(src, empty(src.numel()))
        return out.view(torch.float8_e4m3fn).view(src.shape)


def _modelopt_table(scale: torch.Tensor, weight_dtype: torch.dtype, dtype: torch.dtype
                    ) -> torch.Tensor:
    """ModelOpt's FP8 byte of every value of a 2-byte ``weight_dtype`` (uint8, by bits) under
    ``scale``, after the cast to the export's ``dtype``."""
    from modelopt.torch.export.quant_utils import to_quantized_weight

    values = _all_values(weight_dtype).reshape(256, 256)
    made = to_quantized_weight(values.to(dtype), scale, "fp8")
    return made.reshape(-1).view(torch.uint8).contiguous()


@functools.lru_cache(maxsize=2)
def _specials(quotient: bool) -> torch.Tensor:
    """ModelOpt's table of a bfloat16 weight under a 0-dim (``quotient``) or a 1-element
    scale of 1, for :func:`fp8_divide`'s infinite and NaN values: theirs do not depend on a
    finite positive scale (an infinity saturates, a NaN stays one); checked with the rest
    once per process (:func:`fast_rows`)."""
    one = torch.ones((), dtype=torch.float32)
    return _modelopt_table(one if quotient else one.reshape(1), torch.bfloat16,
                           torch.bfloat16)


class _Nvfp4Rows:
    """NVFP4 rows by the compiled core; ``alone``: the block scales without the codes (for
    a scales tensor written before its weight's rows are computed, as where every rank
    writes its own bytes: the scales' short rows go to dst first)."""

    def __init__(self, scale_2: float, block: int) -> None:
        self.scale_2, self.block = scale_2, block
        self.alone = {"weight_scale": self._scales}

    def _scales(self, rows: torch.Tensor, first: int) -> torch.Tensor:
        src = rows.contiguous()  # (itself where it is)
        return nvfp4_scales(src, self.scale_2, self.block).view(torch.float8_e4m3fn)

    def __call__(self, rows: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
        src = rows.contiguous()  # (itself where it is)
        packed, scales = nvfp4_rows(src, self.scale_2, self.block)
        return {"weight": packed, "weight_scale": scales.view(torch.float8_e4m3fn)}


class _Int4Rows:
    """INT4 AWQ rows: ModelOpt's per-group scales of the rows (``scale_of``: from their
    calibrated amax; no weight read), the codes and their packing by the compiled core;
    ``alone``: the scales without the codes."""

    def __init__(self, block: int, scale_of: Callable[[torch.Tensor, int], torch.Tensor]
                 ) -> None:
        self.block, self.scale_of = block, scale_of
        self.alone = {"weight_scale": scale_of}

    def __call__(self, rows: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
        scale = self.scale_of(rows, first)
        if scale.dtype != torch.float32 or scale.dim() != 2:
            raise ValueError(f"ModelOpt's INT4 AWQ scales of rows {first}.. are "
                             f"{scale.dtype} {list(scale.shape)}, not float32 [rows, groups]")
        packed = int4_rows(rows.contiguous(), scale.contiguous(), self.block)
        return {"weight": packed, "weight_scale": scale}
