"""export_hf_checkpoint and gather_full_state on real gloo ranks (FSDP2 models, DTensors, plain
state dicts), loaded back by safetensors and transformers, and their failure and memory rules."""

from __future__ import annotations

import itertools
import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, read_rss, run_ranks

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export import holdings as export_holdings
from distributed_ext.export import regions as export_regions
from distributed_ext.export import rounds as export_rounds
from distributed_ext.export import sinks as export_sinks
from distributed_ext.export import stager as export_stager

pytest.importorskip("transformers", reason="the export tests build Hugging Face models")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


_COMMON = dict(vocab_size=130, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
_MOE = dict(num_experts_per_tok=2)
# Tiny configs of the families whose experts transformers fuses in memory (or renames), plus
# Llama (no conversion) and a tied Qwen2. Four experts: over 3 ranks FSDP2 gives them 2/2/0.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, **_MOE)),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, **_MOE)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_experts=4, moe_intermediate_size=32, **_MOE)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=4, eos_token_id=1, **_MOE)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, **_MOE)),
    "glm4-moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1, **_MOE)),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(num_local_experts=4,
                                                                     **_MOE)),
    "ernie4.5-moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(
        moe_num_experts=4, moe_intermediate_size=32, moe_k=2)),
}


def build(family: str, seed: int = 0):
    import transformers as tf

    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    return getattr(tf, model_cls)(getattr(tf, config_cls)(**_COMMON, **extra))


def _input():
    return torch.randint(0, 130, (2, 8), generator=torch.Generator().manual_seed(1))


def _outcome(call):
    """``("ok",)``, or ``("raised", type name, message)`` of what ``call()`` raised here."""
    try:
        call()
        return ("ok",)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return ("raised", type(exc).__name__, str(exc))


def _train_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(_input(), labels=_input()).loss.backward()
    opt.step()
    opt.zero_grad()


def _export_fsdp2(family, out, reference_dir, max_shard):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = build(family)
    dx.fsdp2_wrap(model)
    _train_step(model)  # the shards now differ from any freshly built model
    dx.export_hf_checkpoint(model, out, max_shard_size=max_shard)
    with torch.no_grad():
        logits = model(_input()).logits
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    ours = dx.gather_full_state(model)
    hub = dx.gather_full_state(model, hub_keys=True)
    fused = [p for n, p in model.named_parameters() if n.endswith("experts.down_proj")
             or n.endswith("experts.gate_up_proj")]
    experts = dx.all_reduce("experts held", lambda: fused[0].to_local().shape[0], list) \
        if fused else None
    if dist.get_rank() != 0:
        return None
    # The reference artifact: save_pretrained of the same model, unwrapped, with the full state.
    plain = build(family, seed=1)
    plain.load_state_dict(full)
    plain.save_pretrained(reference_dir, max_shard_size=max_shard)
    return (logits, {k: v.clone() for k, v in full.items()}, ours, hub, experts,
            torch.get_num_threads())


def _read_checkpoint(directory):
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("family, world, max_shard", [
    ("llama", 2, "5GB"), ("qwen2-tied", 3, "40KB"), ("mixtral", 3, "5GB"),
    ("qwen2-moe", 2, "60KB"), ("qwen3-moe", 3, 30_000), ("olmoe", 2, "5GB"),
    ("deepseek-v3", 3, "50KB"), ("glm4-moe", 2, "5GB"), ("granitemoe", 3, "5GB"),
    ("ernie4.5-moe", 2, "40KB")])
def test_fsdp2_model_exports_what_save_pretrained_writes_and_loads_with_equal_logits(
        family, world, max_shard, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out, reference_dir = str(tmp_path / "ckpt"), str(tmp_path / "reference")
    values = assert_all_ok(run_ranks(_export_fsdp2, world, family, out, reference_dir,
                                     max_shard, timeout=240))
    logits, full, ours, hub, experts, threads = values[0]
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "config.json" in files and not any(f.endswith(".tmp") for f in files)
    written, reference = _read_checkpoint(out), _read_checkpoint(reference_dir)
    # Keys, shapes, dtypes and bytes: exactly what save_pretrained wrote.
    assert sorted(written) == sorted(reference)
    for k, v in reference.items():
        assert written[k].dtype == v.dtype and written[k].shape == v.shape, k
        assert torch.equal(written[k], v), k
        assert torch.equal(hub[k], v), k  # gather_full_state(hub_keys=True): the same
    # gather_full_state keeps the in-memory keys: a state dict for load_state_dict.
    # Tied weights (Qwen2 here, Ernie 4.5 by default) are written once, as save_pretrained does.
    tied = {"lm_head.weight"} - set(reference)
    assert sorted(ours) == sorted(set(full) - tied)
    for k, v in ours.items():
        assert torch.equal(v, full[k]), k
    if len(shards) > 1:
        index = json.loads((tmp_path / "ckpt" / E.INDEX_NAME).read_text())
        assert set(index["weight_map"].values()) == set(shards)
        assert sorted(index["weight_map"]) == sorted(reference)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                      for t in reference.values())
    for name in shards:
        with safe_open(os.path.join(out, name), "pt") as f:
            keys = list(f.keys())
        data = sum(written[k].numel() * written[k].element_size() for k in keys)
        # At most max_shard_size of tensors per file, unless one tensor alone is larger (as HF).
        assert len(keys) == 1 or data <= E.parse_shard_size(max_shard), (name, data)
    if max_shard != "5GB":
        assert len(shards) > 1  # several files and an index
    if world == 3 and experts is not None:
        assert experts == [2, 2, 0]  # 4 experts over 3 ranks: FSDP2's split of dim 0
    if family == "qwen2-tied":
        assert "lm_head.weight" not in written  # tied: written once, re-tied on load
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # Equal to the bit where computed alike: on as many threads as the rank used (a
    # reduction split over another number of threads rounds otherwise).
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            assert torch.equal(loaded(_input()).logits, logits)
    finally:
        torch.set_num_threads(before)


def _conversions(kind):
    """Conversions a model can carry (from_pretrained records them on the model): a
    transpose of the experts' down_proj (as Qwen3-VL-MoE's), or an interleave (a reshape
    that copies: not a set of blocks)."""
    from transformers.core_model_loading import Interleave, Transpose, WeightConverter

    if kind == "transpose":
        return [WeightConverter("mlp.experts.down_proj", "mlp.experts.down_proj",
                                operations=[Transpose(1, 2)])]
    return [WeightConverter("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj",
                            operations=[Interleave(dim=1)])]


