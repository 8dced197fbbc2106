"""The compiled core's versions of ModelOpt's row arithmetic (export/plan/row_kernels.py:
FP8, NVFP4, INT4 AWQ), compared byte for byte with ModelOpt's own functions on every value
of bfloat16 and float16 (infinities included; NaN blocks as far as ModelOpt's own bytes are
defined), the fallback
to ModelOpt's where a kernel differs, and a one-process export that takes the compiled
path for every quantized weight and still equals ModelOpt's own export. ModelOpt is
imported only in fresh processes: one for all the comparisons, one for each export."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch
from harness import assert_all_ok, run_ranks

if importlib.util.find_spec("modelopt") is None:
    pytest.skip("needs nvidia-modelopt (the [test] extra)", allow_module_level=True)

import hf_models  # noqa: E402

# Global scales from tiny to large (a real weight's amax / (6 * 448) is about 1e-5).
SCALES_2 = [7.4e-6, 1.3e-4, 3.7e-3, 1.0, 250.0]


def _compare_all() -> dict:
    """Every comparison below in one fresh process (ModelOpt's import is most of a process's
    start: 8-10 s here), each test then asserting its own; the fallback's last (it swaps
    a kernel for a wrong one, then puts it back and forgets what was checked)."""
    return {"nvfp4": _compare_nvfp4_all(), "nvfp4 other blocks": _compare_nvfp4_other_blocks(),
            "fp8": _compare_fp8(), "many fp8 weights": _many_fp8_weights(),
            "int4": _compare_int4(), "fallback": _fallback_where_the_kernel_differs()}


@pytest.fixture(scope="module")
def compared() -> dict:
    return assert_all_ok(run_ranks(_compare_all, 1, init=False, timeout=420))[0]


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[torch.randperm(65536, generator=torch.Generator().manual_seed(3))]


def _modelopt_nvfp4(rows: torch.Tensor, scale_2: torch.Tensor, block: int = 16
                    ) -> dict[str, torch.Tensor]:
    """ModelOpt's two calls for a dynamic NVFP4 weight (as _export_quantized_weight makes)."""
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    scale = NVFP4QTensor.get_weights_scaling_factor(rows, block, scale_2)[0]
    return {"weight": to_quantized_weight(rows, scale, "nvfp4", scale_2, block),
            "weight_scale": scale}


def _compare_nvfp4() -> list[str]:
    warnings.filterwarnings("ignore")
    from distributed_ext._native import nvfp4_rows
    from distributed_ext.export.plan.row_kernels import _Nvfp4Rows

    wrong = []
    for dtype in (torch.bfloat16, torch.float16):
        rows = _every_value(dtype).reshape(-1, 512)
        nan_blocks = rows.reshape(rows.shape[0], -1, 16).isnan().any(-1)
        for s2 in SCALES_2:
            scale_2 = torch.tensor(s2, dtype=torch.float32)
            ref = _modelopt_nvfp4(rows, scale_2)
            packed, scales = nvfp4_rows(rows, float(scale_2), 16)
            # Every block without a NaN: the same bytes; with one: a NaN scale (ModelOpt's
            # sign bit varies with how many rows torch computes at once), the same codes.
            ok = ~nan_blocks
            theirs = ref["weight_scale"].view(torch.uint8)
            if not torch.equal(scales[ok], theirs[ok]):
                wrong.append(f"{dtype} {s2}: block scales")
            if not (torch.all(scales[nan_blocks] == 0x7F) and
                    torch.all(theirs[nan_blocks] & 0x7F == 0x7F)):
                wrong.append(f"{dtype} {s2}: the scale of a block with a NaN")
            if not torch.equal(packed, ref["weight"]):
                wrong.append(f"{dtype} {s2}: codes")
            got = _Nvfp4Rows(float(scale_2), 16)(rows, 0)
            if got["weight_scale"].dtype != ref["weight_scale"].dtype or \
                    got["weight"].dtype != ref["weight"].dtype:
                wrong.append(f"{dtype}: dtypes")
    # float32 rows: random values over sixteen decades.
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(64, 1024, generator=g) * torch.logspace(-8, 8, 1024)
    for s2 in SCALES_2:
        scale_2 = torch.tensor(s2, dtype=torch.float32)
        ref = _modelopt_nvfp4(rows, scale_2)
        packed, scales = nvfp4_rows(rows, float(scale_2), 16)
        if not (torch.equal(packed, ref["weight"]) and
                torch.equal(scales, ref["weight_scale"].view(torch.uint8))):
            wrong.append(f"float32 {s2}")
    return wrong


