"""A DCP checkpoint read without loading it (export/files/saved.py, files/torch_items.py,
plan/saved.py): torch.save items located from their zip and their pickle's opcodes, anything
else refused; saved chunks cut into blocks contiguous in their file; chunks that do not tile
a tensor refused naming the key."""

from __future__ import annotations

import io
import math
import os
import random

import pytest
import torch

from distributed_ext.export.files.torch_items import ItemError, locate_tensor
from distributed_ext.export.plan.blocks import Block, _tiles_exactly
from distributed_ext.export.plan.saved import Chunk, SavedTensor, check_against_model, saved_blocks


def _item_file(path, obj, pad: int = 100) -> tuple[int, int]:
    """``obj`` torch.saved at byte ``pad`` of a file (as DCP appends its items)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(b"x" * pad + buf.getvalue() + b"y" * 7)
    return pad, len(buf.getvalue())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_saved_tensors_bytes_are_found_raw_where_torch_put_them(tmp_path, dtype):
    t = (torch.arange(60) % 3).to(dtype).reshape(3, 4, 5)
    start, length = _item_file(tmp_path / "f", t)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        where = locate_tensor(fd, start, length, dtype, (3, 4, 5))
        raw = os.pread(fd, where.nbytes, where.offset)
    finally:
        os.close(fd)
    assert raw == t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("obj, shape, dtype, words", [
    (torch.arange(6.0).reshape(2, 3).t(), (3, 2), torch.float32, "strided view"),
    (torch.arange(6.0)[2:], (4,), torch.float32, "strided view"),
    (torch.arange(6.0), (6,), torch.float64, "metadata says"),
    (torch.arange(6.0), (2, 3), torch.float32, "metadata says"),
    ({"a": torch.arange(6.0)}, (6,), torch.float32, "not one tensor|no tensor.s pickle"),
    ([1, 2, 3], (3,), torch.float32, "not one tensor|no tensor.s pickle"),
])
def test_an_item_that_is_not_one_contiguous_tensor_is_refused_saying_why(tmp_path, obj, shape,
                                                                      dtype, words):
    start, length = _item_file(tmp_path / "f", obj)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(ItemError, match=words):
            locate_tensor(fd, start, length, dtype, shape)
        with pytest.raises(ItemError, match="zip"):  # a window that is not the item
            locate_tensor(fd, start + 1, length - 1, dtype, shape)
    finally:
        os.close(fd)


def test_chunks_are_cut_into_blocks_contiguous_in_their_file_and_within_the_cap():
    rng = random.Random(0)
    for _ in range(300):
        nd = rng.randint(0, 4)
        sizes = tuple(rng.randint(1, 9) for _ in range(nd))
        offsets = tuple(rng.randint(0, 5) for _ in range(nd))
        itemsize = rng.choice([1, 2, 4])
        cap = rng.choice([1, 8, 40, 300, 10**6])
        blocks = saved_blocks(Chunk(offsets, sizes, "f", 0, 0, True), itemsize, cap)
        assert _tiles_exactly([Block(tuple(o - c for o, c in zip(b.offset, offsets)), b.shape)
                               for b in blocks], sizes)
        strides = [math.prod(sizes[d + 1:]) for d in range(nd)]
        for b in blocks:
            assert b.local == b.offset
            first = sum((o - c) * s for o, c, s in zip(b.offset, offsets, strides))
            last = sum((o + n - 1 - c) * s for o, n, c, s in zip(b.offset, b.shape, offsets,
                                                                  strides))
            assert last - first + 1 == b.numel  # one contiguous span of the chunk
            row = math.prod(b.shape[1:]) if b.shape else 1
            assert b.numel * itemsize <= cap or b.numel == row or b.numel == 1, (sizes, b)


def test_chunks_that_leave_a_gap_are_refused_naming_the_key():
    t = SavedTensor("w", torch.float32, (4, 4), [Chunk((0, 0), (2, 4), "f", 0, 32, True),
                                                 Chunk((3, 0), (1, 4), "f", 32, 16, True)])
    with pytest.raises(ValueError, match=r"'model.w'.*do not cover"):
        check_against_model({"w": t}, {"w": torch.empty(4, 4, device="meta")}, "model.")
    with pytest.raises(ValueError, match=r"has no key 'model.v'.*prefix"):
        check_against_model({"w": t}, {"v": torch.empty(4, 4, device="meta")}, "model.")
    with pytest.raises(ValueError, match=r"shape \[4, 4\].*has \[4, 5\]"):
        check_against_model({"w": t}, {"w": torch.empty(4, 5, device="meta")}, "model.")
