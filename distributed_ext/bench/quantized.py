"""A ModelOpt-quantized FSDP2 model exported from its shards, beside ModelOpt's own export
of it and the disk's write of the same bytes; each rank's peak RSS growth.

ModelOpt's route for an FSDP2 model gathers the full state on rank 0 and exports it there.
Its own FSDP2 code cannot run on gloo (it quantizes the weights in place, then gathers float8
DTensors, which gloo refuses: "Invalid scalar type"), so the baseline runs its route the one
way it runs on CPUs: the model's full state gathered to rank 0 (DCP's ``get_model_state_dict
(full_state_dict, cpu_offload)``, what ModelOpt's own code calls), loaded into an unsharded
copy of the quantized model there, and ModelOpt's ``export_hf_checkpoint`` of that copy (its
per-module processing and ``save_pretrained``). Its files equal ours byte for byte."""

from __future__ import annotations

import os
import shutil
from typing import Any

from distributed_ext._timing import Timing
from distributed_ext.bench.export import _llama_config, _write_direct, _write_shares
from distributed_ext.bench.measure import durable_route, routes_in_fresh_ranks
from distributed_ext.bench.methods import _PARALLEL_DISK
from distributed_ext.bench.resources import (
    PeakRSS,
    RankIO,
    _filesystem,
    _load_text,
    fsync_tree,
)
from distributed_ext.bench.sizes import format_size
from distributed_ext.bench.tp import _durable_lines, _ratio_lines, _route_table

_MODELOPT = "modelopt: full state to rank 0 + export_hf_checkpoint"
QUANTIZED_ROUTES = ("writers=all", "writers=dst", _MODELOPT, "disk O_DIRECT write",
                    _PARALLEL_DISK)
FORMATS = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}


def _moe_config(nbytes: int, experts: int) -> Any:
    """A Qwen3-MoE config of about ``nbytes`` of bf16 parameters: hidden 1024, ``experts``
    experts of intermediate 256 in each layer (8 routed a token), vocab 32000, untied."""
    from transformers import Qwen3MoeConfig

    h, i, v = 1024, 256, 32000
    per_layer = 2 * (2 * h * h + 2 * h * h // 4 + experts * (3 * h * i + h))
    layers = max(1, round((nbytes - 2 * 2 * v * h) / per_layer))
    return Qwen3MoeConfig(vocab_size=v, hidden_size=h, intermediate_size=4 * h,
                          moe_intermediate_size=i, num_experts=experts, num_experts_per_tok=8,
                          num_hidden_layers=layers, num_attention_heads=h // 64,
                          num_key_value_heads=h // 256, head_dim=64, tie_word_embeddings=False)


def _model_class(config: Any) -> Any:
    import transformers

    return getattr(transformers, config.architectures[0])


def build_quantized_model(nbytes: int, fmt: str, experts: int = 0) -> Any:
    """The Llama-shaped model of about ``nbytes`` of bf16 parameters (with ``experts``: a
    Qwen3-MoE of that many experts a layer, :func:`_moe_config`), FSDP2-sharded as it is
    built (on the meta device, materialized as shards: no rank holds the full model), filled
    with values seeded per rank, then quantized by ModelOpt's own ``mtq.quantize`` (format
    ``fmt``: "fp8" or "nvfp4") on one calibration batch, alike on every rank (for a MoE, 1024
    tokens: every expert gets some)."""
    import torch
    import torch.distributed as dist

    import distributed_ext as dx

    if fmt not in FORMATS:
        raise ValueError(f"--quantize {fmt!r}: pass one of {', '.join(FORMATS)}")
    import modelopt.torch.quantization as mtq

    if experts:
        config = _moe_config(nbytes, experts)
        config.architectures = ["Qwen3MoeForCausalLM"]
    else:
        config = _llama_config(2 * nbytes)  # (sized in fp32 bytes: half of them in bf16)
        config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = _model_class(config)(config).to(torch.bfloat16)
    dx.fsdp2_wrap(model)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.02, 0.02, generator=g)
        # (the rotary frequencies were made on the meta device: made again, on the CPU)
        rotary = model.model.rotary_emb
        fresh = type(rotary)(config=config)
        for name, b in rotary.named_buffers():
            b.copy_(getattr(fresh, name))
    batch = torch.randint(0, config.vocab_size, (8, 128) if experts else (2, 32),
                          generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, getattr(mtq, FORMATS[fmt]), lambda m: m(batch))
    return model


def _unsharded_twin(model: Any, fmt: str) -> Any:
    """An unsharded copy of ``model``'s structure with ModelOpt's quantizers, on the meta
    device (no memory until a state is assigned to it)."""
    import modelopt.torch.quantization as mtq
    import torch

    with torch.device("meta"):
        twin = _model_class(model.config)(model.config).to(torch.bfloat16)
    mtq.quantize(twin, getattr(mtq, FORMATS[fmt]), None)
    return twin


def _modelopt_route(model: Any, twin: Any, path: str) -> None:
    """ModelOpt's route (the module docstring): the full state to rank 0, assigned to the
    unsharded ``twin`` there (the calibration's amax set through ModelOpt's own setter), and
    ModelOpt's ``export_hf_checkpoint`` of it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if dist.get_rank() == 0:
        from modelopt.torch.export import export_hf_checkpoint

        loaded = twin.load_state_dict(state, assign=True, strict=False)
        for key in loaded.unexpected_keys:  # (a quantizer's amax: set, not loaded)
            path_, _, _attr = key.rpartition(".")
            twin.get_submodule(path_).amax = state[key]
        rotary = twin.model.rotary_emb  # (a buffer no state holds: made on the CPU)
        twin.model.rotary_emb = type(rotary)(config=twin.config)
        export_hf_checkpoint(twin, dtype=torch.bfloat16, export_dir=path)
    del state


def _quantized_rank(route: str, size: int, fmt: str, base: str, repeat: int,
                    experts: int = 0) -> dict | None:
    """In each fresh rank: :func:`build_quantized_model`, written ``1 + repeat`` times by
    ``route`` (ModelOpt's export consumes the unsharded copy it is given: each of its calls
    gets a new one, made outside the timing); dst's Timing, every rank's peak RSS growth and
    first call's bytes written and sent, on dst."""
    import time

    import torch.distributed as dist

    import distributed_ext as dx

    rank, world = dist.get_rank(), dist.get_world_size()
    out = os.path.join(base, f"dext-q-{os.getppid()}")
    model = build_quantized_model(size, fmt, experts)
    nbytes = 0
    if route.startswith("disk"):  # the disk writes as many bytes as the quantized checkpoint
        probe = f"{out}-size"
        dx.export_hf_checkpoint(model, probe)
        if rank == 0:
            nbytes = sum(e.stat().st_size for e in os.scandir(probe))
            shutil.rmtree(probe, ignore_errors=True)
        nbytes = dx.broadcast(nbytes, src=0)
    times, peaks, moved, flushed = [], [], [], []
    for i in range(1 + repeat):
        twin = _unsharded_twin(model, fmt) if route == _MODELOPT and rank == 0 else None
        path = f"{out}-{i}"
        dist.barrier()
        start = time.perf_counter()
        with PeakRSS() as rss, RankIO() as counted:
            if route.startswith("writers="):
                dx.export_hf_checkpoint(model, path, writers=route.split("=")[1])
            elif route == _MODELOPT:
                _modelopt_route(model, twin, path)
            elif route == _PARALLEL_DISK:
                _write_shares(path, nbytes, rank, world, 0)
            elif rank == 0:
                _write_direct(path, nbytes)
            dist.barrier()
        times.append(time.perf_counter() - start)
        del twin
        peaks.append(rss.added)
        moved.append(counted)
        if rank == 0:
            if route == _MODELOPT:  # (its export returns with its bytes in the page cache)
                flushed.append(fsync_tree(path))
            shutil.rmtree(path, ignore_errors=True)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (moved[0].written, moved[0].sent, max(peaks)))
    if rank != 0:
        return None
    from dataclasses import asdict

    return {"timing": asdict(Timing(times[0], times[1:])), "io": every,
            **({"flushed": flushed} if flushed else {})}