def _compare_nvfp4_scale_boundaries() -> list[str]:
    # Each block's E4M3 scale is the rounding of amax / (6 * scale_2): with scale_2 = 1/6
    # (a divisor of exactly 1) and float32 rows, the blocks' amax are set to every E4M3
    # value, every midpoint between two and the float32 values either side of it (round
    # half to even), the subnormal scales, the clamp at both ends, zero and the infinities.
    warnings.filterwarnings("ignore")
    from distributed_ext._native import nvfp4_rows, nvfp4_scales

    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    amax = torch.cat([codes, mids, torch.nextafter(mids, torch.tensor(0.0)),
                      torch.nextafter(mids, torch.tensor(1e9)), torch.tensor(
                          [1e-12, 2.0**-12, 2.0**-10, 460.0, 479.9, 480.0, 1e6,
                           float("inf"), 0.0])])
    g = torch.Generator().manual_seed(6)
    blocks = torch.rand(amax.numel(), 16, generator=g) * amax[:, None]
    blocks[:, 0] = amax  # the block's amax
    blocks = blocks[:, torch.randperm(16, generator=g)]  # (not always the first value)
    blocks *= torch.where(torch.rand(blocks.shape, generator=g) < 0.5, -1.0, 1.0)
    # (inf * 0: no NaN wanted here; the infinities kept)
    blocks = torch.nan_to_num(blocks, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    pad = -blocks.shape[0] % 32
    rows = torch.cat([blocks, blocks[:pad]]).reshape(-1, 32 * 16)
    wrong = []
    for s2 in (torch.tensor(1 / 6, dtype=torch.float32), torch.tensor(3.7e-3)):
        ref = _modelopt_nvfp4(rows, s2)
        packed, scales = nvfp4_rows(rows, float(s2), 16)
        if not torch.equal(scales, ref["weight_scale"].view(torch.uint8)):
            wrong.append(f"{float(s2)}: block scales")
        if not torch.equal(packed, ref["weight"]):
            wrong.append(f"{float(s2)}: codes")
        if not torch.equal(nvfp4_scales(rows, float(s2), 16), scales):
            wrong.append(f"{float(s2)}: the scales alone")
    return wrong


def _compare_nvfp4_all() -> list[str]:
    return _compare_nvfp4() + _compare_nvfp4_scale_boundaries()


def test_nvfp4_kernel_equals_modelopts_arithmetic_on_every_value_and_scale_boundary(compared):
    assert compared["nvfp4"] == []


def _compare_nvfp4_other_blocks() -> list[str]:
    # NVFP4's block is 16 (a path compiled for it); any other even block takes the general
    # path: the same arithmetic, compared here with ModelOpt's at 8 and 32.
    warnings.filterwarnings("ignore")
    from distributed_ext._native import nvfp4_rows

    wrong = []
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        rows = (torch.randn(48, 256, generator=g) * torch.logspace(-6, 6, 256)).to(dtype)
        rows[3, 40] = float("inf")
        for block in (8, 32):
            for s2 in SCALES_2:
                scale_2 = torch.tensor(s2, dtype=torch.float32)
                ref = _modelopt_nvfp4(rows, scale_2, block)
                packed, scales = nvfp4_rows(rows, float(scale_2), block)
                if not (torch.equal(packed, ref["weight"]) and
                        torch.equal(scales, ref["weight_scale"].view(torch.uint8))):
                    wrong.append(f"{dtype} block {block} {s2}")
    return wrong


def test_nvfp4_kernel_at_other_block_sizes_equals_modelopts_arithmetic(compared):
    assert compared["nvfp4 other blocks"] == []


def _compare_fp8() -> list[str]:
    warnings.filterwarnings("ignore")
    from modelopt.torch.export.quant_utils import to_quantized_weight

    from distributed_ext.export.plan.row_kernels import _Fp8Rows

    wrong = []
    for dtype in (torch.bfloat16, torch.float16):
        rows = _every_value(dtype).reshape(128, 512)
        for s in (1e-6, 0.02 / 448, 1.0, 3.3e3):
            scale = torch.tensor(s)
            ref = to_quantized_weight(rows, scale, "fp8")
            fn = _Fp8Rows(scale, dtype, dtype)
            # (and into the caller's bytes: every row at once, where they are wanted)
            raw = torch.empty(rows.numel() + 1, dtype=torch.uint8)[1:]
            into = fn.rows_into(rows, 0, lambda n, raw=raw: raw[:n])
            if into.data_ptr() != raw.data_ptr():
                wrong.append(f"{dtype} {s}: not computed into the bytes given")
            for got in (fn(rows, 0)["weight"], fn(rows.t(), 0)["weight"].t(), into):
                if got.dtype != ref.dtype or not torch.equal(got.view(torch.uint8),
                                                             ref.view(torch.uint8)):
                    wrong.append(f"{dtype} {s}")
            # bfloat16 rows by the compiled division (the quotient rounded to bfloat16, as
            # for a 0-dim scale); float16 ones by the table
            if fn.quotient is not (True if dtype == torch.bfloat16 else None):
                wrong.append(f"{dtype} {s}: the path taken: {fn.quotient!r}")
    # The division on every bfloat16 value, for scales over twenty decades and their edges
    # (a NaN quotient of 0 / 0, an overflow to infinity, a subnormal scale), as a 0-dim
    # scale (a bfloat16 quotient) and as a 1-element one (a float32 quotient).
    rows = _every_value(torch.bfloat16).reshape(128, 512)
    g = torch.Generator().manual_seed(7)
    edges = [0.0, float("inf"), 1e-40, 2.0**-9, 448.0, 1e30]
    for s in [*edges, *(10.0 ** (torch.rand(200, generator=g) * 20 - 12)).tolist()]:
        for scale in (torch.tensor(s), torch.tensor([s])):
            ref = to_quantized_weight(rows, scale, "fp8")
            fn = _Fp8Rows(scale, torch.bfloat16, torch.bfloat16)
            got = fn(rows, 0)["weight"]
            if not torch.equal(got.view(torch.uint8), ref.view(torch.uint8)):
                wrong.append(f"bfloat16 {s} {list(scale.shape)}")
            if s not in edges and fn.quotient is not (scale.dim() == 0):
                wrong.append(f"bfloat16 {s} {list(scale.shape)}: the path taken: "
                             f"{fn.quotient!r}")
            if s in (0.0, float("inf")) and fn.quotient is not None:
                wrong.append(f"bfloat16 {s}: divided")
    return wrong


def test_fp8_table_equals_modelopts_arithmetic_on_every_value(compared):
    assert compared["fp8"] == []


def _many_fp8_weights() -> tuple[int, list[str]]:
    # A MoE's many weights: 300 of them computed twice over, in turns; the tables held stay
    # at the bound, and a table made again gives ModelOpt's bytes.
    warnings.filterwarnings("ignore")
    import gc

    from modelopt.torch.export.quant_utils import to_quantized_weight

    from distributed_ext.export.plan import row_kernels

    rows = _every_value(torch.bfloat16)[:4096].reshape(8, 512)
    scales = torch.logspace(-6, 3, 300)
    fns = [row_kernels._Fp8Rows(scales[i], torch.bfloat16, torch.bfloat16, divide=False)
           for i in range(300)]
    wrong = []
    for _ in range(2):
        for i, fn in enumerate(fns):
            ref = to_quantized_weight(rows, scales[i], "fp8")
            if not torch.equal(fn(rows, 0)["weight"].view(torch.uint8), ref.view(torch.uint8)):
                wrong.append(str(i))
    gc.collect()
    held = {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor)
            and t.dtype == torch.uint8 and t.numel() == 65536}
    # (less the division's two tables of the infinite and NaN values, made once a process)
    return len(held) - row_kernels._specials.cache_info().currsize, wrong


