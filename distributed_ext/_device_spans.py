"""GPU-resident byte spans to pinned host memory, packed on the device (encoding CUDA states).

The serialization format is host bytes; a state whose tensors live on a GPU crosses here
first: small spans are gathered into a device staging chunk by one kernel launch (not one
copy each) and cross with one D2H copy per chunk into pinned staging from
:mod:`distributed_ext._staging`.
"""

from __future__ import annotations

import torch

from distributed_ext import _native, _staging

__all__ = ["spans_to_host"]

ALIGNMENT = 64


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


_DEVICE_STAGE_BYTES = 256 * 2**20
_PIECE_BYTES = 2**20


def spans_to_host(spans: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[_staging.Lease]]:
    """CUDA byte spans -> views of one pinned host buffer per device, and the leases behind them.

    Small spans are packed on the device by one kernel launch per staging chunk (not one copy
    each), then each chunk crosses with one D2H copy; a span larger than the staging chunk
    crosses on its own. Peak device memory: one staging chunk (256 MiB at most). Host: pinned
    staging of the spans' total size, leased from :mod:`distributed_ext._staging` (reused
    across calls; the caller releases the leases once the host views are no longer read).
    Everything runs on the current stream, after the work that produced the tensors, and is
    synchronized on return. Without the CUDA half of the compiled core, each span is copied
    with ``.to("cpu")`` (no leases).
    """
    if not _native.built_with_cuda():
        return [s.to("cpu") for s in spans], []
    out: dict[int, torch.Tensor] = {}
    leases: list[_staging.Lease] = []
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(spans):
        by_device.setdefault(s.device, []).append(i)
    for device, members in by_device.items():
        with torch.cuda.device(device):
            stager = _DeviceStager(spans, members, device)
            leases.append(stager.lease)
            out.update(stager.run())
    return [out[i] for i in range(len(spans))], leases


class _DeviceStager:
    """Moves ``spans[i]`` for ``i`` in ``members`` (all on ``device``) to pinned host memory."""

    def __init__(self, spans: list[torch.Tensor], members: list[int], device: torch.device):
        self.spans, self.members, self.device = spans, members, device
        self.stream = torch.cuda.current_stream(device)
        self.offsets: dict[int, int] = {}
        total = 0
        for i in members:
            self.offsets[i] = total
            total = _align(total + spans[i].numel())
        self.lease = _staging.acquire(max(total, 1))
        self.host = self.lease.tensor
        self.stage = torch.empty(min(total, _DEVICE_STAGE_BYTES), dtype=torch.uint8,
                                 device=device)
        self.group: list[int] = []

    def run(self) -> dict[int, torch.Tensor]:
        for i in self.members:
            n = self.spans[i].numel()
            if n > self.stage.numel():  # large: crosses on its own, no packing needed
                self.flush()
                _native.copy_async(self.host.data_ptr() + self.offsets[i],
                                   self.spans[i].data_ptr(), n, self.stream.cuda_stream)
                continue
            if self.group and self.offsets[i] + n - self.offsets[self.group[0]] > self.stage.numel():
                self.flush()
            self.group.append(i)
        self.flush()
        self.stream.synchronize()
        return {i: self.host[self.offsets[i] : self.offsets[i] + self.spans[i].numel()]
                for i in self.members}

    def flush(self) -> None:
        if not self.group:
            return
        base = self.offsets[self.group[0]]
        rows = []
        for i in self.group:
            src, n = self.spans[i].data_ptr(), self.spans[i].numel()
            for done in range(0, n, _PIECE_BYTES):
                rows.append((src + done, self.stage.data_ptr() + self.offsets[i] - base + done,
                             min(_PIECE_BYTES, n - done)))
        table = torch.tensor(rows, dtype=torch.int64).to(self.device)
        _native.device_pack_pieces(table, self.stream.cuda_stream)
        last = self.group[-1]
        length = self.offsets[last] + self.spans[last].numel() - base
        _native.copy_async(self.host.data_ptr() + base, self.stage.data_ptr(), length,
                           self.stream.cuda_stream)
        self.stream.synchronize()  # the stage and the table are reused/freed after this
        self.group.clear()
