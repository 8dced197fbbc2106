"""distributed_ext: torch.distributed made safe and fast for multi-GB checkpoint work.

Importing it loads the compiled core (or fails loudly) and initializes nothing: no CUDA, no
NCCL, no process group.
"""

from distributed_ext._native import build_info
from distributed_ext.collectives import (
    all_reduce,
    allgather,
    allreduce,
    broadcast,
    broadcast_from,
    master_only,
)
from distributed_ext.export import convert_dcp_to_hf, export_hf_checkpoint, gather_full_state
from distributed_ext.fsdp import fsdp2_wrap, is_fsdp2_model
from distributed_ext.gather import gather_bytes
from distributed_ext.groups import DistributedProcessGroup, ParallelState
from distributed_ext.plan import DistributionPlan, distribution_plan, set_distribution_plan
from distributed_ext.runtime import (
    DistributedState,
    abort,
    backend,
    barrier,
    distributed_run,
    is_available,
    is_distributed_launch,
    is_distributed_run,
    is_initialized,
    is_master,
    rank,
    size,
)
from distributed_ext.state_dicts import gather_state_dicts

__version__ = "0.1.0"

__all__ = [
    "DistributedProcessGroup",
    "DistributedState",
    "DistributionPlan",
    "ParallelState",
    "abort",
    "all_reduce",
    "allgather",
    "allreduce",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_from",
    "build_info",
    "convert_dcp_to_hf",
    "distributed_run",
    "distribution_plan",
    "export_hf_checkpoint",
    "fsdp2_wrap",
    "gather_bytes",
    "gather_full_state",
    "gather_state_dicts",
    "is_available",
    "is_distributed_launch",
    "is_distributed_run",
    "is_fsdp2_model",
    "is_initialized",
    "is_master",
    "master_only",
    "rank",
    "set_distribution_plan",
    "size",
]