def _export_converted(kind, out, reference_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = build("qwen3-moe")
    model._weight_conversions = _conversions(kind)
    dx.fsdp2_wrap(model)
    _train_step(model)
    try:
        dx.export_hf_checkpoint(model, out, max_shard_size="40KB")
        result = ("ok",)
    except Exception as exc:
        result = ("raised", type(exc).__name__, str(exc))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if dist.get_rank() == 0 and result == ("ok",):
        plain = build("qwen3-moe", seed=1)
        plain._weight_conversions = _conversions(kind)
        plain.load_state_dict(full)
        plain.save_pretrained(reference_dir, max_shard_size="40KB")
    return result, dx.all_reduce("after", lambda: 1, sum)


def test_a_transposing_conversion_streams_transposed_blocks_of_the_shards(tmp_path):
    out, reference_dir = str(tmp_path / "ckpt"), str(tmp_path / "reference")
    values = assert_all_ok(run_ranks(_export_converted, 3, "transpose", out, reference_dir,
                                     timeout=240))
    assert all(v == (("ok",), 3) for v in values), values
    written, reference = _read_checkpoint(out), _read_checkpoint(reference_dir)
    assert sorted(written) == sorted(reference)
    key = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert key not in written  # the transposed fused tensor is written as it is
    assert written["model.layers.0.mlp.experts.down_proj"].shape == (4, 32, 64)
    for k, v in reference.items():
        assert torch.equal(written[k], v), k


def test_a_conversion_that_cannot_stream_is_refused_on_every_rank_before_any_byte(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier file")
    values = assert_all_ok(run_ranks(_export_converted, 2, "interleave", str(out),
                                     str(tmp_path / "reference"), timeout=240))
    for (kind, name, text), after in values:
        assert (kind, name, after) == ("raised", "ValueError", 2)
        assert "'model.layers.0.mlp.experts.gate_up_proj'" in text and "reshape" in text
        assert "gather_full_state" in text and "save_pretrained" in text
    assert sorted(os.listdir(out)) == ["keep.txt"]


def _export_state_dict_with_fused_names(out):
    state = {"model.layers.0.mlp.experts.gate_up_proj": torch.arange(24.0).reshape(2, 4, 3),
             "model.layers.0.mlp.experts.down_proj": torch.ones(2, 3, 2)}
    dx.export_hf_checkpoint(state, out)
    return True


def test_a_state_dict_is_written_with_its_own_keys(tmp_path):
    out = str(tmp_path / "ckpt")
    assert_all_ok(run_ranks(_export_state_dict_with_fused_names, 2, out))
    written = _read_checkpoint(out)
    assert sorted(written) == ["model.layers.0.mlp.experts.down_proj",
                               "model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(written["model.layers.0.mlp.experts.gate_up_proj"],
                       torch.arange(24.0).reshape(2, 4, 3))


def _export_many_small(out, n):
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    state, sources = {}, {}
    for i in range(n):  # 1 KiB per rank each (fp32), some bf16, one uneven
        full = torch.randn(256 * world - (i == 7), generator=g)
        full = full.to(torch.bfloat16) if i % 3 == 0 else full
        local = torch.chunk(full, world)[rank].clone()  # Shard(0)'s own split
        state[f"layers.{i}.w"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                    shape=full.shape, stride=full.stride())
        sources[f"layers.{i}.w"] = full
    dx.export_hf_checkpoint(state, out, max_shard_size="5MB")
    # torch's own assembly of a sample (all n would take ~25 s: one collective per entry)
    for k in list(state)[::250] + ["layers.7.w"]:
        assert torch.equal(state[k].full_tensor(), sources[k]), k
    return sources if rank == 0 else None


def test_many_small_tensors_are_packed_and_land_exactly(tmp_path):
    out = str(tmp_path / "ckpt")
    values = assert_all_ok(run_ranks(_export_many_small, 4, out, 5000, timeout=240))
    reference = values[0]
    written = _read_checkpoint(out)
    assert len(os.listdir(out)) == 4 + 1  # 4 files of <= 5 MB and an index (~17 MB in all)
    assert sorted(written) == sorted(reference)
    for k, v in reference.items():
        assert written[k].dtype == v.dtype and torch.equal(written[k], v), k


def _counting_sends(fn):
    """Runs ``fn()``; the bytes this rank sent (every isend of the export counted)."""
    sent, real_send = [], dist.isend

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real_send(tensor, *args, **kwargs)

    dist.isend = counting
    try:
        fn()
    finally:
        dist.isend = real_send
    return sum(sent)


def _plain_state(out):
    r = dist.get_rank()
    state = {
        "shared.bias": torch.arange(1000, dtype=torch.float32),  # every rank: written once
        f"rank{r}.only": torch.full((300,), float(r), dtype=torch.bfloat16),
        "fp8": torch.linspace(-2, 2, 64).to(torch.float8_e4m3fn),
    }
    return _counting_sends(lambda: dx.export_hf_checkpoint(state, out, writers="dst"))


def test_plain_state_replicas_never_cross_the_link_and_unique_keys_come_from_their_rank(tmp_path):
    out = str(tmp_path / "plain")
    sent = assert_all_ok(run_ranks(_plain_state, 3, out))
    assert sent[0] == 0  # dst sends nothing
    assert sent[1] == sent[2] == 300 * 2  # only its own bf16 key: no replicated bytes
    written = safetensors_torch.load_file(os.path.join(out, E.WEIGHTS_NAME))
    assert torch.equal(written["shared.bias"], torch.arange(1000, dtype=torch.float32))
    for r in range(3):
        assert torch.equal(written[f"rank{r}.only"], torch.full((300,), float(r),
                                                                dtype=torch.bfloat16))
    assert written["fp8"].dtype == torch.float8_e4m3fn
    assert torch.equal(written["fp8"].view(torch.uint8),
                       torch.linspace(-2, 2, 64).to(torch.float8_e4m3fn).view(torch.uint8))


class _ExpertParallel(torch.nn.Module):
    """Dense parameters on every rank; of 4 experts, those of shard ``rank % ep`` only."""

    def __init__(self, rank: int, ep: int) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.arange(64 * 8, dtype=torch.float32).view(64, 8))
        self.norm = torch.nn.Parameter(torch.ones(8))
        self.experts = torch.nn.ModuleDict()
        for e in range(4):
            if e % ep == rank % ep:
                self.experts[str(e)] = torch.nn.Linear(8, 8, bias=False)
                self.experts[str(e)].weight.data.fill_(float(e))


def _export_with_a_plan(out, case):
    r, world = dist.get_rank(), dist.get_world_size()
    model = _ExpertParallel(r, ep=2)
    plan = dx.DistributionPlan(world_size=world, ep_size=2, dense="replicate")
    if case == "other plan on rank 3" and r == 3:
        plan = dx.DistributionPlan(world_size=world, ep_size=1, dense="replicate")
    dx.set_distribution_plan(model, plan)
    if case == "a key only rank 3 holds" and r == 3:
        model.register_buffer("stray", torch.zeros(3))
    try:
        if case == "subgroup":
            group = dist.new_group([0, 1])
            if r < 2:
                dx.export_hf_checkpoint(model, out, group=group)
            first = ("ok", 0)
        else:
            first = ("ok", _counting_sends(
                lambda: dx.export_hf_checkpoint(model, out, writers="dst")))
    except Exception as exc:
        first = ("raised", type(exc).__name__, str(exc))
    return first, dx.all_reduce("after", lambda: 1, sum)


def test_a_recorded_plan_is_followed_replicas_stay_home_and_expert_shards_spread(tmp_path):
    out = str(tmp_path / "ep")
    values = assert_all_ok(run_ranks(_export_with_a_plan, 4, out, "ok", timeout=120))
    sent = [first[1] for first, _after in values]
    expert = 8 * 8 * 4
    # dst holds the dense part and expert shard 0: only shard 1's two experts cross the
    # link, one from each of its two holders (ranks 1 and 3); no dense byte moves.
    assert sent == [0, expert, 0, expert], sent
    written = safetensors_torch.load_file(os.path.join(out, E.WEIGHTS_NAME))
    assert sorted(written) == ["embed", "experts.0.weight", "experts.1.weight",
                               "experts.2.weight", "experts.3.weight", "norm"]
    for e in range(4):
        assert torch.equal(written[f"experts.{e}.weight"], torch.full((8, 8), float(e)))
    assert torch.equal(written["embed"], torch.arange(512, dtype=torch.float32).view(64, 8))


@pytest.mark.parametrize("case, text", [
    ("a key only rank 3 holds", "state['stray'] is held by 1 rank(s) ([3]), but the model "
                                "records DistributionPlan(world_size=4, ep_size=2"),
    ("other plan on rank 3", "the ranks' models record different distribution plans"),
    ("subgroup", "the export's group has 2 rank(s)"),
])
def test_a_model_that_does_not_match_its_plan_is_refused_on_every_rank(case, text, tmp_path):
    out = tmp_path / "ep"
    values = assert_all_ok(run_ranks(_export_with_a_plan, 4, str(out), case, timeout=120))
    exporting = [0, 1] if case == "subgroup" else [0, 1, 2, 3]
    for r in exporting:
        first, after = values[r]
        assert first[:2] == ("raised", "ValueError") and text in first[2], (r, first)
        assert after == 4
    assert not out.exists()


def _dtensors(out, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    if kind == "shard1":
        mesh = init_device_mesh("cpu", (world,))
        state = {"w": distribute_tensor(full, mesh, [Shard(1)]),
                 "r": distribute_tensor(full[0], mesh, [Replicate()])}
    elif kind == "hsdp":  # (Replicate, Shard(0)) on a 2 x 2 mesh
        mesh = init_device_mesh("cpu", (2, world // 2))
        state = {"w": distribute_tensor(full, mesh, [Replicate(), Shard(0)])}
    else:  # FSDP + TP: (Shard(0), Shard(1))
        mesh = init_device_mesh("cpu", (2, world // 2))
        state = {"w": distribute_tensor(full, mesh, [Shard(0), Shard(1)])}
    dx.export_hf_checkpoint(state, out)
    got = dx.gather_full_state(state)
    return None if got is None else {k: v.tolist() for k, v in got.items()}


@pytest.mark.parametrize("kind, world", [("shard1", 3), ("hsdp", 4), ("fsdp_tp", 4)])
def test_dtensor_placements_assemble(kind, world, tmp_path):
    out = str(tmp_path / kind)
    values = assert_all_ok(run_ranks(_dtensors, world, out, kind, timeout=120))
    full = torch.arange(120, dtype=torch.float32).reshape(12, 10)
    written = safetensors_torch.load_file(os.path.join(out, E.WEIGHTS_NAME))
    assert torch.equal(written["w"], full) and values[0]["w"] == full.tolist()
    if kind == "shard1":
        assert torch.equal(written["r"], full[0])


def _bad_entry(out, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    r = dist.get_rank()
    if kind == "shape":
        state = {"w": torch.zeros(4 if r == 0 else 5)}
    elif kind == "dtype":
        state = {"w": torch.zeros(4, dtype=torch.complex128 if r == 1 else torch.float32)}
    elif kind == "strided":  # FSDP over a TP-split dim: rows are not one range per rank
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state = {"w": DTensor.from_local(torch.ones(4, 3), mesh, [_StridedShard(0, split_factor=2)],
                                         run_check=False)}
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state = {"w": DTensor.from_local(torch.ones(3), mesh, [Partial()])}
    return _outcome(lambda: dx.export_hf_checkpoint(state, out))


@pytest.mark.parametrize("kind, own, text", [
    ("shape", "ValueError", "state['w'] differs between ranks (rank 0: float32 (4,); rank 1: "),
    ("dtype", "TypeError", "complex128"),
    ("partial", "ValueError", "Partial placement"),
    ("strided", "ValueError", "state['w'] is a DTensor with placement _StridedShard"),
])
def test_bad_entries_raise_on_every_rank_before_any_byte_moves(kind, own, text, tmp_path):
    out = tmp_path / "bad"
    out.mkdir()
    (out / "keep.txt").write_text("untouched")
    values = assert_all_ok(run_ranks(_bad_entry, 2, str(out), kind))
    for r, v in enumerate(values):
        assert v[0] == "raised", v
        if kind == "dtype" and r == 0:
            assert v[1] == "RuntimeError" and "rank 1 failed with TypeError" in v[2]
        else:
            assert v[1] == own and text in v[2], v
    assert sorted(os.listdir(out)) == ["keep.txt"]  # nothing written, nothing removed


def _disk_fills(out, writers):
    # dst's disk (it writes what arrives), or with writers="all" the disk of the rank that
    # holds the bytes and writes them itself.
    victim = 0 if writers == "dst" else 1
    if dist.get_rank() == victim:
        from distributed_ext import _direct_io

        # The disk fills after the header and a few writes, whichever way they go (one run
        # at a time, or many small runs in one native call).
        calls = []

        def filling(real):
            def write(self, *args):
                calls.append(1)
                if len(calls) > 3:
                    raise OSError(28, "No space left on device")
                real(self, *args)
            return write

        _direct_io.DirectFile.write = filling(_direct_io.DirectFile.write)
        _direct_io.DirectFile.write_segments = filling(_direct_io.DirectFile.write_segments)
    state = {f"w{i}": torch.full((50_000,), float(i)) for i in range(6)} if dist.get_rank() \
        else {}
    return _export_then_use_the_group(state, out, 64 * 1024, writers)


def _export_then_use_the_group(state, out, chunk, writers="auto"):
    """Exports, catching what it raises, then checks the group is usable at once."""
    try:
        dx.export_hf_checkpoint(state, out, chunk_bytes=chunk, writers=writers)
        first = ("ok",)
    except Exception as exc:
        first = ("raised", type(exc).__name__, str(exc))
    return first, dx.all_reduce("after", lambda: 1, sum)


@pytest.mark.parametrize("writers", ["dst", "all"])
def test_a_disk_that_fills_fails_every_rank_and_leaves_the_directory_as_it_was(writers,
                                                                              tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    old = b"an earlier checkpoint"
    (out / "model.safetensors").write_bytes(old)
    values = assert_all_ok(run_ranks(_disk_fills, 2, str(out), writers))
    victim = 0 if writers == "dst" else 1
    assert values[victim][0][:2] == ("raised", "OSError")
    other = values[1 - victim][0]
    assert other[:2] == ("raised", "RuntimeError") and \
        f"rank {victim} failed with OSError" in other[2], other
    assert all(after == 2 for _first, after in values)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == old


def test_stale_shards_of_an_earlier_checkpoint_are_removed(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    for name in ("model-00001-of-00003.safetensors", "model.safetensors.index.json"):
        (out / name).write_text("stale")
    (out / "tokenizer.json").write_text("{}")
    dx.export_hf_checkpoint({"w": torch.ones(3)}, str(out))  # a single process
    assert sorted(os.listdir(out)) == ["model.safetensors", "tokenizer.json"]
    assert torch.equal(safetensors_torch.load_file(str(out / "model.safetensors"))["w"],
                       torch.ones(3))


def test_max_shard_size_and_chunk_are_checked():
    for bad in (0, -1, "lots", "5XB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            E.parse_shard_size(bad)
    assert E.parse_shard_size("5GB") == 5 * 10**9 and E.parse_shard_size("500MiB") == 500 * 2**20


def _rss_growth_during(fn):
    """The peak growth of this process's RSS while ``fn()`` runs (sampled every 5 ms)."""
    import threading

    peak, stop = [read_rss()], threading.Event()

    def sample():
        while not stop.wait(0.005):
            peak.append(read_rss())

    before = read_rss()
    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        stop.set()
        t.join()
    return max(peak) - before


def _peak_during_export(out, nbytes):
    r = dist.get_rank()
    state = {f"layer{i}.{r}": torch.full((nbytes // 4 // 8,), float(i)) for i in range(8)}
    written = []
    real_commit = E.FileSink.commit

    def commit(self):
        written.append((self.direct_bytes, self.total, self.files[0].direct_capable))
        real_commit(self)

    E.FileSink.commit = commit
    grown = _rss_growth_during(lambda: dx.export_hf_checkpoint(state, out, writers="dst"))
    return grown, written


def test_dst_memory_stays_a_few_chunks_whatever_the_model_size(tmp_path):
    size = 192 * 2**20  # per rank; dst receives 384 MiB from the others
    values = assert_all_ok(run_ranks(_peak_during_export, 3, str(tmp_path / "big"), size,
                                     timeout=240))
    grown, ((direct, total, can),) = values[0]
    # dst: two 16 MiB chunks per sender, two 8 MiB bounce buffers, metadata; never the model.
    assert grown < 96 * 2**20, grown / 2**20
    # ... and, where the filesystem takes O_DIRECT, no page cache for the checkpoint either.
    assert direct > 0.99 * total if can else direct == 0, (direct, total)
    assert os.path.getsize(tmp_path / "big" / E.WEIGHTS_NAME) > 3 * size - 2**20


def _peak_during_tp_export(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # 8 x 32 MiB of fp32 Shard(1) rows (each rank's part of a row 2 KiB): 128 MiB a rank
    state = {f"w{i}": distribute_tensor(torch.full((8192, 1024), float(i)), mesh, [Shard(1)])
             for i in range(8)}
    return _rss_growth_during(lambda: dx.export_hf_checkpoint(state, out, writers="all"))


def test_tp_regions_hold_a_few_regions_on_every_rank(tmp_path):
    # Every rank assembles the regions it owns as their rows arrive, in file order: it
    # holds a few 1 MiB regions and one message per peer each way, never its 128 MiB share
    # of the file (bounded at 64 MiB of regions whatever the order).
    out = tmp_path / "tp"
    values = assert_all_ok(run_ranks(_peak_during_tp_export, 2, str(out), timeout=120))
    assert max(values) < 48 * 2**20, [v / 2**20 for v in values]
    got = _read_checkpoint(out)
    assert all(torch.equal(got[f"w{i}"], torch.full((8192, 1024), float(i))) for i in range(8))


def _sender_fails_mid_stream(out):
    r = dist.get_rank()
    if r == 1:
        real, calls = export_stager._piece_tensor, []

        def flaky(state, entry, piece):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("shard 3 is unreadable")
            return real(state, entry, piece)

        export_stager._piece_tensor = flaky
    state = {f"r{r}.w{i}": torch.full((40_000,), float(i)) for i in range(6)}
    return _export_then_use_the_group(state, out, 32 * 1024)


def test_a_rank_failing_mid_transfer_fails_every_rank_and_writes_nothing(tmp_path):
    import time

    out = tmp_path / "ckpt"
    t0 = time.monotonic()
    values = assert_all_ok(run_ranks(_sender_fails_mid_stream, 3, str(out)))
    assert time.monotonic() - t0 < 30
    assert values[1][0] == ("raised", "RuntimeError", "shard 3 is unreadable")
    for r in (0, 2):
        assert values[r][0][:2] == ("raised", "RuntimeError")
        assert "rank 1 failed with RuntimeError: shard 3 is unreadable" in values[r][0][2]
    assert all(after == 3 for _first, after in values)
    assert not out.exists()  # it did not exist before: it does not now


def _export_gpu_shards(path, out):
    from harness import nccl_group_of_one

    from distributed_ext import _staging

    torch.cuda.set_device(0)
    with nccl_group_of_one(path):
        model = build("llama").cuda()
        dx.fsdp2_wrap(model)
        _staging.release_staging()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        # Small chunks: every shard crosses to the host in several pieces.
        dx.export_hf_checkpoint(model, out, chunk_bytes=8192)
        grown = torch.cuda.max_memory_allocated() - before
        with torch.no_grad():
            return model(_input().cuda()).logits.cpu(), grown, _staging.cached_bytes()


@pytest.mark.cuda
def test_export_of_gpu_resident_fsdp2_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "ckpt")
    ((logits, grown, pinned),) = assert_all_ok(run_ranks(
        _export_gpu_shards, 1, str(tmp_path / "s"), out, init=False, timeout=300))
    # No parameter gathered on the GPU (the status rounds' small tensors aside).
    assert grown < 2**20, grown
    assert 0 < pinned <= 2 * (8192 + 2 * 4096), pinned  # two pinned chunks, not a block
    loaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert (loaded(_input()).logits - logits).abs().max().item() < 1e-4


def _export_gpu_state_over_gloo(out, chunk):
    """GPU-resident entries exported over gloo: each crosses to the host chunk by chunk."""
    from distributed_ext import _staging

    r = dist.get_rank()
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(r)
    state = {f"rank{r}.w": torch.rand((1000, 777), device="cuda", generator=g),  # ~3 MiB
             "shared": torch.arange(10_000, device="cuda", dtype=torch.float16)}
    _staging.release_staging()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dx.export_hf_checkpoint(state, out, chunk_bytes=chunk)
    grown = torch.cuda.max_memory_allocated() - before
    return {k: v.cpu() for k, v in state.items()}, grown, _staging.cached_bytes()


@pytest.mark.cuda
def test_gpu_resident_entries_cross_to_the_host_chunk_by_chunk_over_gloo(tmp_path):
    out = str(tmp_path / "ckpt")
    chunk = 256 * 1024
    values = assert_all_ok(run_ranks(_export_gpu_state_over_gloo, 2, out, chunk, timeout=300))
    written = safetensors_torch.load_file(os.path.join(out, E.WEIGHTS_NAME))
    for r, (state, grown, pinned) in enumerate(values):
        assert torch.equal(written[f"rank{r}.w"], state[f"rank{r}.w"])
        assert grown < 2**20, grown  # the 3 MiB entries never copied whole on the GPU
        # Pinned staging: a few chunks (3 slots on a sender, 2 on dst), never a whole block.
        assert 0 < pinned <= 3 * (chunk + 2 * 4096), pinned
    assert torch.equal(written["shared"], values[0][0]["shared"])


def _export_killed_mid_transfer(out, victim, death_file, writers, tp=False):
    import signal
    import time

    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    r = dist.get_rank()

    def die():
        with open(death_file, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    if r == victim:
        calls = []

        def dying(real, at):
            def write(self, data, rows):
                calls.append(1)
                if len(calls) == at:
                    die()
                real(self, data, rows)
            return write

        if tp:  # while writing the TP regions it owns
            E.FileSink.write_edges = dying(E.FileSink.write_edges, 3)
        elif victim == 0:  # dst: while writing (what arrives, or its own long runs)
            E.FileSink.write_batch = dying(E.FileSink.write_batch, 20)
            E.FileSink.write_middles = dying(E.FileSink.write_middles, 20)
        else:  # a sender: on its third shard
            real_local = export_stager._piece_tensor

            def local(state, entry, piece):
                calls.append(1)
                if len(calls) == 3:
                    die()
                return real_local(state, entry, piece)

            export_stager._piece_tensor = local
    state = {f"r{r}.w{i}": torch.full((2 * 2**20,), float(i)) for i in range(6)}  # 8 MiB each
    if tp:  # rows of 2 KiB a rank: 6 x 4.5 MiB in TP regions, a third of them each rank's
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state = {f"w{i}": distribute_tensor(torch.full((768, 1536), float(i)), mesh,
                                            [Shard(1)]) for i in range(6)}
    try:
        dx.export_hf_checkpoint(state, out, chunk_bytes=2**20, writers=writers)
        return ("ok", time.time())
    except BaseException as exc:  # noqa: BLE001
        return ("raised", time.time(), type(exc).__name__, str(exc))


@pytest.mark.parametrize("victim, writers, tp", [
    (1, "dst", False), (0, "dst", False), (1, "auto", False), (0, "auto", False),
    (1, "auto", True),  # while writing the TP regions it owns
])
def test_a_rank_killed_mid_export_is_named_by_every_survivor_within_10_s(victim, writers, tp,
                                                                         tmp_path):
    out = tmp_path / "ckpt"
    death_file = str(tmp_path / "death")
    # The group's own timeout is far away (120 s): only the liveness watch can be this quick.
    res = run_ranks(_export_killed_mid_transfer, 3, str(out), victim, death_file, writers,
                    tp, pg_timeout=120, timeout=100)
    assert res[victim].exit_code == -9, res[victim]
    with open(death_file) as f:
        died = float(f.read())
    for r in {0, 1, 2} - {victim}:
        assert not res[r].timed_out, f"rank {r} hung"
        outcome = res[r].value
        assert outcome[0] == "raised" and outcome[2] == "RuntimeError", outcome
        assert f"rank {victim} " in outcome[3], outcome
        assert outcome[1] - died < 10, (r, outcome[1] - died, outcome)
    # Nothing under a checkpoint's name: dst removed its temporary files, or died with them.
    names = os.listdir(out) if out.exists() else []
    assert not [n for n in names if not n.endswith(".tmp")], names
    if victim != 0:
        assert names == []


@pytest.mark.parametrize("sizes, chunk, expected", [
    ([1024] * 5, 4096, [[1024] * 4, [1024]]),  # small pieces packed, up to a chunk
    ([3 * 2**20, 512, 512], 16 * 2**20, [[3 * 2**20], [512, 512]]),  # over PACK_BYTES: alone
    ([10_000, 100, 0, 100], 4096, [[4096], [4096], [1808], [100, 100]]),  # large: in chunks
    ([0], 4096, []),
])
def test_plan_messages_packs_small_pieces_and_never_plans_an_empty_message(sizes, chunk,
                                                                          expected):
    items = []
    for i, n in enumerate(sizes):
        e = E.Entry(f"k{i}", torch.uint8, (n,))
        p = E.Piece(1, E.Block((0,), (n,)), n, e.key)
        e.pieces.append(p)
        items.append((e, p))
    messages = E.plan_messages(items, chunk)
    assert [[seg[3] for seg in m] for m in messages] == expected
    assert all(m for m in messages)
    # Every byte of every piece exactly once, in order.
    flat = [(seg[0].key, seg[2], seg[3]) for m in messages for seg in m]
    for key in {k for k, _s, _n in flat}:
        spans = [(s, n) for k, s, n in flat if k == key]
        assert [s for s, _n in spans] == list(itertools.accumulate(
            [0] + [n for _s, n in spans[:-1]]))


# -- hostile conditions: every argument, allocation and the commit agreed; publishing atomic --


def _state_of(r, n=4, numel=3000):
    return {f"r{r}.w{i}": torch.full((numel,), float(10 * r + i)) for i in range(n)}


def _export_with_args(out, per_rank):
    import time

    r = dist.get_rank()
    kwargs = per_rank.get(r, {})
    directory = kwargs.pop("directory", out)
    start = time.monotonic()
    try:
        dx.export_hf_checkpoint(_state_of(r), directory, **kwargs)
        return ("ok", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001
        return ("raised", time.monotonic() - start, type(exc).__name__, str(exc))


@pytest.mark.parametrize("name, per_rank", [
    ("dst", {1: {"dst": 1}}),
    ("chunk_bytes", {1: {"chunk_bytes": 4096}}),
    ("max_shard_size", {0: {"max_shard_size": "10KB"}}),
    ("directory", {1: {"directory": "/tmp/somewhere-else"}}),
])
def test_arguments_that_differ_between_ranks_are_refused_on_every_rank(name, per_rank, tmp_path):
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_export_with_args, 3, str(out), per_rank, pg_timeout=120))
    for v in values:
        assert v[0] == "raised" and v[2] == "ValueError", v
        assert f"{name} differs between ranks" in v[3], v
        assert v[1] < 20, v  # promptly: no rank waited for messages that never come
    assert not out.exists()


def _hook_raises_on_one_rank(out):
    import transformers as tf

    model = tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON))
    if dist.get_rank() == 1:
        def hook(module, state_dict, prefix, local_metadata):
            raise RuntimeError("a state-dict hook failed on this rank")

        model._register_state_dict_hook(hook)
    return _outcome(lambda: dx.export_hf_checkpoint(model, out))


def test_a_state_dict_hook_raising_on_one_rank_fails_every_rank(tmp_path):
    values = assert_all_ok(run_ranks(_hook_raises_on_one_rank, 2, str(tmp_path / "c"),
                                     pg_timeout=120, timeout=120))
    assert values[1][:2] == ("raised", "RuntimeError") and "state-dict hook" in values[1][2]
    assert values[0][0] == "raised" and "rank 1 failed with RuntimeError" in values[0][2], values
    assert not (tmp_path / "c").exists()


def _write_earlier(out):
    """An earlier checkpoint of two shards and a tokenizer file the user keeps there."""
    state = {f"old.w{i}": torch.full((3000,), -1.0 - i) for i in range(4)}
    os.makedirs(out, exist_ok=True)
    dx.export_hf_checkpoint(state, out, max_shard_size="20KB")
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("{}")


def _snapshot(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def _failing_step(out, where):
    r = dist.get_rank()
    if r == 0:
        if where == "allocation":
            def fail(*args, **kwargs):
                raise MemoryError("cannot allocate the receive buffers")

            export_rounds._prepare_transfer = fail
        elif where == "rename":
            from distributed_ext import _native

            def exchange(a, b):
                raise OSError(5, "Input/output error", a)

            _native.exchange_paths = exchange
    state = _state_of(r)
    model = None
    if where == "config":
        import transformers as tf

        model = tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON))
        model.config.quantizer = object()  # what quantization tools attach: not JSON
        state = model
    return _outcome(lambda: dx.export_hf_checkpoint(state, out, max_shard_size="20KB"))


@pytest.mark.parametrize("where, text", [
    ("allocation", "cannot allocate the receive buffers"),
    ("config", "model.config does not serialize to JSON"),
    ("rename", "Input/output error"),
])
def test_a_failure_on_dst_before_or_in_the_commit_fails_every_rank_and_keeps_the_earlier(
        where, text, tmp_path):
    out = str(tmp_path / "ckpt")
    _write_earlier(out)
    before = _snapshot(out)
    values = assert_all_ok(run_ranks(_failing_step, 3, out, where, pg_timeout=120, timeout=120))
    assert values[0][0] == "raised" and text in values[0][2], values[0]
    for v in values[1:]:
        assert v[0] == "raised" and v[1] == "RuntimeError", v
        assert "rank 0 failed with" in v[2] and text in v[2], v
    assert _snapshot(out) == before  # the earlier checkpoint, byte for byte
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"]  # no stage left


def _killed_in_commit(out, when):
    import signal

    from distributed_ext import _native

    r = dist.get_rank()
    if r == 0:
        real_exchange, real_replace = _native.exchange_paths, os.replace

        def die():
            os.kill(os.getpid(), signal.SIGKILL)

        if when == "before-swap":
            _native.exchange_paths = lambda a, b: die()
        elif when == "after-swap":
            def exchange(a, b):
                real_exchange(a, b)
                die()

            _native.exchange_paths = exchange
        else:  # no swap on this filesystem: the ordered fallback, killed after one rename
            _native.exchange_paths = lambda a, b: False
            calls = []

            def replace(a, b):
                real_replace(a, b)
                calls.append(1)
                if len(calls) == 1:
                    die()

            os.replace = replace
    return _outcome(lambda: dx.export_hf_checkpoint(_state_of(r), out, max_shard_size="20KB"))


@pytest.mark.parametrize("when", ["before-swap", "after-swap", "fallback-mid-renames"])
def test_dst_killed_in_the_commit_leaves_the_earlier_or_the_new_checkpoint_never_a_mix(
        when, tmp_path):
    out = str(tmp_path / "ckpt")
    _write_earlier(out)
    before = _snapshot(out)
    res = run_ranks(_killed_in_commit, 2, out, when, pg_timeout=120, timeout=120)
    assert res[0].exit_code == -9, res[0]
    assert res[1].value[0] == "raised" and "rank 0" in res[1].value[2], res[1]
    names = sorted(os.listdir(out))
    if when == "before-swap":
        assert _snapshot(out) == before
    elif when == "after-swap":
        # The new checkpoint, whole, and the file the user kept there.
        index = json.load(open(os.path.join(out, E.INDEX_NAME)))
        assert sorted(index["weight_map"]) == sorted(f"r{r}.w{i}" for r in range(2)
                                                    for i in range(4))
        got = _read_checkpoint(out)
        for r in range(2):
            for i in range(4):
                assert torch.equal(got[f"r{r}.w{i}"], torch.full((3000,), float(10 * r + i)))
        assert "tokenizer.json" in names
    else:
        # Partial: the entry points are gone, so no loader reads a mix (it fails loudly).
        assert E.INDEX_NAME not in names and E.WEIGHTS_NAME not in names, names
    # A later export removes what the killed one left (its stage) and publishes whole.
    assert_all_ok(run_ranks(_export_with_args, 2, out, {}))
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"], os.listdir(tmp_path)
    assert "tokenizer.json" in os.listdir(out)
    got = _read_checkpoint(out)
    assert sorted(got) == sorted(f"r{r}.w{i}" for r in range(2) for i in range(4))


def test_stale_temporary_files_of_a_crashed_export_are_removed(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    legacy = out / f".model.safetensors.{'a' * 32}.tmp"  # an older version's temp file
    legacy.write_bytes(b"x" * 1000)
    stage = tmp_path / ".ckpt.dext-export-0123"
    stage.mkdir()
    (stage / "model.safetensors").write_bytes(b"x" * 1000)
    assert_all_ok(run_ranks(_export_with_args, 2, str(out), {}))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert sorted(os.listdir(out)) == [E.WEIGHTS_NAME]


def _no_group_under_a_launch(out):
    return _outcome(lambda: dx.export_hf_checkpoint({"w": torch.ones(3)}, out))


def test_a_launch_without_a_process_group_is_refused(tmp_path):
    out = str(tmp_path / "ckpt")
    values = assert_all_ok(run_ranks(_no_group_under_a_launch, 2, out, init=False,
                                     env={"WORLD_SIZE": "2"}))
    for v in values:
        assert v[:2] == ("raised", "RuntimeError") and "process group is not set up" in v[2], v
    assert not os.path.exists(out)


def _many_files_few_descriptors(out, n):
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    r = dist.get_rank()
    state = {f"r{r}.w{i:05d}": torch.full((1000,), float(i)) for i in range(n)}
    dx.export_hf_checkpoint(state, out, max_shard_size=4500)  # one tensor per file
    return True


def test_thousands_of_shard_files_need_few_descriptors(tmp_path):
    out = str(tmp_path / "ckpt")
    n = 700  # per rank: 1400 files, each two descriptors while open, under a limit of 256
    assert_all_ok(run_ranks(_many_files_few_descriptors, 2, out, n, timeout=300))
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(files) == 2 * n
    index = json.load(open(os.path.join(out, E.INDEX_NAME)))
    for key in ["r0.w00000", "r1.w00699", "r0.w00350"]:
        with safetensors_torch.safe_open(os.path.join(out, index["weight_map"][key]), "pt") as f:
            assert torch.equal(f.get_tensor(key), torch.full((1000,), float(int(key[-5:]))))


def _bad_key(out, kind):
    r = dist.get_rank()
    state = {f"r{r}": torch.ones(3)}
    if kind == "metadata":
        state["__metadata__"] = torch.ones(2)
    elif kind == "surrogate":
        state["w\udc80"] = torch.ones(2)
    else:  # a lazily conjugated view: its memory is not what it reads as
        state["c"] = torch.ones(2, dtype=torch.complex64).mul(1 + 1j).conj()
    return _outcome(lambda: dx.export_hf_checkpoint(state, out))


@pytest.mark.parametrize("kind, text", [
    ("metadata", "reserves this key"),
    ("surrogate", "not valid UTF-8"),
    ("conj", "lazily conjugated view"),
])
def test_keys_and_views_safetensors_cannot_hold_are_refused_on_every_rank(kind, text, tmp_path):
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_bad_key, 2, str(out), kind))
    for v in values:
        assert v[0] == "raised" and text in v[2], v
    assert not out.exists()


@pytest.mark.parametrize("blocks, shape, exact", [
    ([((0,), (6,)), ((6,), (4,))], (10,), True),
    ([((0,), (6,)), ((4,), (4,))], (10,), False),  # the counts add up (10), yet overlap
    ([((0, 0), (2, 3)), ((2, 0), (2, 3)), ((0, 3), (4, 3))], (4, 6), True),  # not a grid
    ([((0, 0), (2, 3)), ((1, 0), (2, 3)), ((0, 3), (4, 3))], (5, 6), False),
    ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], (4, 4), True),
    ([((0,), (5,)), ((6,), (5,))], (10,), False),  # outside the tensor
])
def test_blocks_must_tile_the_tensor_exactly(blocks, shape, exact):
    assert E._tiles_exactly([E.Block(o, s) for o, s in blocks], shape) is exact


def test_runs_are_arithmetic_and_every_segment_maps_to_the_right_bytes():
    import random
    import tracemalloc

    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        offset = tuple(rng.randint(0, s - 1) for s in shape)
        size = tuple(rng.randint(1, s - o) for s, o in zip(shape, offset))
        itemsize = rng.choice([1, 2, 4])
        block = E.Block(offset, size)
        runs = E.block_runs(block, shape, itemsize)
        # The reference: the block's elements in its row-major order, by torch's indexing.
        want = torch.arange(math.prod(shape)).reshape(shape)[
            tuple(slice(o, o + n) for o, n in zip(offset, size))].reshape(-1)
        nbytes = block.numel * itemsize
        cuts = sorted(rng.sample(range(1, nbytes), min(3, nbytes - 1))) + [nbytes]
        seen, start = [], 0
        for cut in cuts:  # as messages split it
            for where, at, m in runs.pieces(start, cut - start, start):
                seen += [(at + k, where + k) for k in range(m)]
            # ... and as a table (the same rows, computed with tensors)
            assert runs.table(start, cut - start, start + 7).tolist() == \
                [[w, a + 7, m] for w, a, m in runs.pieces(start, cut - start, start)]
            start = cut
        assert sorted(a for a, _w in seen) == list(range(nbytes))
        for at, where in seen:
            assert where // itemsize == want[at // itemsize] and where % itemsize == at % itemsize
    # An expert-TP block of 65536 runs is a few integers, not a list of them.
    tracemalloc.start()
    runs = E.block_runs(E.Block((0, 0, 512), (64, 1024, 512)), (64, 1024, 2048), 2)
    _current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(runs) == 65536 and peak < 16 * 1024, peak


def _short_runs_export(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    # Shard(1) of 2048 columns over 4 ranks: every row's run is 2 KiB (under a 4 KiB block).
    state = {f"w{i}": distribute_tensor(torch.randn(2048, 2048, generator=g), mesh, [Shard(1)])
             for i in range(4)}
    written = []
    real_commit = E.FileSink.commit

    def commit(self):
        real_commit(self)
        written.append((self.direct_bytes, self.total, self.files[0].direct_capable))

    E.FileSink.commit = commit
    dx.export_hf_checkpoint(state, out, writers="dst")
    return written, {k: v.full_tensor() for k, v in state.items()}


def test_short_runs_of_a_shard1_layout_are_assembled_and_written_direct(tmp_path):
    out = str(tmp_path / "ckpt")
    values = assert_all_ok(run_ranks(_short_runs_export, 4, out, timeout=240))
    ((direct, total, can),), full = values[0]
    assert direct > 0.99 * total if can else direct == 0, (direct, total, can)
    got = safetensors_torch.load_file(os.path.join(out, E.WEIGHTS_NAME))
    for key, tensor in full.items():
        assert torch.equal(got[key], tensor), key


def _interrupted_on_dst(out, where):
    import signal

    r = dist.get_rank()
    if r == 0:
        def interrupt():
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: lands in dst's main thread

        if where == "transfer":
            real_write, calls = E.FileSink.write_batch, []

            def write(self, data, rows):
                calls.append(1)
                if len(calls) == 2:
                    interrupt()
                real_write(self, data, rows)

            E.FileSink.write_batch = write
        elif where == "commit-start":
            real_commit, calls = E.FileSink.commit, []

            def commit(self):
                calls.append(1)
                if len(calls) == 1:
                    interrupt()
                real_commit(self)

            E.FileSink.commit = commit
        else:  # in the commit's fsyncs
            real_fsync, calls = export_sinks._fsync_path, []

            def fsync(path, directory=False):
                calls.append(1)
                if len(calls) == 1:
                    interrupt()
                real_fsync(path, directory)

            export_sinks._fsync_path = fsync
    outcomes = []
    for i in range(3):  # the group stays in step: the same round on every rank each time
        try:
            # (writers="dst": the patch counts dst's writes of what arrives)
            dx.export_hf_checkpoint(_state_of(r), out, max_shard_size="20KB",
                                    writers="dst" if where == "transfer" else "auto")
            outcome = ("ok",)
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included
            outcome = ("raised", type(exc).__name__, str(exc))
        outcomes.append((outcome, dx.all_reduce(f"after {i}", lambda: 1, sum),
                         _snapshot(out) if r == 0 and i == 0 else None))
    return outcomes


@pytest.mark.parametrize("where", ["transfer", "commit-start", "commit-fsync"])
def test_ctrl_c_on_dst_in_the_transfer_or_the_commit_fails_every_rank_alike(where, tmp_path):
    out = str(tmp_path / "ckpt")
    _write_earlier(out)
    before = _snapshot(out)
    values = assert_all_ok(run_ranks(_interrupted_on_dst, 3, out, where, pg_timeout=120,
                                     timeout=120))
    for r, outcomes in enumerate(values):
        for i, (outcome, after, _snap) in enumerate(outcomes):
            assert after == 3, (r, i, after)  # every rank joined the next collective
            if i > 0:
                assert outcome == ("ok",), (r, i, outcome)  # the patch fires once
            elif r == 0:
                assert outcome[:2] == ("raised", "KeyboardInterrupt"), outcome
            else:
                assert outcome[:2] == ("raised", "RuntimeError"), outcome
                assert "rank 0 failed with KeyboardInterrupt" in outcome[2], outcome
    after_first = values[0][0][2]
    if where != "transfer":  # in the commit: deferred until it ended, published, then raised
        index = json.loads(after_first[E.INDEX_NAME])
        assert sorted(index["weight_map"]) == sorted(f"r{r}.w{i}" for r in range(3)
                                                    for i in range(4))
        assert "tokenizer.json" in after_first
    else:  # interrupted before publishing: the earlier checkpoint, byte for byte
        assert after_first == before
    got = _read_checkpoint(out)
    assert sorted(got) == sorted(f"r{r}.w{i}" for r in range(3) for i in range(4))


def _peer_dies_after_the_data(out):
    import signal

    r = dist.get_rank()
    if r == 1:
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        export_rounds._commit_round = die  # every byte has arrived; rank 1 dies before the commit round
    return _outcome(lambda: dx.export_hf_checkpoint(_state_of(r), out, max_shard_size="20KB"))


def test_a_peer_dying_after_the_data_is_named_and_the_checkpoint_is_complete(tmp_path):
    out = str(tmp_path / "ckpt")
    res = run_ranks(_peer_dies_after_the_data, 3, out, pg_timeout=120, timeout=120)
    assert res[1].exit_code == -9
    for r in (0, 2):
        outcome = res[r].value
        assert outcome[:2] == ("raised", "RuntimeError") and "rank 1 died" in outcome[2], outcome
    assert "the checkpoint itself is complete" in res[0].value[2]
    got = _read_checkpoint(out)
    for r in range(3):
        for i in range(4):
            assert torch.equal(got[f"r{r}.w{i}"], torch.full((3000,), float(10 * r + i)))


def _export_into(out):
    dx.export_hf_checkpoint(_state_of(dist.get_rank()), out, max_shard_size="5GB" if
                            dist.get_rank() == 0 else 5 * 10**9)  # the same size, spelled apart
    return True


def test_missing_parents_are_made_and_a_symlinked_directory_keeps_its_link(tmp_path):
    nested = tmp_path / "a" / "b" / "ckpt"
    assert_all_ok(run_ranks(_export_into, 2, str(nested)))
    assert sorted(_read_checkpoint(str(nested))) == sorted(
        f"r{r}.w{i}" for r in range(2) for i in range(4))
    target = tmp_path / "real"
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert_all_ok(run_ranks(_export_into, 2, str(link)))
    assert link.is_symlink() and (link / "tokenizer.json").exists()
    assert sorted(_read_checkpoint(str(link))) == sorted(
        f"r{r}.w{i}" for r in range(2) for i in range(4))


# -- the sinks' row tables: one process, checked against the bytes they should hold ----------


def _random_rows(entries, seed, max_run=3000):
    """Every byte of ``entries`` as rows ``(index, offset, at, n)`` over one message, in a
    shuffled order (so that runs cross regions, files and each other's order)."""
    g = torch.Generator().manual_seed(seed)
    rows, at = [], 0
    for e in entries:
        off = 0
        while off < e.nbytes:
            n = min(e.nbytes - off, int(torch.randint(1, max_run, (1,), generator=g)))
            rows.append((e.index, off, at, n))
            off, at = off + n, at + n
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order], at


@pytest.mark.parametrize("direct", [False, True])
def test_file_sink_writes_a_shuffled_row_table_exactly(tmp_path, monkeypatch, direct):
    # Small regions, so that a few KiB of tensors span many of them and runs cross their
    # ends; two files; rows in random order and long runs among the short ones.
    monkeypatch.setattr(export_regions, "REGION_BYTES", 4096)
    monkeypatch.setattr(export_sinks, "SMALL_RUN", 2048)
    if not direct:
        monkeypatch.setattr(export_sinks._direct_io, "on_ram_filesystem", lambda path: True)
    shapes = [(1000,), (3, 777), (), (0, 4), (5000,), (17,)]
    entries = [E.Entry(f"t{i}", torch.float32, s, index=i) for i, s in enumerate(shapes)]
    tensors = [torch.randn(s, generator=torch.Generator().manual_seed(i))
               for i, s in enumerate(shapes)]
    rows, total = _random_rows(entries, seed=1)
    data = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors] + [
        torch.empty(0, dtype=torch.uint8)])
    # ``data`` holds the entries back to back; the rows name their bytes in that layout.
    starts = list(itertools.accumulate([0] + [e.nbytes for e in entries[:-1]]))
    table = torch.tensor([(i, off, starts[i] + off, n) for i, off, _at, n in rows],
                         dtype=torch.int64)
    assert data.numel() == total
    sink = E.FileSink(str(tmp_path / "ckpt"), [entries[:3], entries[3:]])
    for part in table.split(7):  # several batches, as messages arrive
        sink.write_batch(data, part.contiguous())
    sink.commit()
    got = {}
    for name in sorted(os.listdir(tmp_path / "ckpt")):
        if name.endswith(".safetensors"):
            got.update(safetensors_torch.load_file(str(tmp_path / "ckpt" / name)))
    assert sorted(got) == sorted(e.key for e in entries)
    for e, t in zip(entries, tensors):
        assert torch.equal(got[e.key], t), e.key


def test_memory_sink_checks_every_row_against_its_entry():
    entries = [E.Entry("a", torch.float32, (4,), index=0), E.Entry("b", torch.int8, (3,), index=1)]
    sink = E.MemorySink(entries)
    data = torch.arange(19, dtype=torch.uint8)
    sink.write_batch(data, torch.tensor([[1, 0, 16, 3], [0, 0, 0, 16]], dtype=torch.int64))
    assert sink.tensors["b"].tolist() == [16, 17, 18]
    assert sink.tensors["a"].view(torch.uint8).tolist() == list(range(16))
    with pytest.raises(ValueError, match="'b': bytes \\[1, 4\\) lie outside its 3 bytes"):
        sink.write_batch(data, torch.tensor([[1, 1, 0, 3]], dtype=torch.int64))


def test_the_header_is_the_json_safetensors_writes():
    # Quotes, backslashes, non-ASCII, a scalar, an empty tensor: the text json.dumps makes
    # of the same header dict, which safetensors parses back.
    specs = [("a.b", torch.float32, (3, 4)), ('we"ird\\kéy', torch.bfloat16, ()),
             ("ünï", torch.int8, (0, 5)), ("x" * 300, torch.float64, (1,))]
    entries = [E.Entry(k, d, s, index=i) for i, (k, d, s) in enumerate(specs)]
    head, offsets = E.safetensors_header(entries)
    meta, pos = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        meta[e.key] = {"dtype": E.SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    text = json.dumps(meta, separators=(",", ":"))
    assert head[8:].rstrip(b" ").decode() == text
    assert int.from_bytes(head[:8], "little") == len(head) - 8 and len(head) % 8 == 0
    assert offsets["a.b"] == len(head)


def _described_refusals():
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    good = DTensor.from_local(torch.ones(4), mesh, [Shard(0)])
    cases = {
        "shard shape": DTensor.from_local(torch.ones(3), mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size([4]), stride=(1,)),
        "negated shard": DTensor.from_local(torch.ones(4, dtype=torch.complex64).conj().imag,
                                            mesh, [Shard(0)]),
        "sparse": torch.ones(3).to_sparse(),
        "meta": torch.empty(3, device="meta"),
        "not a tensor": 3.0,
        "dtype": torch.ones(2, dtype=torch.complex128),
    }
    out = {}
    for name, bad in cases.items():
        # After entries of the same signature, so that a check made once per signature
        # cannot let a later entry through.
        state = {"a": good, "b": torch.ones(3), "bad": bad}
        try:
            E.describe_state(state)
            out[name] = ("ok",)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[name] = (type(exc).__name__, str(exc))
    local: dict = {}
    described = E.describe_state({"a": good, "b": torch.ones(3)}, None, local)
    return out, described.sig_ids, local["a"] is good._local_tensor, local["b"].tolist()


def test_describe_refuses_each_entry_it_cannot_write_naming_its_key():
    (out, ids, same, b), = assert_all_ok(run_ranks(_described_refusals, 1))
    expected = {
        "shard shape": ("ValueError", "its local shard has shape (3,), but its placements say (4,)"),
        "negated shard": ("ValueError", "lazily negated view"),
        "sparse": ("TypeError", "sparse_coo or meta tensor"),
        "meta": ("TypeError", "meta tensor"),
        "not a tensor": ("TypeError", "is a float, not a tensor"),
        "dtype": ("TypeError", "complex128, which safetensors cannot store"),
    }
    for name, (kind, text) in expected.items():
        assert out[name][0] == kind and text in out[name][1] and "'bad'" in out[name][1], \
            (name, out[name])
    assert len(ids) == 2 * 4 and same and b == [1.0, 1.0, 1.0]


def test_planning_every_rank_at_once_equals_planning_each_rank_alone():
    # dst plans every sender's stream in one pass; each sender plans its own: the same
    # messages, or a sender's bytes would land at the wrong offsets.
    g = torch.Generator().manual_seed(3)
    entries = []
    for i in range(200):
        e = E.Entry(f"k{i}", torch.uint8, (0,), index=i)
        for r in range(3):
            n = int(torch.randint(0, 9000, (1,), generator=g))
            e.pieces.append(E.Piece(r, E.Block((0,), (n,)), n, e.key))
        entries.append(e)
    pairs = [(e, p) for e in entries for p in e.pieces]
    from distributed_ext.export.messages import plan_streams

    together = plan_streams(iter(pairs), 4096, 3)
    for r in range(3):
        alone = E.plan_messages([(e, p) for e, p in pairs if p.rank == r], 4096)
        assert together[r] == alone and alone, r


# -- writers="all": every rank writes its own bytes --------------------------------------------


def _written_bytes() -> int:
    """Bytes this process passed to write calls so far (``wchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _recording_writes(fn):
    """Runs ``fn()``; the ``(file name, offset, nbytes)`` of every write this rank made to a
    checkpoint file (pwrite, direct or not, and the native batched writes)."""
    from distributed_ext import _direct_io, _native

    writes, real_pwrite, real_segments = [], _direct_io._pwrite_fully, _native.pwrite_segments

    def name(fd):
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    def pwrite(fd, view, offset):
        writes.append((name(fd), offset, len(view)))
        return real_pwrite(fd, view, offset)

    def segments(fd, table):
        rows = table.tolist() if isinstance(table, torch.Tensor) else table
        writes.extend((name(fd), offset, n) for _src, offset, n in rows)
        return real_segments(fd, table)

    _direct_io._pwrite_fully, _native.pwrite_segments = pwrite, segments
    try:
        fn()
    finally:
        _direct_io._pwrite_fully, _native.pwrite_segments = real_pwrite, real_segments
    return writes


def _blocks_written(writes, align=4096):
    """The ``(file name, block index)`` of every aligned block these writes touch."""
    return {(f, b) for f, offset, n in writes if n
            for b in range(offset // align, (offset + n - 1) // align + 1)}


def _both_writers(base):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    r, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    # Every placement and dtype: uneven and empty shards, short Shard(1) runs, replicas.
    state = {
        "fsdp": distribute_tensor(torch.randn(1024, 256, generator=g), mesh, [Shard(0)]),
        "uneven": distribute_tensor(torch.randn(7, 33, generator=g), mesh, [Shard(0)]),
        "tp": distribute_tensor(torch.randn(64, 96, generator=g).bfloat16(), mesh, [Shard(1)]),
        "rep": distribute_tensor(torch.randint(-9, 9, (300,), generator=g, dtype=torch.int8),
                                 mesh, [Replicate()]),
        "flags": torch.arange(77) % 3 == 0,  # a plain tensor every rank holds
        "dense": torch.randn(4096, 256, generator=g),  # 4 MiB on every rank: split to write
        f"own{r}": torch.full((5000,), float(r), dtype=torch.float16),  # only this rank's
    }
    out = {}
    writes = []
    for writers in ("all", "dst", None):  # None: the default, on this one host's disk
        before = _written_bytes()
        kwargs = {} if writers is None else {"writers": writers}
        sent = _counting_sends(lambda w=writers, kw=kwargs: writes.extend(_recording_writes(
            lambda: dx.export_hf_checkpoint(state, os.path.join(base, str(w)),
                                            max_shard_size="300KB", **kw))))
        out[writers] = (sent, _written_bytes() - before)
        if writers == "all":
            out["blocks"] = _blocks_written(writes)
    fsdp_share = state["fsdp"].to_local().numel() * 4  # this rank's block
    return out, fsdp_share, 4 * 2**20 // world - world * 4096  # and its rows of "dense"


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_writes_its_own_bytes_into_the_same_files_the_single_writer_makes(world,
                                                                                     tmp_path):
    values = assert_all_ok(run_ranks(_both_writers, world, str(tmp_path), timeout=180))
    names = sorted(os.listdir(tmp_path / "dst"))
    assert names == sorted(os.listdir(tmp_path / "all")) and E.INDEX_NAME in names
    assert names == sorted(os.listdir(tmp_path / "None"))
    for name in names:  # byte for byte
        assert (tmp_path / "all" / name).read_bytes() == (tmp_path / "dst" / name).read_bytes()
        assert (tmp_path / "None" / name).read_bytes() == (tmp_path / "dst" / name).read_bytes()
    total = sum(os.path.getsize(tmp_path / "all" / n) for n in names if n != E.INDEX_NAME)
    # Every 4 KiB block of the files has one writer: where two ranks' runs meet inside a
    # block, the one holding more of it writes it (the other sends it its bytes there).
    blocks = [got["blocks"] for got, _fsdp, _dense in values]
    for a, b in itertools.combinations(range(world), 2):
        assert not blocks[a] & blocks[b], (a, b, sorted(blocks[a] & blocks[b])[:5])
    assert sum(map(len, blocks)) >= total // 4096  # (and the writes were seen)
    for r, (got, fsdp_share, dense_share) in enumerate(values):
        sent_all, wrote_all = got["all"]
        sent_dst, wrote_dst = got["dst"]
        # Only pieces of short runs cross the link (here the Shard(1) rows, the small
        # tensors: ~20 KiB), for dst to assemble them into whole regions, and its bytes in
        # the partial 4 KiB blocks at the ends of its two long runs that another rank owns
        # (its FSDP block, its rows of "dense": under 16 KiB); the FSDP block never.
        assert sent_all < 64 * 2**10, (r, sent_all)
        assert r == 0 or sent_all < sent_dst - fsdp_share + 4 * 4096, (r, sent_all, sent_dst)
        # Each rank writes about its share (its FSDP block and its rows of the replicated
        # "dense", split between its holders), never the checkpoint.
        assert fsdp_share + dense_share <= wrote_all < total / world + 2**20, \
            (r, wrote_all, total)
        if r == 0:
            assert wrote_dst >= total  # the single writer writes every byte ...
        else:  # ... the others send theirs (but no byte of "dense": dst has its own copy)
            assert fsdp_share < sent_dst < fsdp_share + 2**20 and wrote_dst < 2**20, \
                (r, sent_dst, wrote_dst)
        # The default on a directory every rank sees (here one host's disk): every rank
        # writes its own bytes, as with "all".
        sent_auto, wrote_auto = got[None]
        assert sent_auto == sent_all and fsdp_share + dense_share <= wrote_auto < \
            total / world + 2**20, \
            (r, got[None], got["all"])


def _blind_rank(out, writers):
    if dist.get_rank() == 1:  # this rank's view of the directory is another filesystem
        from distributed_ext.export import writers as export_writers

        export_writers._sees = lambda stage, token: False
    # (and 4 MiB every rank holds: split between the writers under "all", dst's own copy
    # once "auto" falls back to one writer -- none of it then crosses the link)
    state = {f"w{dist.get_rank()}": torch.full((1000,), 1.0),
             "dense": torch.arange(2**20, dtype=torch.float32)}
    sent = []
    outcome = _outcome(lambda: sent.append(_counting_sends(
        lambda: dx.export_hf_checkpoint(state, out, writers=writers))))
    return outcome, sent, dx.all_reduce("after", lambda: 1, sum)


def test_writers_all_on_a_directory_a_rank_does_not_see_is_refused_and_auto_falls_back(
        tmp_path):
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_blind_rank, 3, str(out), "all"))
    for outcome, _sent, after in values:
        assert outcome[0] == "raised" and outcome[1] == "ValueError", outcome
        assert "writers='all', but rank(s) [1] do not see directory=" in outcome[2], outcome
        assert after == 3
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if "dext" in n]
    values = assert_all_ok(run_ranks(_blind_rank, 3, str(out), "auto"))
    assert [v[0][0] for v in values] == ["ok"] * 3
    assert 0 < values[1][1][0] < 2**20  # the fallback: dst writes, rank 1 sends its bytes
    assert sorted(_read_checkpoint(out)) == ["dense", "w0", "w1", "w2"]


def test_writers_must_be_auto_all_or_dst(tmp_path):
    with pytest.raises(ValueError, match="writers='some'; pass 'auto'"):
        dx.export_hf_checkpoint({"w": torch.ones(2)}, str(tmp_path / "x"), writers="some")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("shape, block, base", [
    ((1000, 300), E.Block((333, 0), (400, 300)), 77),  # a Shard(0) block: one long run
    ((64, 5000), E.Block((0, 1200), (64, 2500)), 4096 * 3 + 5),  # Shard(1): 64 rows
    ((64, 1024), E.Block((0, 0), (64, 1024)), 8192),  # aligned: no edges at all
])
def test_a_writers_middles_and_edges_cover_its_runs_once(shape, block, base):
    # What a joined writer writes itself (the aligned blocks inside each row of its
    # messages) and what goes to the blocks' owners (edge_table) cover each byte of its runs once,
    # and no aligned block is in both; chunk-split rows included.
    from distributed_ext.export.messages import _rows, edge_table, pack

    runs = E.block_runs(block, shape, 4)
    piece = E.Piece(1, block, block.numel * 4)
    entry = E.Entry("w", torch.float32, shape, [piece], index=0)
    messages = E.plan_messages([(entry, piece)], 24 * 4096)  # rows split mid-run
    edges = pack(edge_table(messages, torch.tensor([base]), 4096)[0], 2**20)
    mine, sent = [], []
    rows = torch.cat([_rows(m) for m in messages]).tolist()
    for row in rows:
        # (the whole 4 KiB blocks inside the row)
        lo, hi = min(row[3], -(base + row[1]) % 4096), (base + row[1] + row[3]) // 4096 * 4096
        hi -= base + row[1]
        if hi > lo:
            mine.append((base + row[1] + lo, hi - lo))
    for m in edges:
        sent += [(base + r[1], r[3]) for r in _rows(m).tolist()]
    assert all(n < 4096 for _o, n in sent) and sum(map(len, edges)) <= 2 * len(rows)
    assert all(o % 4096 == 0 and n % 4096 == 0 for o, n in mine)
    covered = sorted(mine + sent)
    expected = sorted((base + o, n) for o, _a, n in runs.pieces(0, piece.nbytes))
    assert sum(n for _o, n in covered) == piece.nbytes
    # Merged, they are exactly the runs (no gap, no overlap) ...
    merged = _merge_adjacent(covered)
    assert merged == _merge_adjacent(expected)
    # ... and no block written by this rank holds a byte that goes to dst.
    own = {b for o, n in mine for b in range(o // 4096, (o + n) // 4096)}
    assert not own & {b for o, n in sent for b in range(o // 4096, (o + n - 1) // 4096 + 1)}
    if base % 4096 == 0 and shape == block.shape:
        assert not edges


def _merge_adjacent(runs):
    out = []
    for o, n in runs:
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((o, n))
    return out


def test_one_rank_plans_only_what_concerns_it_at_a_simulated_world_of_1024():
    # The plan a sender computes (in one process, from the metadata of 1024 simulated ranks
    # that all hold 100k Shard(0) tensors): every check made, its own pieces kept, memory and
    # work O(keys) -- not O(keys x world).
    import array
    import tracemalloc

    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces
    from distributed_ext.export.messages import edge_table, pack

    world, n, me = 1024, 100_000, 5
    sig = export_entries.Signature("float32", (4096, 64), (("S", 0),), tuple(range(world)),
                                   (world,))
    keys = [f"model.layers.{i}.w" for i in range(n)]
    ids = (array.array("i", [0]) * n).tobytes()
    described = [export_entries.Described(keys, ids, [sig])] * world
    tracemalloc.start()
    holdings = export_holdings.merge_holdings(described, list(range(world)), 0, None)
    # (as planned by default: every rank writing its own bytes)
    entries = export_pieces.plan_entries(holdings, None, 0, list(range(world)), keep=me,
                                         spread=True)
    export_pieces.check_keys(entries)
    messages = E.plan_messages(((e, p) for e in entries for p in e.pieces), 16 * 2**20)
    # The edges it would send dst were its pieces long (each entry's data after a header of
    # 4000 bytes: nothing aligned)
    bases = torch.arange(n, dtype=torch.int64) * (4096 * 64 * 4) + 4000
    edges = pack(edge_table(messages, bases, 4096)[0], 2**20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # (each 1 KiB piece inside one 4 KiB block: all of it one edge; 100 packed messages)
    assert sum(len(m) for m in edges) == n and sum(s[3] for m in edges for s in m) == n * 1024
    assert len(edges) == len(messages)
    assert len(entries) == n and [e.key for e in entries[:2]] == keys[:2]
    for e in entries[::997]:
        (p,) = e.pieces
        assert p.rank == me and p.block == E.Block((4 * me, 0), (4, 64)) and p.nbytes == 1024
    assert sum(len(m) for m in messages) == n  # its 100k KiB, packed: 100 messages
    assert len(messages) == n * 1024 // 2**20 + 1
    # (71 MiB measured cold: the 1024 blocks and their runs computed and cached; planning
    # every rank's pieces would take GBs)
    assert peak < 96 * 2**20, peak / 2**20


def test_one_rank_deals_its_shared_blocks_at_a_simulated_world_of_1024():
    # With every rank writing, what one rank plans of the shared blocks at world 1024 with
    # 100k Shard(0) tensors whose runs (132 KB a rank) are long: its own runs' ends (two
    # fragments each) and the ranks they are dealt to -- O(its pieces), never the world's
    # 204.8M fragments (dealt out, each rank plans ~1/1024 of them: RESULTS.md).
    import array
    import tracemalloc

    from distributed_ext.export import edges, prepare
    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces
    from distributed_ext.export.messages import edge_table

    world, n, me, row = 1024, 100_000, 5, 4124
    sig = export_entries.Signature("float32", (32 * world + 3, row // 4), (("S", 0),),
                                   tuple(range(world)), (world,))
    keys = [f"model.layers.{i}.w" for i in range(n)]
    described = [export_entries.Described(keys, (array.array("i", [0]) * n).tobytes(),
                                          [sig])] * world

    class Files:  # 36 tensors a file (5 GB), a header of 120 bytes per tensor
        nbytes = (32 * world + 3) * row
        file_of = torch.arange(n) // 36
        bases = 8 + 120 * 36 + torch.arange(n) % 36 * nbytes
        sizes = [8 + 120 * 36 + 36 * nbytes] * (n // 36) + [8 + 120 * 36 + n % 36 * nbytes]

    tracemalloc.start()
    holdings = export_holdings.merge_holdings(described, list(range(world)), 0, None)
    entries = export_pieces.plan_entries(holdings, None, 0, list(range(world)), keep=me,
                                         spread=True)
    written = [(e, p) for e in entries for p in e.pieces if not prepare._short(e, p)]
    messages = E.plan_messages(written, 16 * 2**20, Files.bases)
    plan = edges.plan_edges(edge_table(messages, Files.bases, 4096)[0], Files, world)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(written) == n and len(plan.rows) == 2 * n  # both ends of each of its runs
    assert int(plan.dealt.sum()) == 2 * n and int(plan.dealt.count_nonzero()) == world
    assert int(plan.dealt.max()) < 4 * 2 * n // world  # spread over the ranks
    # Its rows grouped by the rank each is dealt to, canonical within each group
    to = edges._owners.coordinators(plan.rows, Files.file_of, Files.bases, Files.sizes,
                                    world, 4096)
    assert bool((to[plan.order][1:] >= to[plan.order][:-1]).all())
    assert peak < 160 * 2**20, peak / 2**20  # (Python objects; tables of its own rows)


def _both_writers_2d(base, short_run):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export import owners as export_owners

    if short_run is not None:  # runs from this length up are written where they are held
        export_owners.SHORT_RUN = short_run

    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(1)
    state = {  # HSDP (replicas of each FSDP shard) and FSDP+TP, world 4
        "hsdp": distribute_tensor(torch.randn(512, 256, generator=g), mesh,
                                  [Replicate(), Shard(0)]),
        "fsdp_tp": distribute_tensor(torch.randn(1024, 1024, generator=g), mesh,
                                     [Shard(0), Shard(1)]),
        # 4 MiB HSDP shards, each split between its two holders to write (2 MiB each)
        "hsdp_big": distribute_tensor(torch.randn(4096, 512, generator=g), mesh,
                                      [Replicate(), Shard(0)]),
        # HSDP x TP: replicated TP shards (columns 0-511 on ranks 0 and 2, the rest on 1, 3)
        "hsdp_tp": distribute_tensor(torch.randn(1024, 1024, generator=g), mesh,
                                     [Replicate(), Shard(1)]),
    }
    out = {}
    for writers in ("all", "dst"):
        writes = _recording_writes(lambda w=writers: dx.export_hf_checkpoint(
            state, os.path.join(base, w), writers=w))
        out[writers] = sum(n for _f, _o, n in writes)  # (to the files, not the link)
        out[f"{writers} blocks"] = _blocks_written(writes)
    return out


@pytest.mark.parametrize("short_run", [None, 512])
def test_hsdp_and_fsdp_tp_with_every_rank_writing_match_the_single_writer(short_run, tmp_path):
    values = assert_all_ok(run_ranks(_both_writers_2d, 4, str(tmp_path), short_run,
                                     timeout=180))
    data = (tmp_path / "all" / E.WEIGHTS_NAME).read_bytes()
    assert data == (tmp_path / "dst" / E.WEIGHTS_NAME).read_bytes()
    # Each 256 KiB HSDP block is written once, by one of its two holders (dst for the one it
    # holds, one of ranks 1 and 3 for the other); each 4 MiB one is split between its two
    # holders (2 MiB each: every rank writes); the FSDP+TP blocks' rows are 2 KiB runs:
    # short, which dst assembles, or -- SHORT_RUN lowered to 512 bytes -- each written by
    # its holder (below). All ranks together write the file once, not once per replica.
    assert len(data) <= sum(v["all"] for v in values) < len(data) + 2**20, values
    assert values[0]["all"] < len(data) - 4 * 2**20, values  # dst did not write it all
    assert max(values[r]["all"] for r in (1, 3)) >= 2 * 2**20 + 256 * 2**10, values
    assert min(v["all"] for v in values) >= 2 * 2**20 - 8192, values
    for a, b in itertools.combinations(range(4), 2):  # every 4 KiB block: one writer
        assert not values[a]["all blocks"] & values[b]["all blocks"], (a, b)
    # The FSDP+TP tensor, against the file's own header: rank r holds rows 512 * (r // 2)
    # on, columns 512 * (r % 2) on -- rows of 2 KiB runs, two ranks' in each 4 KiB of the
    # file. Under SHORT_RUN (the default) each 1 MiB region of the file (its whole blocks of
    # the tensor) is written by the rank holding most of its bytes in whole rows, ties
    # taken in turn by the region's index -- ranks 0 and 1 alternate over the first half's
    # regions, 2 and 3 over the second's -- and dst writes the partial blocks at the
    # tensor's ends; with 512,
    # each block is written by the rank holding most of its bytes (ties: dst, then the
    # lower rank).
    head_len = int.from_bytes(data[:8], "little")
    lo, hi = json.loads(data[8 : 8 + head_len])["fsdp_tp"]["data_offsets"]
    base, end = 8 + head_len + lo, 8 + head_len + hi

    def held_in(x: int, y: int) -> dict[int, int]:
        """Bytes each rank holds in the file's [x, y)."""
        out: dict[int, int] = {}
        for row in range(1024):
            for half in range(2):
                a = base + row * 4096 + half * 2048
                n = min(a + 2048, y) - max(a, x)
                if n > 0:
                    r = row // 512 * 2 + half
                    out[r] = out.get(r, 0) + n
        return out

    first, last = -(-base // 4096), end // 4096  # the tensor's whole blocks
    owners = set()
    for blk in range(first, last):
        if short_run:
            by_rank = held_in(blk * 4096, blk * 4096 + 4096)
            owner = max(by_rank, key=lambda r: (by_rank[r], r == 0, -r))
        else:
            # (the DP groups' rows: the second's from the tensor's row 512 on)
            owner, by_rank = _zone_writer(blk, first, last, [base + 512 * 4096], held_in,
                                          2048)
        writers = [r for r in range(4) if (E.WEIGHTS_NAME, blk) in values[r]["all blocks"]]
        assert writers == [owner], (blk, by_rank, writers)
        owners.add(owner)
    for blk in {base // 4096, (end - 1) // 4096} - set(range(first, last)):
        writers = [r for r in range(4) if (E.WEIGHTS_NAME, blk) in values[r]["all blocks"]]
        assert writers == [0], (blk, writers)  # the ends' partial blocks: dst's
    # Every rank writes a part of it (not dst alone, as it would assemble it with "dst");
    # with 512, the lower rank of each pair (every block a tie).
    assert last - first >= 1000, (base, last - first)
    assert owners == ({0, 2} if short_run else {0, 1, 2, 3}), (base, owners)
    # The HSDP x TP tensor's rows: each column block sent by one of its two holders, its
    # regions written by those two senders (one of each pair, not by the replicas too).
    lo, hi = json.loads(data[8 : 8 + head_len])["hsdp_tp"]["data_offsets"]
    first, last = -(-(8 + head_len + lo) // 4096), (8 + head_len + hi) // 4096
    wrote = {r for r in range(4) for blk in range(first, last)
             if (E.WEIGHTS_NAME, blk) in values[r]["all blocks"]}
    if not short_run:  # (with 512 the rows are long: each block a tie, dst's -- above)
        assert len(wrote) == 2 and wrote & {0, 2} and wrote & {1, 3}, wrote


@pytest.mark.parametrize("spread", [False, True])
def test_replicated_blocks_are_split_between_their_holders_only_where_every_rank_writes(
        spread):
    # One process, the planner alone: a 4 MiB plain tensor 3 ranks hold, a 4 MiB column
    # block of a replicated TP shard (rows of 1 KiB: short), and 1 MiB held twice.
    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces

    whole = E.Block((0, 0), (4096, 256))
    column = E.Block((0, 0), (4096, 256))
    small = E.Block((0, 0), (1024, 256))
    holdings = {
        "dense": export_holdings.Holding(
            "dense", export_entries.Signature("float32", (4096, 256)),
            [(r, whole) for r in range(3)]),
        "tp": export_holdings.Holding(
            "tp", export_entries.Signature("float32", (4096, 512)),
            [(0, column), (1, column), (2, E.Block((0, 256), (4096, 256)))]),
        "small": export_holdings.Holding(
            "small", export_entries.Signature("float32", (1024, 256)),
            [(1, small), (2, small)]),
    }
    entries = export_pieces.plan_entries(holdings, None, 0, [0, 1, 2], spread=spread)
    got = {e.key: [(p.rank, p.block, p.local) for p in e.pieces] for e in entries}
    if not spread:  # dst's own copy where it has one, else one holder
        assert got["dense"] == [(0, whole, None)]
        assert [r for r, _b, _l in got["tp"]] == [0, 2] and [r for r, *_ in got["small"]] in \
            ([1], [2])
        return
    # Every holder writes a third of the plain tensor's rows, from its own copy ...
    assert got["dense"] == [
        (0, E.Block((0, 0), (1366, 256)), (slice(0, 1366),)),
        (1, E.Block((1366, 0), (1365, 256)), (slice(1366, 2731),)),
        (2, E.Block((2731, 0), (1365, 256)), (slice(2731, 4096),))]
    # ... a column block is not split (its rows would be short runs, sent to dst), nor a
    # block under 2 MiB: one holder writes each, the least loaded.
    assert len(got["tp"]) == 2 and got["tp"][1][0] == 2 and got["tp"][0][2] is None
    assert len(got["small"]) == 1 and got["small"][0][2] is None
    for e in entries:  # the pieces tile each tensor
        assert sum(p.nbytes for p in e.pieces) == e.nbytes


@pytest.mark.parametrize("base", [77, 4096 * 5])
def test_a_writers_own_chunks_are_cut_where_the_file_is_aligned(base):
    # A rank's block of 1 MiB + 5 in messages of 64 KiB: cut at the file's 4 KiB boundaries
    # (the first message shorter), only the run's two ends share blocks with other runs.
    from distributed_ext.export.messages import _rows, edge_table

    shape, block = (3000, 1000), E.Block((262, 0), (263, 1000))
    piece = E.Piece(1, block, block.numel * 4)
    entry = E.Entry("w", torch.float32, shape, [piece], index=0)
    bases = torch.tensor([base])
    messages = E.plan_messages([(entry, piece)], 64 * 2**10, bases)
    rows = torch.cat([_rows(m) for m in messages]).tolist()
    assert sum(r[3] for r in rows) == piece.nbytes and max(r[3] for r in rows) <= 64 * 2**10
    start = base + 262 * 4000
    assert [(base + r[1]) % 4096 for r in rows[1:]] == [0] * (len(rows) - 1)  # aligned cuts
    edges = edge_table(messages, bases, 4096)[0]
    expected = [(-start) % 4096, (start + piece.nbytes) % 4096]
    assert [s[3] for s in edges] == [n for n in expected if n]
    # Cut every 64 KiB regardless of the file: a shared block at each cut too
    unaligned = E.plan_messages([(entry, piece)], 64 * 2**10)
    more = edge_table(unaligned, bases, 4096)[0]
    assert base % 4096 == 0 or len(more) > len(edges) + 10


def _fragments(*runs, base=100):
    """A fragment table of entry 0 (its data at file offset ``base``) from ``(file offset,
    nbytes)`` pairs."""
    return torch.tensor([(0, o - base, 0, n) for o, n in runs], dtype=torch.int64).reshape(-1, 4)


def _zone_writer(blk, first, last, groups, held_in, run):
    """Who writes block ``blk`` of a TP tensor whose whole blocks are ``[first, last)``: its
    zone is cut at 1 MiB regions of the file and at the block holding each file offset of
    ``groups`` (where a DP group's rows begin); the rank holding most of the zone's bytes
    (``held_in(x, y)``: per rank), counted in whole rows -- within two runs of the most is a
    tie -- ties taken in turn by the region's index. Also returns the bytes per rank."""
    cuts = {first * 4096, last * 4096} | {g // 4096 * 4096 for g in groups}
    cuts |= set(range(-(-first * 4096 // 2**20) * 2**20, last * 4096, 2**20))
    x = max(c for c in cuts if c <= blk * 4096)
    y = min(c for c in cuts if c > blk * 4096)
    by_rank = held_in(x, y)
    most = max(by_rank.values())
    tied = sorted(r for r, n in by_rank.items() if n > 0 and n >= most - 2 * run)
    return tied[x // 2**20 % len(tied)], by_rank


def _tp_entries(shape, mesh, placements, world, spread=True, keep=None, n=1,
                dtype="float32"):
    """Every rank's plan (``keep``: that rank's) of ``n`` tensors of ``shape`` (pieces, as
    ``writers='all'`` plans them), from the metadata alone."""
    import array

    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces

    sig = export_entries.Signature(dtype, shape, placements, tuple(range(world)), mesh)
    keys = ["w"] if n == 1 else [f"w{i}" for i in range(n)]
    described = [export_entries.Described(keys, (array.array("i", [0]) * n).tobytes(), [sig])]
    holdings = export_holdings.merge_holdings(described * world, list(range(world)), 0, None)
    plans = [export_pieces.plan_entries(holdings, None, 0, list(range(world)), keep=r,
                                        spread=spread)
             for r in (range(world) if keep is None else [keep])]
    return plans if keep is None else plans[0]


def _rows_held(entry, piece):
    """The file-independent byte intervals ``[a, b)`` of a 2-D block in its tensor, row by
    row, from the block's own offset and shape (not from the planner's runs)."""
    (r0, c0), (rows, cols) = piece.block.offset, piece.block.shape
    width = entry.shape[1] * 4
    return [((r0 + i) * width + c0 * 4, (r0 + i) * width + (c0 + cols) * 4)
            for i in range(rows)]


@pytest.mark.parametrize("base", [4096, 4096 * 3 + 300, 2**20 - 5000])
@pytest.mark.parametrize("shape, mesh, placements", [
    ((700, 1536), (3,), (("S", 1),)),  # TP 3: rows of 2 KiB, three ranks' in each 6 KiB
    ((1024, 1024), (2, 2), (("S", 0), ("S", 1))),  # FSDP x TP
    ((1200, 1000), (4,), (("S", 1),)),  # TP 4: rows of 1000 bytes, unaligned
])
def test_each_region_of_a_tp_tensor_is_written_once_by_the_holder_of_most_of_it(
        shape, mesh, placements, base):
    from distributed_ext.export import zones as export_zones

    world = math.prod(mesh)
    plans = _tp_entries(shape, mesh, placements, world)
    assert all(entries[0].zoned for entries in plans)
    bases = torch.tensor([base], dtype=torch.int64)
    zones = [export_zones.plan_zones(entries, bases, r, 0, 4096, 2**20)
             for r, entries in enumerate(plans)]

    def ident(segs):
        return [(p.rank, start, n) for _e, p, start, n in segs]

    # Both ends of every pair list the same segments in the same order (so they cut the
    # same messages); each rank sends only its own pieces' bytes.
    for r, o in itertools.permutations(range(world), 2):
        assert ident(zones[r].outgoing.get(o, [])) == ident(zones[o].incoming.get(r, [])), (r, o)
        assert all(p.rank == r for _e, p, _s, _n in zones[r].outgoing.get(o, []))
    # Every byte of every piece is written once: by whom, per 4 KiB block of the file.
    entry = plans[0][0]
    pieces = {p.rank: p for p in entry.pieces}
    writer_of: dict[int, int] = {}
    covered = {r: 0 for r in pieces}
    for me, z in enumerate(zones):
        for _e, p, start, n in z.kept + [s for segs in z.incoming.values() for s in segs]:
            covered[p.rank] += n
            pos = 0  # the piece's bytes [start, start + n), row by row, to file offsets
            for a, b in _rows_held(entry, pieces[p.rank]):
                lo, hi = max(a, a + start - pos), min(b, a + start + n - pos)
                for blk in range((base + lo) // 4096, (base + hi - 1) // 4096 + 1) if lo < hi else ():
                    assert writer_of.setdefault(blk, me) == me, (blk, writer_of[blk], me)
                pos += b - a
    assert covered == {r: p.nbytes for r, p in pieces.items()}, covered
    # Who writes each block: dst the partial blocks at the tensor's ends; else the rank that
    # holds most of the bytes of its 1 MiB region of the file (in whole rows: within two
    # runs of the most is a tie, taken in turn by the region's index).
    end = base + entry.nbytes
    first, last = -(-base // 4096), end // 4096

    def held_in(x, y):
        out = {}
        for r, p in pieces.items():
            out[r] = sum(max(0, min(base + b, y) - max(base + a, x))
                         for a, b in _rows_held(entry, p))
        return out

    run = max(p.block.shape[1] for p in pieces.values()) * 4
    writers = set()
    for blk, w in writer_of.items():
        if not first <= blk < last:
            assert w == 0, (blk, w)
            continue
        groups = {base + p.block.offset[0] * entry.shape[1] * 4 for p in pieces.values()}
        owner, by_rank = _zone_writer(blk, first, last, groups, held_in, run)
        assert w == owner, (blk, by_rank, w)
        writers.add(w)
    assert len(writers) == world, writers  # the writing spread over every holder


def test_one_rank_plans_its_zones_at_a_simulated_world_of_1024():
    # FSDP 128 x TP 8 at world 1024, 500 TP tensors of 32 MiB (bf16 4096 x 4096; each DP
    # group's rows 256 KiB, each rank's part of a row 1 KiB): a rank plans only the zones
    # its pieces touch, finding their holders by bisection (measured on the 2-core VM with
    # 2000 tensors: 0.76 s for rank 5, 1.4 s for dst, which also plans every tensor's ends;
    # 47 MiB at peak, the plan of the 1024 blocks included).
    import tracemalloc

    from distributed_ext.export import zones as export_zones

    world, n, me = 1024, 500, 5
    tracemalloc.start()
    plans = {r: _tp_entries((4096, 4096), (128, 8), (("S", 0), ("S", 1)), world, keep=r,
                            n=n, dtype="bfloat16") for r in (me, 0)}
    bases = torch.arange(n, dtype=torch.int64) * (4096 * 4096 * 2) + 4000
    zones = {r: export_zones.plan_zones(plans[r], bases, r, 0, 4096, 2**20) for r in plans}
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    mine = zones[me]
    # Rank 5 holds 32 rows x 1 KiB of each tensor, in the zone of the first DP group's rows
    # (its TP group: ranks 0-7): it sends them to that zone's writer, one of those 8, but
    # for the block the next DP group's zone begins with (under 4 KiB a tensor).
    assert sum(s[3] for segs in mine.outgoing.values() for s in segs) + sum(
        s[3] for s in mine.kept) == n * 32 * 1024
    beyond = sum(s[3] for o, segs in mine.outgoing.items() if o >= 8 for s in segs)
    assert beyond < n * 4096 and not mine.incoming, (beyond, mine.outgoing.keys())
    for o, segs in mine.outgoing.items():  # what the writer (here dst) lists alike
        if o == 0:
            assert [(s[1].rank, s[2], s[3]) for s in zones[0].incoming[me]] == \
                [(s[1].rank, s[2], s[3]) for s in segs]
    assert peak < 128 * 2**20, peak / 2**20


def test_a_rank_plans_no_zone_it_neither_holds_nor_owns():
    from distributed_ext.export import zones as export_zones

    # FSDP x TP: ranks 0 and 1 hold the first half's rows, 2 and 3 the second's. Rank 1
    # meets only the first half's zones; rank 3 sends nothing to 0 or 1 (no zone of theirs).
    plans = _tp_entries((2048, 1024), (2, 2), (("S", 0), ("S", 1)), 4)
    bases = torch.tensor([2**20], dtype=torch.int64)  # (the halves meet at a region's start)
    z1 = export_zones.plan_zones(plans[1], bases, 1, 0, 4096, 2**20)
    z3 = export_zones.plan_zones(plans[3], bases, 3, 0, 4096, 2**20)
    assert set(z1.incoming) <= {0} and set(z1.outgoing) <= {0}, (z1.incoming, z1.outgoing)
    assert set(z3.outgoing) <= {2} and set(z3.incoming) <= {2}, (z3.incoming, z3.outgoing)
    assert z1.kept and z3.kept  # (each writes regions of its own half)
    # Zoned: more than one holder, each block many runs under SHORT_RUN; not Shard(1) rows
    # of 64 KiB (written where held), nor one holder's, nor Shard(0) blocks (one run each).
    from distributed_ext.export import pieces as export_pieces

    def runs(offset, block, shape):
        return export_pieces._piece_runs(E.Block(offset, block), shape, 4)

    tp = [runs((0, 0), (8, 512), (8, 1024)), runs((0, 512), (8, 512), (8, 1024))]
    assert export_pieces._zoned(tp) and not export_pieces._zoned(tp[:1])
    assert not export_pieces._zoned([runs((0, 0), (8, 2**14), (8, 2**15)),
                                     runs((0, 2**14), (8, 2**14), (8, 2**15))])
    assert not export_pieces._zoned([runs((0, 0), (4, 1024), (8, 1024)),
                                     runs((4, 0), (4, 1024), (8, 1024))])
    # Under "dst" (no spread) a TP tensor is not zoned: dst assembles its rows.
    assert not _tp_entries((64, 1024), (2,), (("S", 1),), 2, spread=False)[1][0].zoned


def test_a_shared_block_is_owned_by_the_holder_of_most_of_its_bytes():
    # One process, the planner alone: one file of 41960 bytes, a 100-byte header, then one
    # entry; 3 ranks' fragments of its shared blocks (file offsets).
    from distributed_ext.export import owners

    bases, file_of, sizes = torch.tensor([100]), torch.zeros(1, dtype=torch.int64), [41960]
    frags = [
        # rank 0 (dst): the header's block (dst's whatever it holds); half of block 6 (a
        # tie); 100 bytes of the file's last, partial block (1000 bytes)
        _fragments((100, 3996), (6 * 4096, 2048), (40960, 100)),
        # rank 1: 3000 of block 2 (against rank 2's 1096); 1000 of block 4 (against 3096);
        # the other half of block 6
        _fragments((2 * 4096, 3000), (4 * 4096 + 3096, 1000), (6 * 4096 + 2048, 2048)),
        # rank 2: the rest of blocks 2 and 4, and 900 of the last block
        _fragments((2 * 4096 + 3000, 1096), (4 * 4096, 3096), (40960 + 100, 900)),
    ]
    dests = owners.plan_owners(frags, file_of, bases, sizes, 0, 4096)
    assert dests[0].tolist() == [0, 0, 2]  # header: dst's; the tie: dst's; 900 of 1000: 2's
    assert dests[1].tolist() == [1, 2, 0]
    assert dests[2].tolist() == [1, 2, 2]
    # The same tie with dst elsewhere: the lower rank
    assert owners.plan_owners(frags, file_of, bases, sizes, 2, 4096)[1].tolist()[2] == 0
    # What rank 2 receives: rank 0's bytes of the last block, rank 1's of block 4
    receipts = owners.plan_receipts(frags, dests)
    assert receipts[0].tolist() == [[1, 0, 6 * 4096 + 2048 - 100, 2048]]  # the tie
    assert receipts[1].tolist() == [[2, 0, 2 * 4096 + 3000 - 100, 1096]]
    got = receipts[2]
    assert got.tolist() == [[0, 0, 40960 - 100, 100], [1, 0, 4 * 4096 + 3096 - 100, 1000]]
    # ... which it accepts; a receipt that is not a fragment of a block it owns, it refuses.
    nbytes = torch.tensor([41860])
    owners.check_tables(dests[2], got, frags[2], 2, 3, nbytes, file_of, bases, 4096)
    for bad in [
        [[1, 0, 2 * 4096 - 100, 1000]],  # block 2 is rank 1's
        [[2, 0, 40960 - 100, 100]],  # from itself
        [[0, 7, 0, 100]],  # no such entry
        [[0, 0, 41860 - 50, 100]],  # past the entry's end
        [[0, 0, 40960 - 100, 4096]],  # a block or more
        [[0, 0, 4 * 4096 + 4000 - 100, 200]],  # across two blocks
        got.flip(0).tolist(),  # not grouped by sender in rank order
        [[1, 0, 4 * 4096 + 3096 - 100, 500], [1, 0, 4 * 4096 + 3096 - 100, 500]],  # twice
    ]:
        with pytest.raises(ValueError, match="is not a fragment of a block this rank owns"):
            owners.check_tables(dests[2], torch.tensor(bad), frags[2], 2, 3, nbytes, file_of,
                                bases, 4096)
    with pytest.raises(ValueError, match="destination 3 of fragment 1 is not a group rank"):
        owners.check_tables(torch.tensor([1, 3, 2]), got, frags[2], 2, 3, nbytes, file_of,
                            bases, 4096)


def _majority_writes(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(2)
    # Long Shard(0) runs (~100 KB a rank) whose ends fall inside 4 KiB blocks.
    state = {"a": distribute_tensor(torch.randn(999, 77, generator=g), mesh, [Shard(0)]),
             "b": distribute_tensor(torch.randn(500, 300, generator=g).bfloat16(), mesh,
                                    [Shard(0)]),
             "c": distribute_tensor(torch.randn(1000, 70, generator=g), mesh, [Shard(0)])}
    writes = []
    sent = _counting_sends(lambda: writes.append(_recording_writes(
        lambda: dx.export_hf_checkpoint(state, out, writers="all"))))
    writes = writes[0]
    rows = {k: (v.shape[0], v.to_local().shape[0]) for k, v in state.items()}
    return _blocks_written(writes), sent, rows


def test_every_shared_block_is_written_by_the_holder_of_most_of_its_bytes(tmp_path):
    # World 3, against the file itself: where two ranks' runs meet inside a 4 KiB block,
    # the block's writer is the rank holding more of its bytes (dst where the header is),
    # and what each rank sends is exactly its bytes in blocks others own.
    import json

    world = 3
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_majority_writes, world, str(out), timeout=120))
    data = (out / E.WEIGHTS_NAME).read_bytes()
    head_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + head_len])
    start = 8 + head_len
    held = []  # (first byte, end, rank) of every rank's run in the file
    for key, (nrows, _local) in values[0][2].items():
        lo, hi = header[key]["data_offsets"]
        row = (hi - lo) // nrows
        per = -(-nrows // world)  # torch.chunk's rows per rank
        for r in range(world):
            a, b = min(r * per, nrows), min((r + 1) * per, nrows)
            if b > a:
                held.append((start + lo + a * row, start + lo + b * row, r))
    bytes_in = {}  # block -> {rank: bytes}
    for a, b, r in held:
        for blk in (a // 4096, (b - 1) // 4096):
            lo, hi = max(a, blk * 4096), min(b, (blk + 1) * 4096)
            bytes_in.setdefault(blk, {})[r] = hi - lo
    expected_sent = [0] * world
    checked = 0
    for blk, by_rank in bytes_in.items():
        if len(by_rank) < 2 and blk * 4096 >= start:
            continue
        if blk * 4096 < start:  # the header's block: dst's
            owner = 0
        else:
            owner = max(by_rank, key=lambda r: (by_rank[r], r == 0, -r))
        writers = [r for r in range(world) if ("model.safetensors", blk) in values[r][0]]
        assert writers == [owner], (blk, by_rank, writers)
        for r, n in by_rank.items():
            if r != owner:
                expected_sent[r] += n
        checked += 1
    assert checked >= 6  # (the blocks where ranks meet, between and inside tensors)
    owners_seen = {max(by, key=by.get) for by in bytes_in.values() if len(by) > 1}
    assert owners_seen - {0}, owners_seen  # not every shared block is dst's
    assert [v[1] for v in values] == expected_sent, ([v[1] for v in values], expected_sent)


def _corrupt_table(out, how):
    from distributed_ext.export import edges

    if how == "dests":  # every rank, planning owners, sends rank 1 a destination 5 of 2
        real = edges._owners.plan_dealt

        def corrupt(*args):
            dests, receipts, fault = real(*args)
            if len(dests[1]):
                dests[1][0] = 5
            return dests, receipts, fault

        edges._owners.plan_dealt = corrupt
    elif how == "dealt" and dist.get_rank() == 1:  # rank 1 deals its rows to the wrong ranks
        real_deal = edges._owners.coordinators
        edges._owners.coordinators = lambda *args: (real_deal(*args) + 1) % 2
    elif how == "planning" and dist.get_rank() == 1:  # rank 1 fails planning its blocks
        def broken(*args):
            raise RuntimeError("planning failed here")

        edges._owners.plan_owners = broken
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.arange(300 * 1001, dtype=torch.float32)
                                    .reshape(300, 1001), mesh, [Shard(0)])}
    return _export_then_use_the_group(state, out, 2**20, "all")


@pytest.mark.parametrize("how", ["dests", "dealt", "planning"])
def test_a_malformed_table_of_shared_blocks_is_refused_on_every_rank(tmp_path, how):
    # What the ranks send each other to agree the owners is checked where it arrives: a
    # destination that is no rank, a row sent to a rank its block is not dealt to; a rank
    # whose planning fails still answers. Every rank raises (naming the rank at fault),
    # none is left waiting in a collective, the group is usable after, nothing is left.
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_corrupt_table, 2, str(out), how))
    if how == "planning":
        assert values[1][0] == ("raised", "RuntimeError", "planning failed here"), values[1]
        assert values[0][0][:2] == ("raised", "RuntimeError") and \
            "rank 1 failed with RuntimeError: planning failed here" in values[0][0][2], values
    else:
        assert all(v[0][:2] == ("raised", "ValueError") or
                   (v[0][:2] == ("raised", "RuntimeError") and
                    "failed with ValueError" in v[0][2]) for v in values), values
    if how == "dests":
        assert re.search(r"the owners of shared blocks planned by rank [01] are malformed: "
                         r"destination 5 of fragment 0 is not a group rank \(0\.\.1\)",
                         values[1][0][2]), values[1]
    elif how == "dealt":
        assert any("rank 1 sent a malformed fragment: row 0 (entry, offset, nbytes) "
                   in v[0][2] for v in values), values
    assert all(after == 2 for _first, after in values)
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if "dext" in n]


def _dies_while_owners_are_planned(out):
    import signal
    import time

    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export import edges

    if dist.get_rank() == 1:  # rank 1 dies between the collectives that plan the owners
        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)

        edges._owners.plan_dealt = die
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.arange(300 * 1001, dtype=torch.float32)
                                    .reshape(300, 1001), mesh, [Shard(0)])}
    start = time.monotonic()
    outcome = _outcome(lambda: dx.export_hf_checkpoint(state, out, writers="all"))
    return outcome, time.monotonic() - start


def test_a_rank_dying_while_the_owners_are_planned_is_named_by_every_survivor(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / E.WEIGHTS_NAME).write_bytes(b"an earlier checkpoint")
    res = run_ranks(_dies_while_owners_are_planned, 3, str(out), pg_timeout=120, timeout=120)
    assert res[1].exit_code == -9
    for r in (0, 2):
        outcome, took = res[r].value
        assert outcome[:2] == ("raised", "RuntimeError") and "rank 1 died" in outcome[2], outcome
        assert took < 10, took
    assert (out / E.WEIGHTS_NAME).read_bytes() == b"an earlier checkpoint"
    assert not [n for n in os.listdir(tmp_path) if "dext" in n]


def _owner_disk_fills(out, layout):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    r = dist.get_rank()
    if r == 2:  # its disk fills once it writes the shared blocks (or TP regions) it owns
        def full(self, data, rows):
            raise OSError(28, "No space left on device")

        E.FileSink.write_edges = full
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(3)
    if layout == "tp":  # rows of 2 KiB a rank: 3 x 4.5 MiB in TP regions, a third rank 2's
        state = {k: distribute_tensor(torch.randn(768, 1536, generator=g), mesh, [Shard(1)])
                 for k in ("a", "b", "c")}
    else:
        state = {k: distribute_tensor(torch.randn(999, 77, generator=g), mesh, [Shard(0)])
                 for k in ("a", "b", "c")}
    return _export_then_use_the_group(state, out, 2**20, "all")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_an_owner_whose_disk_fills_while_writing_shared_blocks_fails_every_rank(layout,
                                                                                tmp_path):
    # The exchange's rounds go on to the end (no peer waits on the failed rank), then the
    # failure is agreed: every rank raises naming it, the earlier checkpoint stays.
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier checkpoint")
    values = assert_all_ok(run_ranks(_owner_disk_fills, 3, str(out), layout))
    assert values[2][0][:2] == ("raised", "OSError"), values[2]
    for r in (0, 1):
        assert values[r][0][:2] == ("raised", "RuntimeError") and \
            "rank 2 failed with OSError" in values[r][0][2], values[r]
    assert all(after == 3 for _first, after in values)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"an earlier checkpoint"
    assert not [n for n in os.listdir(tmp_path) if "dext" in n]


def _tiny_chunks(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(4)
    state = {k: distribute_tensor(torch.randn(999, 77, generator=g), mesh, [Shard(0)])
             for k in ("a", "b")}
    writes = _recording_writes(
        lambda: dx.export_hf_checkpoint(state, out, chunk_bytes=1000, writers="all"))
    return _blocks_written(writes)


def test_transport_chunks_under_a_block_still_give_each_block_one_writer(tmp_path):
    # chunk_bytes=1000: the link's messages are 1000 bytes, but a rank's own runs are cut
    # in whole blocks, so only their ends are shared (and each shared block has one writer).
    out = tmp_path / "ckpt"
    blocks = assert_all_ok(run_ranks(_tiny_chunks, 3, str(out)))
    for a, b in itertools.combinations(range(3), 2):
        assert not blocks[a] & blocks[b], (a, b)
    data = (out / E.WEIGHTS_NAME).read_bytes()
    assert len(set().union(*blocks)) == -(-len(data) // 4096)  # every block written
    got = _read_checkpoint(out)
    g = torch.Generator().manual_seed(4)
    for k in ("a", "b"):
        assert torch.equal(got[k], torch.randn(999, 77, generator=g)), k


def _short_rows_every_rank_writes(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export import owners as export_owners

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    tiny = export_owners.SHORT_RUN = 512  # (at most 20 fragments a block)
    # Shard(1) rows of exactly SHORT_RUN bytes (8 a block, from every rank in turn), of
    # 1.5 KiB (which the 4 KiB chunks cut inside a run), and of one float under SHORT_RUN.
    state = {
        "at_tiny": distribute_tensor(torch.randn(300, tiny // 4 * world, generator=g),
                                     mesh, [Shard(1)]),
        "rows": distribute_tensor(torch.randn(301, 384 * world, generator=g), mesh,
                                  [Shard(1)]),
        "under": distribute_tensor(torch.randn(50, (tiny // 4 - 1) * world, generator=g),
                                   mesh, [Shard(1)]),
    }
    full = {k: v.full_tensor() for k, v in state.items()}
    got = {}
    for writers in ("all", "dst"):
        where = os.path.join(out, writers)
        writes = _recording_writes(lambda w=writers, o=where: dx.export_hf_checkpoint(
            state, o, chunk_bytes=4096, writers=w))
        got[writers] = (_blocks_written(writes), sum(n for _f, _o, n in writes))
    return got, full


def test_tp_rows_down_to_the_short_run_threshold_are_written_where_they_are_held(tmp_path):
    # SHORT_RUN lowered to 512 bytes (20 fragments a block at most): runs of a Shard(1)
    # layout at least that long are written by their holders, every block once, by the
    # holder of most of its bytes; shorter ones go to dst. The files are the single
    # writer's, byte for byte.
    world = 3
    values = assert_all_ok(run_ranks(_short_rows_every_rank_writes, world, str(tmp_path),
                                     timeout=120))
    data = (tmp_path / "all" / E.WEIGHTS_NAME).read_bytes()
    assert data == (tmp_path / "dst" / E.WEIGHTS_NAME).read_bytes()
    blocks = [got["all"][0] for got, _full in values]
    for a, b in itertools.combinations(range(world), 2):
        assert not blocks[a] & blocks[b], (a, b, sorted(blocks[a] & blocks[b])[:5])
    assert len(set().union(*blocks)) == -(-len(data) // 4096)  # every block written
    # Every rank writes a part: the long TP rows' blocks are spread over their holders
    # (with "dst", the others write nothing).
    wrote_all = [got["all"][1] for got, _full in values]
    wrote_dst = [got["dst"][1] for got, _full in values]
    assert min(wrote_all[1:]) > len(data) // (3 * world), wrote_all
    assert max(wrote_dst[1:]) == 0 and wrote_dst[0] >= len(data), wrote_dst
    got = _read_checkpoint(tmp_path / "all")
    for k, v in values[0][1].items():
        assert torch.equal(got[k], v), k


def _tp_rows_by_region(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(6)
    # 2 x 4 MiB of fp32 Shard(1) rows, each rank's part of a row 2 KiB
    state = {f"w{i}": distribute_tensor(torch.randn(1024, 1024, generator=g), mesh,
                                        [Shard(1)]) for i in range(2)}
    got = {}
    for writers in ("all", "dst"):
        sent, real = [0], dist.isend

        def counting(tensor, *args, sent=sent, real=real, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return real(tensor, *args, **kwargs)

        dist.isend = counting
        try:
            writes = _recording_writes(lambda w=writers: dx.export_hf_checkpoint(
                state, os.path.join(out, w), writers=w))
        finally:
            dist.isend = real
        got[writers] = (sum(n for _f, _o, n in writes), sent[0])
    return got, {k: v.full_tensor() for k, v in state.items()}


def test_tp_rows_are_written_by_region_each_rank_writing_and_sending_its_share(tmp_path):
    # World 2, TP: every region is half each rank's, so the regions alternate between
    # them: each writes about half of the file and sends about half of its own bytes (the
    # other's regions), where with one writer rank 1 sends all of its bytes and writes none.
    values = assert_all_ok(run_ranks(_tp_rows_by_region, 2, str(tmp_path), timeout=120))
    data = (tmp_path / "all" / E.WEIGHTS_NAME).read_bytes()
    assert data == (tmp_path / "dst" / E.WEIGHTS_NAME).read_bytes()
    got = _read_checkpoint(tmp_path / "all")
    for k, v in values[0][1].items():
        assert torch.equal(got[k], v), k
    mine = 8 * 2**20 // 2  # each rank's bytes
    for r, (by, _full) in enumerate(values):
        wrote, sent = by["all"]
        assert 0.4 * len(data) < wrote < 0.6 * len(data), (r, by)
        assert 0.4 * mine < sent < 0.6 * mine, (r, by)
    assert values[1][0]["dst"][0] == 0 and values[1][0]["dst"][1] >= mine, values[1][0]


@pytest.mark.parametrize("world", [3, 5])
def test_owners_planned_by_the_ranks_blocks_are_dealt_to_equal_one_plan_of_them_all(world):
    # One process: the ranks' fragments (Shard(0) runs of two entries sharing one list of
    # pieces at different alignments, column blocks of many long runs, a file's end), dealt
    # out by block; each rank's plan of what it was dealt, put together, equals the plan of
    # every fragment at once (owners, and receipts row for row in their order), and each
    # rank plans only a part of them.
    from distributed_ext.export import edges, owners, prepare
    from distributed_ext.export.messages import edge_table

    shapes = {"rows": (3001, 700), "long_cols": (40, 60000), "tail": (777, 333)}
    entries, bases, base = [], [], 4000
    for key, shape in shapes.items():
        e = E.Entry(key, torch.float32, shape, index=len(entries))
        for r in range(world):
            if key == "long_cols":
                w = shape[1] // world
                block = E.Block((0, r * w), (shape[0], w if r < world - 1 else shape[1] - r * w))
            else:
                per = -(-shape[0] // world)
                a, b = min(r * per, shape[0]), min((r + 1) * per, shape[0])
                block = E.Block((a, 0), (b - a, shape[1]))
            if block.numel:
                e.pieces.append(E.Piece(r, block, block.numel * 4))
        entries.append(e)
        bases.append(base)
        base += e.nbytes
        if key == "rows":  # shares its list of pieces, as FSDP2's keys do
            entries.append(E.Entry("rows2", torch.float32, shape, e.pieces,
                                   index=len(entries)))
            bases.append(base + 100)
            base += e.nbytes + 100
    bases, file_of, sizes = torch.tensor(bases), torch.zeros(len(entries), dtype=torch.int64), [base]
    nbytes = torch.tensor([e.nbytes for e in entries])
    tables = []
    for r in range(world):
        mine = [(e, p) for e in entries for p in e.pieces
                if p.rank == r and not prepare._short(e, p)]
        own = edge_table(E.plan_messages(mine, 2**20, bases), bases, 4096)[0]
        tables.append(edges.fragment_table(own))
    assert all(len(t) > 2 for t in tables)
    dests = owners.plan_owners(tables, file_of, bases, sizes, 0, 4096)
    receipts = owners.plan_receipts(tables, dests)
    # Dealt out: rank c gets, from each rank, its rows of the blocks dealt to c.
    to = [owners.coordinators(t, file_of, bases, sizes, world, 4096) for t in tables]
    got_dests = [torch.full((len(t),), -9) for t in tables]
    got_receipts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for c in range(world):
        received = [t[to[r] == c][:, [0, 1, 3]] for r, t in enumerate(tables)]
        assert 0 < sum(map(len, received)) < sum(map(len, tables))  # a part of them
        d, rec, fault = owners.plan_dealt(received, c, file_of, bases, sizes, nbytes, 0, 4096)
        assert fault is None
        for r in range(world):
            got_dests[r][to[r] == c] = d[r]
            got_receipts[r].append(rec[r])
    for r in range(world):
        assert torch.equal(got_dests[r], dests[r]), r
        rec = torch.cat(got_receipts[r])
        rec = rec[torch.sort(owners.order_key(rec[:, 1], rec[:, 2]), stable=True).indices]
        rec = rec[torch.sort(rec[:, 0], stable=True).indices]
        assert torch.equal(rec, receipts[r]), r
    assert any(len(t) for t in receipts[1:])  # not every shared block is dst's
    # A row dealt to the wrong rank, or past its entry's end, is refused by the rank it
    # reaches: that sender's fragments all get destination -1.
    wrong = [t[to[r] == 1][:, [0, 1, 3]] for r, t in enumerate(tables)]
    d, _rec, fault = owners.plan_dealt(wrong, 0, file_of, bases, sizes, nbytes, 0, 4096)
    assert fault is not None and fault[0] == 0 and "dealt to this rank" in fault[1]
    assert bool((d[0] == -1).all())
    past = [t[to[r] == 0][:, [0, 1, 3]].clone() for r, t in enumerate(tables)]
    r = next(r for r in range(1, world) if len(past[r]))
    past[r][0, 1] = nbytes[past[r][0, 0]]
    assert owners.plan_dealt(past, 0, file_of, bases, sizes, nbytes, 0, 4096)[2][0] == r
    # Counts every rank announced (from r, for c), checked alike by all: a negative one or
    # a column past its bound is a ValueError naming the rank it was for.
    table = torch.tensor([[1, 2], [3, 4]])
    owners.check_counts(table, [4, 6], "rows for", "x", [10, 11])
    with pytest.raises(ValueError, match=r"announced \[2, 4\] rows for rank 11 .* at most 5"):
        owners.check_counts(table, [4, 5], "rows for", "x", [10, 11])
    with pytest.raises(ValueError, match=r"announced \[1, -3\] rows for rank 10"):
        owners.check_counts(torch.tensor([[1, 2], [-3, 4]]), 100, "rows for", "x", [10, 11])
