"""gather_state_dicts: every rank's state to one rank, pickle-free, decoded as views."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from distributed_ext import serialization
from distributed_ext._source import ByteSource
from distributed_ext.gather import DEFAULT_CHUNK_BYTES, gather_source

__all__ = ["gather_state_dicts"]


def _iterate(buffers: list[bytearray | None]) -> Iterator[Any]:
    """Decodes one rank's buffer at a time, dropping this iterator's reference as it goes."""
    for i in range(len(buffers)):
        taken = [buffers[i]]
        buffers[i] = None
        # No local names the buffer or the state: once yielded, only the consumer's state
        # (its tensors view the buffer) keeps the buffer alive.
        yield serialization.decode_state(taken.pop())  # type: ignore[arg-type]


def gather_state_dicts(state: dict, dst: int, group: dist.ProcessGroup | None = None, *,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[dict]:
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
        core into one of two staging chunks, so at most ``2 x chunk_bytes`` extra. CUDA
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
            addition to the spec's signature, keyword-only); the same on every rank.

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

    buffers = gather_source(resolve_source, dst, group, chunk_bytes, "gather_state_dicts")
    holder.clear()
    if buffers is None:
        return iter(())
    return _iterate(list(buffers))
