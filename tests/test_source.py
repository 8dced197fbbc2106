"""ByteSource: borrowed segments read as one stream; views inside a segment, packs across."""

from __future__ import annotations

import random

import pytest
import torch

from distributed_ext._source import ByteSource, byte_tensor


def _segments(sizes, seed=0):
    rng = random.Random(seed)
    return [torch.tensor(list(rng.randbytes(n)), dtype=torch.uint8) for n in sizes]


def test_view_inside_one_segment_is_zero_copy_and_none_across():
    segs = _segments([10, 0, 5])
    src = ByteSource(segs)
    assert src.nbytes == 15 and len(src.segments) == 2  # the empty one is dropped
    v = src.view(2, 5)
    assert v is not None and v.data_ptr() == segs[0].data_ptr() + 2
    assert src.view(8, 4) is None  # straddles two segments
    assert src.view(10, 5).data_ptr() == segs[2].data_ptr()


@pytest.mark.parametrize("seed", range(10))
def test_pack_matches_the_concatenation(seed):
    rng = random.Random(seed)
    segs = _segments([rng.choice([0, 1, 7, 100, 4096]) for _ in range(6)], seed)
    src = ByteSource(segs)
    whole = torch.cat(segs) if segs else torch.empty(0, dtype=torch.uint8)
    assert bytes(src.to_bytearray()) == bytes(whole.numpy())
    if src.nbytes:
        start = rng.randrange(src.nbytes)
        n = rng.randrange(src.nbytes - start + 1)
        out = torch.empty(n, dtype=torch.uint8)
        src.pack(start, out)
        assert torch.equal(out, whole[start : start + n])


def test_pack_out_of_range_and_bad_segments_raise():
    src = ByteSource(_segments([4]))
    with pytest.raises(ValueError, match="outside 4 bytes"):
        src.pack(2, torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="flat uint8 CPU"):
        ByteSource([torch.zeros(2, 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="flat uint8 CPU"):
        ByteSource([torch.zeros(3)])


def test_byte_tensor_views_the_buffer():
    buf = bytearray(b"abc")
    t = byte_tensor(buf)
    t[0] = ord("z")
    assert buf == bytearray(b"zbc") and byte_tensor(bytearray()).numel() == 0
