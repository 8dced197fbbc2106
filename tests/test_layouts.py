"""The layouts users actually hold, written exactly: models loaded by transformers' own
distributed loader (``from_pretrained(..., distributed_config=DistributedConfig(...))``: TP,
TP of a MoE, EP with FSDP, FSDP x TP, HSDP, HSDP x EP) and torch's own 2-D recipe
(``parallelize_module`` Colwise/Rowwise on a tp mesh dim, then ``fully_shard`` over dp, with
and without SequenceParallel norms), on real gloo ranks at world 2, 3 and 4.

Each is compared tensor by tensor (keys, dtypes, shapes, bytes) and by config.json with the
files single-process ``save_pretrained`` writes for the same weights, written by both
writers and by every rank into a RAM filesystem (the files mapped, nothing sent); the
export loads with ``from_pretrained`` to the logits of the reference. Most of these layouts
carry ``_StridedShard`` (FSDP over colwise weights, a packed colwise
``gate_up_proj``, experts under EP then FSDP) and DTensors on sub-meshes.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_ranks

import distributed_ext as dx

pytest.importorskip("transformers", reason="the layouts are transformers' own")
pytest.importorskip("accelerate", reason="transformers' distributed loader needs accelerate")
pytest.importorskip("safetensors", reason="needs safetensors")

from hf_models import build, make_input, read_checkpoint  # noqa: E402
from test_export import _counting_sends  # noqa: E402

# The models saved for the loader: name -> (family, config overrides). Six experts at
# world 3: transformers' loader fails on a rank that gets no expert (4 over 3 ranks).
SOURCES = {"llama": ("llama", {}), "qwen3-moe": ("qwen3-moe", {}),
           "qwen3-moe-6": ("qwen3-moe", {"num_experts": 6})}
# (label, source, DistributedConfig arguments), by world size
LOADED = {
    2: [("tp", "llama", dict(tp_size=2)),
        ("tp-moe", "qwen3-moe", dict(tp_size=2)),
        ("ep-fsdp", "qwen3-moe", dict(ep_size=2, fsdp_size=2))],
    3: [("fsdp", "llama", dict(fsdp_size=3)),
        ("fsdp-moe", "qwen3-moe-6", dict(fsdp_size=3))],
    4: [("fsdp-tp", "llama", dict(fsdp_size=2, tp_size=2)),
        ("fsdp-tp-moe", "qwen3-moe", dict(fsdp_size=2, tp_size=2)),
        ("hsdp", "llama", dict(dp_replicate_size=2, fsdp_size=2)),
        ("hsdp-ep", "qwen3-moe", dict(dp_replicate_size=2, fsdp_size=2, ep_size=2))],
}


def _placements(model) -> set[str]:
    return {str(tuple(p.placements)) for p in model.state_dict().values()
            if hasattr(p, "placements")}


def _export_every_way(model, out: str, ram: str) -> None:
    """Both writers into ``out``; every rank writing into ``ram`` too (a RAM filesystem:
    the files mapped, no byte over the link), moved to ``out``/ram for the comparison."""
    for writers in ("all", "dst"):
        dx.export_hf_checkpoint(model, os.path.join(out, writers), writers=writers)
    sent = _counting_sends(lambda: dx.export_hf_checkpoint(model, ram, writers="all"))
    assert sent == 0, f"rank {dist.get_rank()} sent {sent} bytes writing mapped files"
    if dist.get_rank() == 0:
        shutil.move(ram, os.path.join(out, "ram"))
    dist.barrier()


def _load_and_export(src: str, out: str, ram: str, cases: list):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # what torchrun sets; the loader reads it
    seen = {}
    for label, family, kwargs in cases:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(src, family), distributed_config=DistributedConfig(**kwargs))
        _export_every_way(model, os.path.join(out, label), os.path.join(ram, label))
        hub = dx.gather_full_state(model, hub_keys=True)
        seen[label] = (_placements(model), hub)
        del model
    return seen if dist.get_rank() == 0 else None


def _torch_2d(out: str, ram: str, sequence_parallel: bool):
    """torch's own 2-D recipe (:func:`_torch_2d_model`), written every way."""
    model = _torch_2d_model(sequence_parallel)
    _export_every_way(model, out, os.path.join(ram, "2d"))
    hub = dx.gather_full_state(model, hub_keys=True)
    return (_placements(model), hub) if dist.get_rank() == 0 else None


