"""The pinned staging pool's policy (on CPU with a stand-in allocator; pinning needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from distributed_ext import _staging


@pytest.fixture
def pool(monkeypatch):
    pinned = []

    def fake_pin(n):
        t = torch.empty(n, dtype=torch.uint8)
        pinned.append(n)
        return t

    monkeypatch.setattr(_staging, "_pin", fake_pin)
    _staging.release_staging()
    yield pinned
    _staging.release_staging()


def test_one_cached_buffer_reused_and_bounded_by_the_largest_request(pool):
    with _staging.acquire(100) as a:
        assert a.numel() == 100
    assert _staging.cached_bytes() == 100
    with _staging.acquire(60) as b:  # fits: the cached buffer, no new pinning
        assert b.numel() == 60
    assert pool == [100]
    with _staging.acquire(300):  # larger: the small one is freed, a larger one pinned
        assert _staging.cached_bytes() == 0
    assert pool == [100, 300] and _staging.cached_bytes() == 300


def test_concurrent_leases_never_share_memory(pool):
    first = _staging.acquire(64)
    second = _staging.acquire(64)  # the cache is leased: a new buffer
    assert first.tensor.data_ptr() != second.tensor.data_ptr()
    first.release()
    second.release()
    assert _staging.cached_bytes() == 64  # one kept, the other freed
    first.release()  # idempotent


def test_release_staging_frees_the_cache(pool):
    _staging.acquire(128).release()
    assert _staging.cached_bytes() == 128
    _staging.release_staging()
    assert _staging.cached_bytes() == 0


@pytest.mark.cuda
def test_pinned_for_real_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; torch.cuda.is_available() is False here")
    _staging.release_staging()
    with _staging.acquire(2**20) as buf:
        assert buf.is_pinned() and buf.numel() == 2**20
