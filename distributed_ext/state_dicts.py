"""gather_state_dicts: every rank's state to one rank, pickle-free, decoded as views."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from distributed_ext import _agree, serialization
from distributed_ext._source import ByteSource
from distributed_ext.gather import DEFAULT_CHUNK_BYTES, ProgressCallback, gather_source

__all__ = ["gather_state_dicts"]


def _iterate(buffers: list[bytearray | None]) -> Iterator[Any]:
    """Decodes one rank's buffer at a time, dropping this iterator's reference as it goes."""
    for i in range(len(buffers)):
        taken = [buffers[i]]
        buffers[i] = None
        # No local names the buffer or the state: once yielded, only the consumer's state
        # (its tensors view the buffer) keeps the buffer alive.
        yield serialization.decode_state(taken.pop())  # type: ignore[arg-type]


# On gloo, chunks that straddle tensors are packed on the sender; small chunks keep that
# packing pipelined with the sends (twice as fast as 256 MiB chunks: docs/measurements.md). On NCCL a chunk is
# a device transfer: larger is better.
GLOO_STATE_CHUNK_BYTES = 16 * 2**20


def resolve_state_chunk_bytes(group: dist.ProcessGroup | None) -> int:
    """The default chunk for gather_state_dicts on ``group`` (the same on every rank)."""
    if dist.is_available() and dist.is_initialized() and _agree.group_has_nccl(group):
        return DEFAULT_CHUNK_BYTES
    return GLOO_STATE_CHUNK_BYTES


def gather_state_dicts(state: dict, dst: int, group: dist.ProcessGroup | None = None, *,
                       chunk_bytes: int | None = None,
                       progress: ProgressCallback | None = None) -> Iterator[dict]:
    """Gathers ``state`` from every rank of ``group`` to global rank ``dst``, loaded with ``weights_only``.

    Yields one rank's dict at a time on ``dst`` (in group rank order, to bound host memory)
    and nothing elsewhere. The collective runs eagerly, so every rank must call this before
    iterating.

    Nothing is pickled or unpickled: states travel in the format of
    :mod:`distributed_ext.serialization` (``docs/format.md``), which carries exactly what
    ``torch.load(weights_only=True)`` would accept of a state dict -- plain values and dense
    tensors -- and whose decoder checks every byte it reads. A state the format cannot carry
    (a custom object, a sparse, meta, nested or DTensor tensor) raises TypeError naming the key
    path on the rank that holds it, and a RuntimeError naming that rank everywhere else.

    Memory at peak:
        Senders: no encoded copy of the state. A transport chunk inside one tensor is sent
        from the tensor's own memory; a chunk that straddles tensors is packed by the compiled
        core into one of two staging chunks, so at most ``2 x chunk_bytes`` extra
        (32 MiB on gloo by default). CUDA
        tensors are first copied to host, once per storage.
        ``dst``: every rank's encoded bytes (the gathered bytes, about the states' tensor
        bytes plus small headers) -- the collective is eager -- and nothing more: decoding
        copies no tensor bytes, and a rank's buffer is freed as soon as the consumer drops
        the state it yielded (the states' tensors view it).

    Args:
        state: This rank's state: a dict of tensors and plain values.
        dst: The global rank that receives.
        group: The process group (default: the world); only its members call.
        chunk_bytes: Transport chunk size, as for :func:`~distributed_ext.gather_bytes` (an
            addition to the spec's signature, keyword-only); the same on every rank. None:
            16 MiB on gloo, 256 MiB on NCCL (see :func:`resolve_state_chunk_bytes`).
        progress: As for :func:`~distributed_ext.gather_bytes` (dst only, encoded bytes
            received from the other ranks); keyword-only.

    Returns:
        On ``dst``, an iterator of the states in group rank order; elsewhere an empty one.
    """
    holder: dict[str, Any] = {}

    def resolve_source() -> ByteSource:
        if not isinstance(state, dict):
            raise TypeError(f"gather_state_dicts: state must be a dict, got "
                            f"{type(state).__name__}")
        encoded = serialization.encode_state(state)
        holder["encoded"] = encoded  # keep the segments' owners alive through the transfer
        return encoded.source()

    if chunk_bytes is None:
        chunk_bytes = resolve_state_chunk_bytes(group)
    buffers = gather_source(resolve_source, dst, group, chunk_bytes, "gather_state_dicts",
                            progress)
    holder.clear()
    if buffers is None:
        return iter(())
    return _iterate(list(buffers))