def measure_quantized(world: int, size: int, fmt: str, repeat: int, base: str,
                      experts: int = 0, launches: int = 1) -> list[tuple[str, Timing, list]]:
    """Each route of :data:`QUANTIZED_ROUTES` in fresh local ranks (:func:`_quantized_rank`),
    ``launches`` rounds of them."""
    if fmt not in FORMATS:
        raise ValueError(f"--quantize {fmt!r}: pass one of {', '.join(FORMATS)}")
    return routes_in_fresh_ranks(f"quantized {fmt}", QUANTIZED_ROUTES, _quantized_rank, world,
                                 size, fmt, base, repeat, experts, launches=launches)


def format_quantized(rows: list[tuple[str, Timing, list]], world: int, size: int, fmt: str,
                     base: str, load: tuple[float, float, float], experts: int = 0
                     ) -> list[str]:
    """The table, every rank's peak RSS growth per route, and the targets: ours >= 5x
    ModelOpt's route and >= 0.8x the disk (first call and warm), every rank's peak RSS growth
    <= 128 MiB."""
    shape = (f"a Qwen3-MoE of {experts} experts a layer" if experts else
             "a Llama-shaped model")
    lines = [f"Quantized export ({fmt}, ModelOpt's mtq.quantize): {shape} of "
             f"{format_size(size)} bf16, FSDP2 over world {world} on gloo; the disk rows write "
             f"as many bytes as the quantized checkpoint; writing to {base} "
             f"({_filesystem(base)}); {_load_text(load)}",
             *_route_table([(r, t, [(w, s) for w, s, _p in io]) for r, t, io in rows]),
             "  peak RSS growth per rank (any call): " + "; ".join(
                 f"{r}: " + ", ".join(format_size(p) for _w, _s, p in io) for r, _t, io in rows
                 if not r.startswith("disk") and r != durable_route(_MODELOPT))]
    get = {r: t for r, t, _io in rows}
    ours = get["writers=all"]
    lines += _ratio_lines([
        ("ModelOpt's export / ours", get[_MODELOPT], 5.0),
        ("ours vs the disk's O_DIRECT rate (dst alone)", get["disk O_DIRECT write"], 0.8),
        ("ours vs the disk's O_DIRECT rate, every rank its share", get[_PARALLEL_DISK],
         0.8)], ours)
    lines += _durable_lines(get, "ModelOpt's export", _MODELOPT, ours)
    peak = max(p for r, _t, io in rows if r.startswith("writers=") for _w, _s, p in io)
    lines.append(f"  {'met ' if peak <= 128 * 2**20 else 'MISSED'} every rank's peak RSS "
                 f"growth, ours: at most {format_size(peak)} (target <= 128 MiB)")
    return lines
