"""The compiled core: segment pack/unpack against a Python reference, build info, loud import."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from harness import REPO

import distributed_ext
from distributed_ext import _native


def _random_layout(rng: random.Random, n: int, max_len: int) -> tuple[list[bytes], list[int], int]:
    """Random source segments (empty ones included) at random, unaligned, disjoint offsets."""
    sources = [rng.randbytes(rng.choice([0, 0, 1, 3, rng.randrange(max_len + 1)])) for _ in range(n)]
    offsets, pos = [], rng.randrange(7)
    for s in sources:
        pos += rng.randrange(5)  # gaps, so offsets are unaligned and untouched bytes exist
        offsets.append(pos)
        pos += len(s)
    return sources, offsets, pos + rng.randrange(9)


def _tensor_of(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("seed", range(25))
def test_pack_then_unpack_matches_python_reference(seed):
    rng = random.Random(seed)
    sources, offsets, total = _random_layout(rng, rng.randrange(0, 60), rng.choice([16, 300, 70000]))
    fill = rng.randrange(256)
    buffer = torch.full((total,), fill, dtype=torch.uint8)
    src_tensors = [_tensor_of(s) for s in sources]
    _native.pack_segments(
        buffer, [(t.data_ptr(), off, t.numel()) for t, off in zip(src_tensors, offsets)]
    )
    expected = bytearray([fill]) * total
    for s, off in zip(sources, offsets):
        expected[off : off + len(s)] = s
    assert bytes(buffer.tolist()) == bytes(expected)

    outs = [torch.zeros(len(s), dtype=torch.uint8) for s in sources]
    _native.unpack_segments(buffer, [(t.data_ptr(), off, t.numel()) for t, off in zip(outs, offsets)])
    assert [bytes(t.tolist()) for t in outs] == sources


def test_large_segment_crosses_piece_boundaries():
    # 4 MiB pieces: a 9 MiB + 1 segment at an odd offset spans three of them.
    src = torch.randint(0, 256, (9 * 2**20 + 1,), dtype=torch.uint8)
    buffer = torch.zeros(src.numel() + 3, dtype=torch.uint8)
    _native.pack_segments(buffer, [(src.data_ptr(), 3, src.numel())])
    assert torch.equal(buffer[3:], src) and buffer[:3].sum() == 0
    back = torch.empty_like(src)
    _native.unpack_segments(buffer, [(back.data_ptr(), 3, back.numel())])
    assert torch.equal(back, src)


def test_copy_bytes():
    src = torch.randint(0, 256, (5 * 2**20 + 7,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    _native.copy_bytes(dst.data_ptr(), src.data_ptr(), src.numel())
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="negative"):
        _native.copy_bytes(dst.data_ptr(), src.data_ptr(), -1)


@pytest.mark.parametrize(
    "row, match",
    [
        ((1, 8, 4), "outside the buffer"),
        ((1, -1, 2), "outside the buffer"),
        ((1, 0, -3), "negative length"),
        ((0, 0, 4), "null pointer"),
    ],
)
def test_bad_segments_are_value_errors_and_copy_nothing(row, match):
    buffer = torch.zeros(10, dtype=torch.uint8)
    src = torch.ones(16, dtype=torch.uint8)
    ptr, off, n = row
    rows = [(src.data_ptr(), 0, 2), (src.data_ptr() if ptr else 0, off, n)]
    with pytest.raises(ValueError, match=match):
        _native.pack_segments(buffer, rows)
    assert buffer.sum() == 0  # checked before any byte moves


def test_bad_buffers_are_value_errors():
    with pytest.raises(ValueError, match="uint8"):
        _native.pack_segments(torch.zeros(4, dtype=torch.float32), [])
    with pytest.raises(ValueError, match="contiguous"):
        _native.pack_segments(torch.zeros(8, dtype=torch.uint8)[::2], [])


def test_copy_releases_the_gil():
    # While native copies run in a thread, this thread must keep running Python. With the GIL
    # held, it could run only between copies, never while one is in progress.
    src = torch.ones(128 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    reps = 6
    in_copy = threading.Event()
    done = threading.Event()

    def copy() -> None:
        for _ in range(reps):
            in_copy.set()
            _native.copy_bytes(dst.data_ptr(), src.data_ptr(), src.numel())
            in_copy.clear()
        done.set()

    worker = threading.Thread(target=copy)
    during = 0
    worker.start()
    while not done.is_set():
        if in_copy.is_set():
            during += 1
        time.sleep(0.0002)
    worker.join()
    assert torch.equal(dst, src)
    # Measured here: ~500 with the GIL released, ~11 for a copy that holds it (bytes(buf)).
    assert during >= 100, f"only {during} iterations ran while a copy was in progress"


def test_build_info_reports_the_build():
    info = distributed_ext.build_info()
    assert info["torch"] == torch.__version__
    assert info["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert info["with_cuda"] == _native.built_with_cuda() == bool(info["cuda"])
    if not info["with_cuda"]:
        with pytest.raises(RuntimeError, match="built without CUDA"):
            _native.copy_async(1, 1, 1, 0)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=120)


def test_import_initializes_no_cuda_nccl_or_group():
    proc = _run_python(
        """
        import sys
        import torch
        before = set(sys.modules)
        import distributed_ext
        assert distributed_ext._native._C is not None
        assert not torch.cuda.is_initialized(), "CUDA initialized at import"
        assert not torch.distributed.is_initialized(), "process group initialized at import"
        new_nccl = [m for m in set(sys.modules) - before if "nccl" in m.lower()]
        assert not new_nccl, new_nccl
        # The extras' packages are imported only by what needs them.
        extras = [m for m in ("modelopt", "transformers", "safetensors", "accelerate")
                  if m in sys.modules]
        assert not extras, extras
        print("clean")
        """
    )
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


def test_import_fails_loudly_with_built_for_and_installed(tmp_path):
    pkg = tmp_path / "distributed_ext"
    shutil.copytree(os.path.join(REPO, "distributed_ext"), pkg,
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    suffix = [s for s in __import__("importlib.machinery").machinery.EXTENSION_SUFFIXES
              if s.endswith(".so")][0]
    (pkg / f"_C{suffix}").write_bytes(
        b"\x7fELF-not-really" + b"DEXT_BUILD_STAMP{torch=1.99.0+cu999;cuda=99.9;python=3.99}"
    )
    # Load the package from the copy explicitly: an editable install's finder would
    # otherwise pick the real one.
    proc = _run_python(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location(
            "distributed_ext", {str(pkg / "__init__.py")!r},
            submodule_search_locations=[{str(pkg)!r}])
        module = importlib.util.module_from_spec(spec)
        sys.modules["distributed_ext"] = module
        spec.loader.exec_module(module)
        """
    )
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "built for:  torch=1.99.0+cu999;cuda=99.9;python=3.99" in proc.stderr
    assert f"installed:  torch={torch.__version__}" in proc.stderr
    assert "pip install --no-build-isolation" in proc.stderr


