"""export_hf_checkpoint and gather_full_state on real gloo ranks (FSDP2 models, DTensors, plain
state dicts), loaded back by safetensors and transformers, and their failure and memory rules."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, outcome, rss_growth_during, run_ranks

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export.transport import stager as export_stager

pytest.importorskip("transformers", reason="the export tests build Hugging Face models")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

from hf_models import (  # noqa: E402
    build,
    logits_on_threads,
    make_input,
    read_checkpoint,
    train_step,
)


def _export_fsdp2(family, out, reference_dir, max_shard):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = build(family)
    dx.fsdp2_wrap(model)
    train_step(model)  # the shards now differ from any freshly built model
    dx.export_hf_checkpoint(model, out, max_shard_size=max_shard)
    with torch.no_grad():
        logits = model(make_input()).logits
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
    # config.json as save_pretrained writes it (architectures and dtype included).
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "ckpt" / name).read_text()) == \
            json.loads((tmp_path / "reference" / name).read_text()), name
    written, reference = read_checkpoint(out), read_checkpoint(reference_dir)
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
    assert torch.equal(logits_on_threads(loaded, threads), logits)


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
    train_step(model)
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
    written, reference = read_checkpoint(out), read_checkpoint(reference_dir)
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
    written = read_checkpoint(out)
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
    written = read_checkpoint(out)
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
    from torch.distributed.tensor import DTensor, Partial, Shard

    r = dist.get_rank()
    if kind == "shape":
        state = {"w": torch.zeros(4 if r == 0 else 5)}
    elif kind == "dtype":
        state = {"w": torch.zeros(4, dtype=torch.complex128 if r == 1 else torch.float32)}
    elif kind == "placements":  # one mesh, two layouts: the message shows each rank's mesh
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        placement = Shard(0) if r == 0 else _StridedShard(0, split_factor=2)
        state = {"w": DTensor.from_local(torch.ones(4, 3), mesh, [placement], run_check=False)}
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state = {"w": DTensor.from_local(torch.ones(3), mesh, [Partial()])}
    return outcome(lambda: dx.export_hf_checkpoint(state, out))


@pytest.mark.parametrize("kind, own, text", [
    ("shape", "ValueError", "state['w'] differs between ranks (rank 0: float32 (4,); rank 1: "),
    ("dtype", "TypeError", "complex128"),
    ("partial", "ValueError", "Partial placement"),
    ("placements", "ValueError", "state['w'] differs between ranks (rank 0: float32 (8, 3) "
     "[Shard(dim=0)] on mesh of ranks [0, 1] shape [2]; rank 1: float32 (8, 3) "
     "[_StridedShard(dim=0, sf=2)] on mesh of ranks [0, 1] shape [2])"),
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


def _peak_during_export(out, nbytes):
    r = dist.get_rank()
    state = {f"layer{i}.{r}": torch.full((nbytes // 4 // 8,), float(i)) for i in range(8)}
    written = []
    real_commit = E.FileSink.commit

    def commit(self):
        written.append((self.direct_bytes, self.total, self.files[0].direct_capable))
        real_commit(self)

    E.FileSink.commit = commit
    grown = rss_growth_during(lambda: dx.export_hf_checkpoint(state, out, writers="dst"))
    return grown, written


def test_dst_memory_stays_a_few_chunks_whatever_the_model_size(tmp_path):
    size = 192 * 2**20  # per rank; dst receives 384 MiB from the others
    values = assert_all_ok(run_ranks(_peak_during_export, 3, str(tmp_path / "big"), size,
                                     timeout=240))
    grown, ((direct, total, can),) = values[0]
    # dst: two 16 MiB chunks per sender, two 16 MiB bounce buffers (measured: 73 MiB at
    # peak), metadata; never the model.
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
    return rss_growth_during(lambda: dx.export_hf_checkpoint(state, out, writers="all"))


def test_tp_regions_hold_a_few_regions_on_every_rank(tmp_path):
    # Every rank assembles the regions it owns as their rows arrive, in file order: it
    # holds a few 1 MiB regions and one message per peer each way, never its 128 MiB share
    # of the file (bounded at 64 MiB of regions whatever the order).
    out = tmp_path / "tp"
    values = assert_all_ok(run_ranks(_peak_during_tp_export, 2, str(out), timeout=120))
    assert max(values) < 48 * 2**20, [v / 2**20 for v in values]
    got = read_checkpoint(out)
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
            return model(make_input().cuda()).logits.cpu(), grown, _staging.cached_bytes()


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
        assert (loaded(make_input()).logits - logits).abs().max().item() < 1e-4


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
            def write(self, data, rows, **kw):
                calls.append(1)
                if len(calls) == at:
                    die()
                real(self, data, rows, **kw)
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
    # Nothing under a checkpoint's name: dst removed its stage, or died with it (a hidden
    # .dext-export-* folder inside the directory and its lock file, which the next export
    # removes).
    names = os.listdir(out) if out.exists() else []
    assert not [n for n in names if not n.startswith(".dext-export")], names
    if victim != 0:
        assert names == []
    if victim != 0 or writers != "dst":  # no stage left: with every rank writing, the
        # survivors see dst's stage and remove it when dst died (dst's own, else)
        assert not names and not [n for n in os.listdir(tmp_path) if "dext" in n], names


def test_mapped_tp_rows_hold_one_messages_pages_on_every_rank(ram_path):
    # On a RAM filesystem every rank copies its own rows into a mapping of the file, one
    # message's span at a time (unmapped before the next): its resident memory counts those
    # pages while it copies (16 MiB messages of 2 KiB rows: 32 MiB of pages), never its
    # 128 MiB share of the file.
    out = os.path.join(ram_path, "tp")
    values = assert_all_ok(run_ranks(_peak_during_tp_export, 2, out, timeout=120))
    assert max(values) < 48 * 2**20, [v / 2**20 for v in values]
    got = read_checkpoint(out)
    assert all(torch.equal(got[f"w{i}"], torch.full((8192, 1024), float(i))) for i in range(8))