def _torch_2d_model(sequence_parallel: bool = False):
    """torch's own 2-D recipe on a (dp=2, tp=2) mesh, as torchtitan applies it to a Llama."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("llama")  # the same weights on every rank and in the test
    if sequence_parallel:
        root = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                      output_layouts=Shard(1)),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1),
                                           output_layouts=Replicate())}
    else:
        root = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh["tp"], root)
    for layer in model.model.layers:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        if sequence_parallel:
            plan.update({"input_layernorm": SequenceParallel(),
                         "post_attention_layernorm": SequenceParallel(),
                         "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                         desired_input_layouts=(Replicate(),
                                                                                None)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))})
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _assert_written_as(out: str, reference_dir: str, hub: dict, threads: int | None = None):
    """``out``'s three checkpoints (writers all, dst; all on a RAM filesystem) and ``hub``
    are the reference's tensors, with its config.json, and load to its logits."""
    from transformers import AutoModelForCausalLM

    reference = read_checkpoint(reference_dir)
    for writers in ("all", "dst", "ram"):
        directory = os.path.join(out, writers)
        written = read_checkpoint(directory)
        assert sorted(written) == sorted(reference), writers
        for k, v in reference.items():
            assert written[k].dtype == v.dtype and written[k].shape == v.shape, (writers, k)
            assert torch.equal(written[k], v), (writers, k)
        for name in ("config.json", "generation_config.json"):
            assert json.loads(open(os.path.join(directory, name)).read()) == \
                json.loads(open(os.path.join(reference_dir, name)).read()), (writers, name)
    assert sorted(hub) == sorted(reference)
    for k, v in reference.items():
        assert torch.equal(hub[k], v), ("gather_full_state", k)
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "all"))
    want = AutoModelForCausalLM.from_pretrained(reference_dir)
    with torch.no_grad():
        assert torch.equal(loaded(make_input()).logits, want(make_input()).logits)


@pytest.mark.parametrize("world", sorted(LOADED))
def test_models_loaded_by_transformers_distributed_config_are_written_as_save_pretrained(
        world, tmp_path, ram_path):
    src = tmp_path / "src"
    for _label, family, _kwargs in LOADED[world]:
        if not (src / family).exists():  # the reference artifact itself
            name, overrides = SOURCES[family]
            build(name, **overrides).save_pretrained(src / family)
    out = tmp_path / "out"
    seen = assert_all_ok(run_ranks(_load_and_export, world, str(src), str(out), ram_path,
                                   LOADED[world], timeout=300))[0]
    strided = [label for label, (placements, _hub) in seen.items()
               if any("_StridedShard" in p for p in placements)]
    for label, family, _kwargs in LOADED[world]:
        placements, hub = seen[label]
        _assert_written_as(str(out / label), str(src / family), hub)
    # what the loader builds: _StridedShard where FSDP or EP meets TP or packed experts
    want_strided = {2: ["tp-moe", "ep-fsdp"], 3: [],
                    4: ["fsdp-tp", "fsdp-tp-moe", "hsdp-ep"]}[world]
    assert strided == want_strided, seen.keys()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_2d_recipe_fsdp_over_tp_is_written_as_save_pretrained(sequence_parallel,
                                                                    tmp_path, ram_path):
    reference_dir = tmp_path / "reference"
    build("llama").save_pretrained(reference_dir)
    out = tmp_path / "out"
    placements, hub = assert_all_ok(run_ranks(_torch_2d, 4, str(out), ram_path,
                                              sequence_parallel, timeout=240))[0]
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in placements, placements
    _assert_written_as(str(out), str(reference_dir), hub)
