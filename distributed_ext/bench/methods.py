"""What a run measures: the methods of each workload (ours first), the baseline of each,
and one method's figures (:class:`Result`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distributed_ext._timing import Timing

# Methods per workload, ours first; the baseline the ratios are taken against is marked.
METHODS = {
    "bytes": ["distributed_ext", "raw gloo send/recv", "torch gather_object", "first-touch floor"],
    "state-dict": ["distributed_ext", "torch save+gather_object+load"],
    "export": ["distributed_ext", "distributed_ext writers=dst",
               "torch get_model_state_dict+save_pretrained",
               "torch dcp HuggingFaceStorageWriter", "disk write+fsync", "disk O_DIRECT write",
               "disk O_DIRECT write, every rank its share"],
}
# Ours by default (writers="auto": every rank writes its own bytes where all see the
# directory, as local ranks do), and with the single writer.
_ONE_WRITER = "distributed_ext writers=dst"
# The disk's own rates: through the page cache (+ fsync), and direct (what ours does).
_DISK_METHODS = ("disk write+fsync", "disk O_DIRECT write")
# ... and with every rank writing its share of one file at once (what writers="all" can
# reach on this filesystem: one host's ranks share its disk, and a file's writes may be
# serialized by the kernel -- tmpfs takes the file's lock for each write).
_PARALLEL_DISK = "disk O_DIRECT write, every rank its share"
BASELINE = {"bytes": "torch gather_object", "state-dict": "torch save+gather_object+load",
            "export": "torch get_model_state_dict+save_pretrained"}
_TORCH_METHODS = {"torch gather_object", "torch save+gather_object+load",
                  "torch get_model_state_dict+save_pretrained",
                  "torch dcp HuggingFaceStorageWriter"}


def resolve_methods(workload: str, baseline: bool, backend: str = "gloo") -> list[str]:
    """The methods a run measures: ours, and unless ``--no-baseline`` the others."""
    methods = METHODS[workload]
    if not baseline:
        methods = [m for m in methods if m not in _TORCH_METHODS]
    if backend != "gloo":  # raw send/recv of host tensors and the host floor are gloo figures
        methods = [m for m in methods
                   if m in ("distributed_ext", _ONE_WRITER, *_DISK_METHODS, _PARALLEL_DISK,
                            *_TORCH_METHODS)]
    return methods


@dataclass
class Result:
    """One method's figures; every call's seconds are kept (``first`` and ``warm``)."""

    workload: str
    method: str
    world: int
    size: int  # bytes per rank
    received: int  # bytes dst receives from the other ranks per call (the GB/s numerator)
    first: float
    warm: list[float] = field(default_factory=list)
    dst_peak_rss: list[int] = field(default_factory=list)  # per call, first included
    fresh_ranks: bool = True
    # export: per rank, its peak RSS growth over the calls and the bytes it wrote to files
    # and sent in the first call ({"rank", "peak_rss", "written", "sent"})
    per_rank: list[dict] = field(default_factory=list)

    def timing(self) -> Timing:
        return Timing(self.first, list(self.warm))

    @property
    def gbps_first(self) -> float:
        return self.received / self.first / 1e9 if self.first > 0 else 0.0

    @property
    def gbps_warm(self) -> float:
        median = self.timing().median
        return self.received / median / 1e9 if median > 0 else 0.0