def test_table_lookup_maps_every_element_and_refuses_bad_arguments():
    src = torch.arange(-300, 300, dtype=torch.int16).reshape(20, 30)
    table = torch.randint(0, 256, (65536,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    out = _native.map_through_table(src.view(torch.bfloat16), table)
    assert out.shape == src.shape and torch.equal(out, table[src.long() & 0xFFFF])
    with pytest.raises(ValueError, match="2-byte dtype"):
        _native.map_through_table(torch.zeros(4), table)
    with pytest.raises(ValueError, match="65536"):
        _native.map_through_table(src, table[:-1])
    # Into the caller's bytes (any 1-byte dtype, src's numel), and only those.
    raw = torch.zeros(src.numel() + 2, dtype=torch.uint8)
    got = _native.map_through_table(src.view(torch.bfloat16), table, raw[1:-1])
    assert got.data_ptr() == raw[1:].data_ptr()
    assert torch.equal(raw[1:-1], table[src.reshape(-1).long() & 0xFFFF])
    assert raw[0] == 0 and raw[-1] == 0
    with pytest.raises(ValueError, match="into must be a contiguous 1-byte CPU tensor of 600"):
        _native.map_through_table(src, table, raw[:-1])
    with pytest.raises(ValueError, match="into must be"):
        _native.map_through_table(src, table, torch.zeros(600, dtype=torch.int16))


def test_fp8_divide_is_torchs_division_and_cast_and_takes_inf_and_nan_from_the_table():
    # Every bfloat16 value, in a length that is no multiple of a vector or of a block
    # (4096), past the first block; with a table of a marker byte, which only the infinite
    # and NaN values take (their bytes are the caller's: ModelOpt's table's).
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    src = torch.cat([values, values[:4099]])
    special = (src.view(torch.int16).to(torch.int32) & 0x7F80) == 0x7F80
    marker = torch.full((65536,), 0xAB, dtype=torch.uint8)
    for s in (0.02 / 448, 1.0, 3.3e3):
        for scale in (torch.tensor(s), torch.tensor([s])):  # bf16 / float32 quotients
            ref = (src / scale).to(torch.float8_e4m3fn).view(torch.uint8)
            got = _native.fp8_divide(src, s, scale.dim() == 0, marker)
            assert torch.equal(got[~special], ref[~special]), (s, scale.shape)
            assert torch.all(got[special] == 0xAB)
    # Into the caller's bytes, and only those.
    raw = torch.zeros(src.numel() + 2, dtype=torch.uint8)
    got = _native.fp8_divide(src, 1.0, True, marker, raw[1:-1])
    assert got.data_ptr() == raw[1:].data_ptr() and raw[0] == 0 and raw[-1] == 0
    with pytest.raises(ValueError, match="src must be a contiguous bfloat16 CPU tensor"):
        _native.fp8_divide(torch.zeros(4, dtype=torch.float16), 1.0, True, marker)
    with pytest.raises(ValueError, match="65536"):
        _native.fp8_divide(src, 1.0, True, marker[:-1])
    with pytest.raises(ValueError, match="into must be a contiguous 1-byte CPU tensor"):
        _native.fp8_divide(src, 1.0, True, marker, raw[:-3])


def test_nvfp4_rows_refuses_a_block_that_does_not_divide_the_columns():
    with pytest.raises(ValueError, match="block must be even and divide the columns"):
        _native.nvfp4_rows(torch.zeros((2, 24), dtype=torch.bfloat16), 1.0, 16)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        _native.nvfp4_rows(torch.zeros((2, 32), dtype=torch.float64), 1.0, 16)
    packed, scales = _native.nvfp4_rows(torch.zeros((2, 32), dtype=torch.bfloat16), 1.0, 16)
    # zeros: every code 0, every scale 1.0 (ModelOpt's for an all-zero block; E4M3 0x38)
    assert torch.equal(packed, torch.zeros((2, 16), dtype=torch.uint8))
    assert torch.equal(scales, torch.full((2, 2), 0x38, dtype=torch.uint8))
    with pytest.raises(ValueError, match="nvfp4_scales: block must be even"):
        _native.nvfp4_scales(torch.zeros((2, 24), dtype=torch.bfloat16), 1.0, 16)


def test_int4_rows_packs_row_pairs_and_refuses_bad_arguments():
    rows = torch.tensor([[0.5, 1.5, -9.0, 2.4], [-0.5, 7.6, float("inf"), -2.5]])
    scale = torch.tensor([[1.0, 0.5], [1.0, 0.5]])
    # codes: row 0: 0 (half to even), 2, -8 (clamped: 8 in a nibble), 5; row 1: 0, 8 -> 7,
    # inf -> 7, -5 (0xB); row 0 in the low nibble
    want = torch.tensor([[0x00, 0x72, 0x78, 0xB5]], dtype=torch.uint8)
    assert torch.equal(_native.int4_rows(rows, scale, 2), want)
    assert torch.equal(_native.int4_rows(rows.to(torch.bfloat16), scale, 2), want)
    with pytest.raises(ValueError, match="even number of rows"):
        _native.int4_rows(rows[:1], scale[:1], 2)
    with pytest.raises(ValueError, match="block must divide the columns"):
        _native.int4_rows(rows, scale, 3)
    with pytest.raises(ValueError, match=r"scale must be a contiguous float32 CPU tensor of "
                                         r"shape \[2, 2\]"):
        _native.int4_rows(rows, scale.to(torch.bfloat16), 2)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        _native.int4_rows(rows.double(), scale, 2)


def test_nvfp4_scales_alone_equal_those_of_the_rows():
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = (torch.randn(37, 512, generator=g) * torch.logspace(-5, 5, 512)).to(dtype)
        rows[1, 7], rows[2, 100], rows[4, :16] = float("nan"), float("-inf"), 0
        for block in (16, 32):
            for scale_2 in (1e-5, 0.3, 40.0):
                _packed, scales = _native.nvfp4_rows(rows, scale_2, block)
                alone = _native.nvfp4_scales(rows, scale_2, block)
                assert alone.shape == scales.shape and torch.equal(alone, scales), \
                    (dtype, block, scale_2)


def test_huge_buffer_is_a_mapping_of_its_own_aligned_to_a_huge_page():
    # What a direct write reads from it goes to the device in few segments (huge pages are
    # asserted where the kernel grants them: test_direct_io).
    t = _native.huge_buffer(3 * 2**20 + 5)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.numel() == 3 * 2**20 + 5
    assert t.data_ptr() % (2 * 2**20) == 0
    t.fill_(9)
    assert int(t[-1]) == 9 and int(t.sum()) == 9 * t.numel()
    assert _native.huge_buffer(0).numel() == 0
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        _native.huge_buffer(-1)