def test_fp8_tables_of_many_weights_are_held_at_most_a_bound(compared):
    from distributed_ext.export.plan import row_kernels

    held, wrong = compared["many fp8 weights"]
    assert wrong == []
    assert held <= row_kernels.TABLES.count, held  # (each weight's own: 300)


def test_fp8_tables_are_kept_for_every_weight_where_they_fit_else_for_the_last_64():
    # A dense model's FP8 weights each made once a call; a MoE's thousands not all held.
    from distributed_ext.export.plan import row_kernels

    def fp8(n: int, divide: bool = False) -> list:
        return [row_kernels._Fp8Rows(torch.ones(()), torch.bfloat16, torch.bfloat16, divide)
                for _ in range(n)]

    fits = row_kernels.TABLES_BYTES // row_kernels.TABLE_BYTES
    before = row_kernels.TABLES.count
    try:
        # (a weight computed by the division needs no table)
        row_kernels.keep_tables_for(fp8(300) + [None, lambda rows, first: {}] +
                                    fp8(1000, divide=True))
        assert row_kernels.TABLES.count == 300
        row_kernels.keep_tables_for(fp8(fits))
        assert row_kernels.TABLES.count == fits
        row_kernels.keep_tables_for(fp8(fits + 1))
        assert row_kernels.TABLES.count == 64
        made = fp8(70)
        for fn in made:
            fn.table()
        assert len(row_kernels.TABLES.tables) == 64
        assert list(row_kernels.TABLES.tables) == [fn.serial for fn in made[6:]]  # the last
        row_kernels.TABLES.resize(10)
        assert list(row_kernels.TABLES.tables) == [fn.serial for fn in made[60:]]
    finally:
        row_kernels.TABLES.resize(before)


