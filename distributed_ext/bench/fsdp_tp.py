"""FSDP x TP as torch's 2-D recipe builds it, beside transformers' own save of it and
the disk."""

from __future__ import annotations

import os
from typing import Any

from distributed_ext._timing import Timing
from distributed_ext.bench.export import _llama_config, _write_direct, _write_shares
from distributed_ext.bench.measure import _time_routes, routes_in_fresh_ranks
from distributed_ext.bench.methods import _PARALLEL_DISK
from distributed_ext.bench.resources import _filesystem, _load_text
from distributed_ext.bench.sizes import format_size
from distributed_ext.bench.tp import _durable_lines, _ratio_lines, _route_table

_HF_SAVE = "transformers gather_full_state_dict+save_pretrained"
FSDP_TP_ROUTES = ("writers=all", "writers=dst", _HF_SAVE, "disk O_DIRECT write",
                  _PARALLEL_DISK)


def build_fsdp_tp_model(nbytes: int, dp: int, tp: int) -> Any:
    """The Llama-shaped model of :func:`build_export_model` under torch's 2-D recipe, as
    torchtitan applies it: ``parallelize_module`` (Colwise q/k/v/gate/up and lm_head,
    Rowwise o/down and the embedding) on the ``tp`` mesh dim, then ``fully_shard`` of each
    layer and the root over ``dp`` -- so colwise weights, the embedding and lm_head are
    ``(_StridedShard(0, split_factor=tp), Shard(0))``. Built on the meta device and
    materialized as shards (no rank holds the full model), filled with seeded values."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config(nbytes))
    parallelize_module(model, mesh["tp"], {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.02, 0.02, generator=g)
    return model


def _fsdp_tp_rank(route: str, size: int, base: str, repeat: int) -> dict | None:
    """In each fresh rank (world 4: a 2 x 2 mesh): :func:`build_fsdp_tp_model` of ``size``
    bytes, written ``1 + repeat`` times by ``route``; as :func:`_time_routes`."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_fsdp_tp_model(size, world // 2, 2)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the full size

    def baseline(path: str) -> None:
        if route == _HF_SAVE:  # what save_pretrained runs for a model sharded over dp
            from transformers.distributed.utils import gather_full_state_dict

            state = gather_full_state_dict(model)
            if rank == 0:
                model.save_pretrained(path, state_dict=state)
            del state
        elif route == _PARALLEL_DISK:
            _write_shares(path, nbytes, rank, world, 0)
        elif rank == 0:
            _write_direct(path, nbytes)
        dist.barrier()

    return _time_routes(route, model, baseline, os.path.join(base, f"dext-2d-{os.getppid()}"),
                        repeat, cached=route == _HF_SAVE)


def measure_fsdp_tp(world: int, size: int, repeat: int, base: str, launches: int = 1
                    ) -> list[tuple[str, Timing, list]]:
    """Each route of :data:`FSDP_TP_ROUTES` in fresh local ranks (:func:`_fsdp_tp_rank`),
    ``launches`` rounds of them."""
    if world < 4 or world % 2:
        raise ValueError(f"--world {world}: FSDP x TP needs an even world of at least 4 "
                         "(the mesh is world/2 x 2); pass --world 4")
    return routes_in_fresh_ranks("FSDP x TP", FSDP_TP_ROUTES, _fsdp_tp_rank, world, size,
                                 base, repeat, launches=launches)


def format_fsdp_tp(rows: list[tuple[str, Timing, list]], world: int, size: int, base: str,
                   load: tuple[float, float, float]) -> list[str]:
    lines = [f"FSDP x TP (torch's 2-D recipe: parallelize_module on tp, fully_shard over dp; "
             f"colwise weights (_StridedShard(0, 2), Shard(0))): a Llama-shaped model of "
             f"{format_size(size)} fp32, mesh {world // 2} x 2, world {world} on gloo; "
             f"writing to {base} ({_filesystem(base)}); {_load_text(load)}",
             *_route_table(rows)]
    get = {r: t for r, t, _io in rows}
    ours = get["writers=all"]
    lines += _ratio_lines([
        ("transformers' save / ours", get[_HF_SAVE], 5.0),
        ("ours vs the disk's O_DIRECT rate (dst alone)", get["disk O_DIRECT write"], 0.8),
        ("ours vs the disk's O_DIRECT rate, every rank its share", get[_PARALLEL_DISK],
         0.8)], ours)
    lines += _durable_lines(get, "transformers' save", _HF_SAVE, ours)
    one = get["writers=dst"]
    lines.append(f"  writers=dst / writers=all: first call {one.first / ours.first:.2f}x, "
                 f"warm {one.median / ours.median:.2f}x")
    return lines

