"""Export every rank's shard of a model as safetensors files, written by rank 0.

Each rank builds the same tiny Hugging Face model from a config (no download), holds its own
shard of the state (every world-th tensor), and rank 0 gathers every rank's shard with
``gather_state_dicts`` -- pickle-free, one rank at a time -- and writes one safetensors file
per rank.

    torchrun --nproc-per-node 2 examples/export_shards.py --out shards/   # NCCL on GPUs
    python examples/export_shards.py --world 2 --out shards/               # local ranks, gloo
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import distributed_ext as dx
from distributed_ext._spawn import run_local


def build_model() -> torch.nn.Module:
    """A tiny Llama, the same on every rank (fixed seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=128)
    return LlamaForCausalLM(config)


def shard_of(state: dict, rank: int, world: int) -> dict:
    """This rank's shard: every world-th entry, starting at its rank."""
    return {k: v for i, (k, v) in enumerate(state.items()) if i % world == rank}


def shard_path(out: str, rank: int, world: int) -> str:
    return os.path.join(out, f"model-{rank + 1:05d}-of-{world:05d}.safetensors")


def export(out: str, rank: int, world: int) -> None:
    from safetensors.torch import save_file

    state = shard_of(build_model().state_dict(), rank, world)
    gathered = dx.gather_state_dicts(state, dst=0)  # collective: every rank calls it
    if rank != 0:
        return
    os.makedirs(out, exist_ok=True)
    for r, shard in enumerate(gathered):
        # safetensors refuses tensors sharing memory: tied weights are written as copies.
        seen: set[int] = set()
        tensors = {}
        for k, t in shard.items():
            ptr = t.untyped_storage().data_ptr()
            tensors[k] = t.clone() if ptr in seen else t.contiguous()
            seen.add(ptr)
        save_file(tensors, shard_path(out, r, world), metadata={"rank": str(r)})
        print(f"rank 0 wrote {shard_path(out, r, world)} ({len(tensors)} tensors)", flush=True)


def _local_rank(out: str) -> None:
    """One local rank (the spawner has set up its gloo group)."""
    export(out, dist.get_rank(), dist.get_world_size())
    dist.barrier()  # tear down together: no rank leaves while a peer still uses the group


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the safetensors files")
    ap.add_argument("--world", type=int, default=2, help="local ranks without a launcher")
    args = ap.parse_args(argv)
    if dx.is_distributed_launch():
        # NCCL on GPUs, gloo on a CPU-only node: distributed_run chooses.
        with dx.distributed_run() as state:
            export(args.out, state.rank, state.world_size)
            dist.barrier()
        return 0
    outcomes = run_local(_local_rank, args.world, args.out, timeout=600,
                         capture_output=False, stop_on_sigint=True)
    failed = [o.describe() for o in outcomes if not o.ok]
    if failed:
        print(f"export_shards: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