def _compare_int4() -> list[str]:
    # INT4 AWQ: every value of bfloat16 and float16 (and random float32 over sixteen
    # decades) against ModelOpt's pack_int4_in_uint8, under per-group scales from tiny to
    # large; NaNs as ModelOpt's own arithmetic gives them on this CPU.
    warnings.filterwarnings("ignore")
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    from distributed_ext._native import int4_rows

    wrong = []
    g = torch.Generator().manual_seed(6)
    cases = [_every_value(dtype).reshape(128, 512) for dtype in (torch.bfloat16, torch.float16)]
    cases.append(torch.randn(64, 512, generator=g) * torch.logspace(-8, 8, 512))
    for rows in cases:
        for block in (128, 64):
            scale = torch.logspace(-7, 3, rows.shape[0] * (512 // block)).reshape(
                rows.shape[0], -1)[torch.randperm(rows.shape[0], generator=g)]
            ref = pack_int4_in_uint8(rows, scale, block)
            got = int4_rows(rows, scale.contiguous(), block)
            if got.dtype != ref.dtype or not torch.equal(got, ref):
                wrong.append(f"{rows.dtype} block {block}")
    return wrong


def test_int4_kernel_equals_modelopts_arithmetic_on_every_value(compared):
    assert compared["int4"] == []


def _swapped(name: str, wrong: object, args: tuple) -> tuple:
    """``fast_rows(*args)`` with the kernel ``row_kernels.<name>`` swapped for ``wrong`` (and
    the warnings it gave), then with the real one again (each checked afresh)."""
    from distributed_ext.export.plan import row_kernels

    real = getattr(row_kernels, name)
    row_kernels._CHECKED.clear()
    setattr(row_kernels, name, wrong)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with_wrong = row_kernels.fast_rows(*args)
    finally:
        setattr(row_kernels, name, real)
        row_kernels._CHECKED.clear()
    return with_wrong, [str(w.message) for w in caught], row_kernels.fast_rows(*args)


def _fallback_where_the_kernel_differs() -> tuple:
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.nn import TensorQuantizer

    from distributed_ext.export.plan import row_kernels

    nvfp4, divide = row_kernels.nvfp4_rows, row_kernels.fp8_divide

    def off_by_one(src, scale_2, block):  # a kernel with one wrong code
        packed, scales = nvfp4(src, scale_2, block)
        packed.view(-1)[7] ^= 1
        return packed, scales

    scale_2 = torch.tensor(1e-3)
    one = {"weight": torch.zeros((2, 32), dtype=torch.uint8),
           "weight_scale": torch.zeros((2, 4), dtype=torch.float8_e4m3fn),
           "weight_scale_2": scale_2}
    wrong, said, right = _swapped("nvfp4_rows", off_by_one, (
        "nvfp4", TensorQuantizer(), torch.bfloat16, torch.bfloat16, 64, one,
        ["weight", "weight_scale"], lambda r, _f: _modelopt_nvfp4(r, scale_2)))

    # The FP8 division likewise: where it differs, the weight is looked up in its table.
    def divided_off_by_one(src, scale, quotient, table, into=None):
        out = divide(src, scale, quotient, table, into)
        out.view(-1)[5] ^= 1
        return out

    scale = torch.tensor(1e-3)
    one = {"weight": torch.zeros((2, 64), dtype=torch.float8_e4m3fn), "weight_scale": scale}
    looked_up, said_fp8, divided = _swapped("fp8_divide", divided_off_by_one, (
        "fp8", TensorQuantizer(), torch.bfloat16, torch.bfloat16, 64, one, ["weight"],
        lambda r, _f: {"weight": to_quantized_weight(r, scale, "fp8")}))
    return (wrong is None, said, right is not None, looked_up.quotient, said_fp8,
            divided.quotient)


def test_a_kernel_that_differs_from_modelopt_is_not_used(compared):
    refused, said, used, looked_up, said_fp8, divided = compared["fallback"]
    assert refused and used
    assert any("compiled nvfp4 arithmetic differs from ModelOpt's" in s for s in said), said
    assert looked_up is None and divided is True
    assert any("compiled fp8 division differs from ModelOpt's" in s for s in said_fp8), said_fp8


def _export_alone(base: str, fmt: str) -> tuple[int, int]:
    """ModelOpt's export and ours (one process, no group) of a tiny Llama quantized ``fmt``;
    how many quantized weights took the compiled path, of how many."""
    warnings.filterwarnings("ignore")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    import distributed_ext as dx
    from distributed_ext.export.plan import quantized, row_kernels

    def quantized_llama():
        model = hf_models.build("llama", 0, dtype=torch.bfloat16, hidden_size=256,
                                intermediate_size=512, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)
        model = model.to(torch.bfloat16)
        model.config.architectures = ["LlamaForCausalLM"]
        batch = torch.randint(0, 130, (2, 16), generator=torch.Generator().manual_seed(1))
        mtq.quantize(model, getattr(mtq, fmt), lambda m: m(batch))
        return model

    export_hf_checkpoint(quantized_llama(), dtype=torch.bfloat16,
                         export_dir=os.path.join(base, "ref"))
    made = []
    real = row_kernels.fast_rows

    def counted(*args, **kwargs):
        fn = real(*args, **kwargs)
        made.append(fn is not None)
        return fn

    quantized.fast_rows = counted
    dx.export_hf_checkpoint(quantized_llama(), os.path.join(base, "ours"))
    return sum(made), len(made)


@pytest.mark.parametrize("fmt", ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT4_AWQ_CFG"])
def test_an_export_takes_the_compiled_path_and_equals_modelopts(fmt, tmp_path):
    base = str(tmp_path)
    [(fast, units)] = assert_all_ok(run_ranks(_export_alone, 1, base, fmt, init=False,
                                              timeout=180))
    assert units == 14 and fast == units, (fast, units)  # 7 linears a layer, 2 layers
    ref = hf_models.read_checkpoint(os.path.join(base, "ref"))
    ours = hf_models.read_checkpoint(os.path.join(base, "ours"))
    assert sorted(ours) == sorted(ref)
    differ = [k for k in ref if ref[k].dtype != ours[k].dtype or ref[k].shape != ours[k].shape
              or not torch.equal(ref[k].reshape(-1).view(torch.uint8),
                                 ours[k].reshape(-1).view(torch.uint8))]
    assert not differ, differ
