"""A ModelOpt-quantized FSDP2 model exported from its shards (export/plan/quantized.py),
compared tensor by tensor, byte for byte, and JSON file by JSON file, with ModelOpt's own
one-process ``export_hf_checkpoint`` of the same quantized model (a dense Llama in seven
formats, Qwen3-MoE's fused experts in two); a layout whose shard boundary splits a packed
pair of rows refused on every rank."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import pytest
import torch
from harness import assert_all_ok, nccl_group_of_one, rss_growth_during, run_ranks

# (found, not imported: a rank imports this module, and ModelOpt must not be loaded before
# the test's own code decides how)
if importlib.util.find_spec("modelopt") is None:
    pytest.skip("needs nvidia-modelopt (the [test] extra)", allow_module_level=True)

import hf_models  # noqa: E402

FORMATS = ["FP8_DEFAULT_CFG", "FP8_PER_CHANNEL_PER_TOKEN_CFG", "INT8_WEIGHT_ONLY_CFG",
           "NVFP4_DEFAULT_CFG", "INT4_AWQ_CFG", "INT8_SMOOTHQUANT_CFG", "W4A16_NVFP4_CFG"]
# (family, format): the dense Llama in every format; Qwen3-MoE's fused experts (split per
# expert, each with its expert's quantizer) in FP8 and NVFP4.
CASES = [("llama", f) for f in FORMATS] + [("qwen3-moe", "FP8_DEFAULT_CFG"),
                                           ("qwen3-moe", "NVFP4_DEFAULT_CFG"),
                                           ("qwen3-moe", "NVFP4_DEFAULT_CFG+experts-off")]
# INT4 AWQ groups 128 columns: every linear's input a multiple of 128, and every FSDP2 row
# boundary even at world 2 and 3 (ceil(rows / world) even for 384, 192, 768 rows).
DIMS = dict(hidden_size=384, intermediate_size=768, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2)
MOE_DIMS = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                num_hidden_layers=1)
# ceil(896 / 3) = 299: at world 3 FSDP2 cuts gate/up_proj's rows inside a packed pair.
ODD_DIMS = {**DIMS, "intermediate_size": 896}


def _quantized(family: str, fmt: str, dims: dict | None = None, device: str = "cpu"):
    """A tiny model of ``family`` in bf16, quantized by ModelOpt's own ``mtq.quantize`` (the
    same weights and calibration batch in every process; 128 tokens reach every expert),
    calibrated on ``device`` (where it then lives)."""
    warnings.filterwarnings("ignore")
    import modelopt.torch.quantization as mtq

    dims = dims or (DIMS if family == "llama" else MOE_DIMS)
    model = hf_models.build(family, 0, dtype=torch.bfloat16, **dims).to(torch.bfloat16)
    model = model.to(device)
    model.config.architectures = [type(model).__name__]
    batch = torch.randint(0, 130, (4, 32), generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, _config(fmt), lambda m: m(batch.to(device)))
    return model


def _config(fmt: str) -> dict:
    """ModelOpt's config ``fmt``; "+experts-off": with the experts' quantizers disabled (the
    fused experts then written in bf16 beside quantized attention)."""
    import copy

    import modelopt.torch.quantization as mtq

    name, _, variant = fmt.partition("+")
    config = copy.deepcopy(getattr(mtq, name))
    if variant == "experts-off":
        config["quant_cfg"].append({"quantizer_name": "*experts*", "enable": False})
    return config


def _modelopt_exports(base: str, cases: list[tuple[str, str]]) -> None:
    """ModelOpt's own export, one process, no process group: the reference files; and ours
    of the first case in the same process, with no process group at all."""
    from modelopt.torch.export import export_hf_checkpoint

    import distributed_ext as dx

    for family, fmt in cases:
        export_hf_checkpoint(_quantized(family, fmt), dtype=torch.bfloat16,
                             export_dir=os.path.join(base, "ref", family, fmt))
    dx.export_hf_checkpoint(_quantized(*cases[0]), os.path.join(base, "alone"))


def _export_shards(base: str, cases: list[tuple[str, str]], writers: str,
                   ram: str | None = None) -> dict:
    """Each case: quantized, ``fsdp2_wrap``, exported from the shards (and with ``ram``, by
    every rank into that RAM filesystem too: the files mapped, moved beside the others as
    "mapped"); then the layout that splits a pair (outcome per rank)."""
    import shutil

    import torch.distributed as dist

    import distributed_ext as dx
    from distributed_ext.export import rounds
    from distributed_ext.export.plan import probes, row_kernels

    probed: list[str] = []  # (the weights this rank probes)
    probe_once = probes._probe_once
    probes._probe_once = lambda w, *args: probed.append(w.key) or probe_once(w, *args)
    made: list[str] = []  # (those it asks ModelOpt to probe: a probe may serve two weights)
    probe = probes._probe
    probes._probe = lambda w, *args: made.append(w.key) or probe(w, *args)
    import modelopt.torch.export.quant_utils as quant_utils

    configs = [0]  # (how often this rank asks ModelOpt for the model's quantization config)
    get_config = quant_utils.get_quant_config
    quant_utils.get_quant_config = lambda *args: \
        configs.__setitem__(0, configs[0] + 1) or get_config(*args)
    resolved = [0]  # (how often the export resolves the model's state)
    resolve = rounds.resolve_state
    rounds.resolve_state = lambda *args: resolved.__setitem__(0, resolved[0] + 1) or \
        resolve(*args)
    import modelopt.torch.export.unified_export_hf as unified

    gathered = [0]  # (how often ModelOpt's own fusing, which unshards each group, runs)
    requantize = unified.requantize_resmooth_fused_llm_layers
    unified.requantize_resmooth_fused_llm_layers = lambda *args: \
        gathered.__setitem__(0, gathered[0] + 1) or requantize(*args)
    out: dict = {"probed": {}, "made": {}, "resolved": {}, "gathered": {}, "configs": {},
                 "tables": {}}
    for family, fmt in cases:
        model = _quantized(family, fmt)
        dx.fsdp2_wrap(model)
        probed.clear()
        made.clear()
        resolved[0] = gathered[0] = configs[0] = 0
        dx.export_hf_checkpoint(model, os.path.join(base, "ours", family, fmt), writers=writers)
        out["probed"][family, fmt] = list(probed)
        out["made"][family, fmt] = list(made)
        out["configs"][family, fmt] = configs[0]
        out["resolved"][family, fmt] = resolved[0]
        out["gathered"][family, fmt] = gathered[0]
        out["tables"][family, fmt] = row_kernels.TABLES.count
        if ram is not None:
            dx.export_hf_checkpoint(model, os.path.join(ram, family, fmt), writers="all")
    if ram is not None and dist.get_rank() == 0:
        shutil.move(ram, os.path.join(base, "mapped"))
    if dist.get_world_size() == 2:  # rank 1 calibrated otherwise: agreed, refused
        model = _quantized("llama", "FP8_DEFAULT_CFG")
        dx.fsdp2_wrap(model)
        if dist.get_rank() == 1:
            model.model.layers[0].mlp.down_proj.input_quantizer.amax *= 2
        try:
            dx.export_hf_checkpoint(model, os.path.join(base, "differ"))
            out["differ"] = ("ok",)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            out["differ"] = (type(exc).__name__, str(exc))
    if dist.get_world_size() == 3:
        model = _quantized("llama", "INT4_AWQ_CFG", ODD_DIMS)
        dx.fsdp2_wrap(model)
        bad = os.path.join(base, "odd")
        try:
            dx.export_hf_checkpoint(model, bad)
            out["odd"] = ("ok",)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            out["odd"] = (type(exc).__name__, str(exc), os.path.exists(bad) and os.listdir(bad))
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.fixture(scope="module")
def modelopt_refs(tmp_path_factory) -> str:
    """ModelOpt's own one-process exports of every case (and ours with no group), made once
    for the module: the reference files are the same whatever the world of the test."""
    base = str(tmp_path_factory.mktemp("modelopt-refs"))
    assert_all_ok(run_ranks(_modelopt_exports, 1, base, CASES, init=False, timeout=300))
    return base


@pytest.mark.parametrize("world,writers", [(2, "all"), (3, "dst")])
def test_quantized_fsdp2_export_equals_modelopts_own(world, writers, tmp_path, ram_path,
                                                      modelopt_refs):
    # With every rank writing, also into a RAM filesystem, where the files are mapped.
    base, ram = str(tmp_path), os.path.join(ram_path, "q") if writers == "all" else None
    results = assert_all_ok(run_ranks(_export_shards, world, base, CASES, writers, ram,
                                      timeout=300))
    for family, fmt in CASES:
        ref_dir = os.path.join(modelopt_refs, "ref", family, fmt)
        our_dir = os.path.join(base, "ours", family, fmt)
        ref, ours = hf_models.read_checkpoint(ref_dir), hf_models.read_checkpoint(our_dir)
        assert sorted(ours) == sorted(ref), (fmt, sorted(set(ours) ^ set(ref)))
        differ = [k for k in ref if not _same_bytes(ref[k], ours[k])]
        assert not differ, (fmt, differ)
        if ram is not None:
            mapped = hf_models.read_checkpoint(os.path.join(base, "mapped", family, fmt))
            assert sorted(mapped) == sorted(ref), (fmt, "mapped")
            assert all(_same_bytes(ref[k], mapped[k]) for k in ref), (fmt, "mapped")
        # The quantized weights are there (not the high-precision ones) in every format.
        down = "model.layers.0.mlp." + ("down_proj" if family == "llama" else "experts.3.down_proj")
        if fmt.endswith("experts-off"):
            assert ours[down + ".weight"].dtype == torch.bfloat16, fmt
            down = "model.layers.0.self_attn.o_proj"
        assert ours[down + ".weight"].dtype != torch.bfloat16, fmt
        assert down + ".weight_scale" in ours, fmt
        assert not any("quantizer" in k for k in ours), fmt
        for name in ("hf_quant_config.json", "config.json"):
            with open(os.path.join(ref_dir, name)) as f, open(os.path.join(our_dir, name)) as g:
                assert json.load(g) == json.load(f), (fmt, name)
        # ModelOpt's probe of each quantized weight ran once, on one rank, each rank a share:
        # the last rank less, as it also asks ModelOpt for the quantization config
        # (once, for every rank: the JSON files compared above are built from it).
        quantized = {k for k in ours if k.endswith(".weight") and
                     k.removesuffix("weight") + "weight_scale" in ours}
        probed = [r["probed"][family, fmt] for r in results]
        assert sorted(k for keys in probed for k in keys) == sorted(quantized), fmt
        # (balanced in the probes made: a probe may serve two weights)
        made = [r["made"][family, fmt] for r in results]
        others = list(map(len, made[:-1]))
        assert max(others) - min(others) <= 1 and len(made[-1]) <= min(others), (fmt, made)
        assert [r["configs"][family, fmt] for r in results] == [0] * (world - 1) + [1], fmt
        # ModelOpt is asked once a stand-in: a gated expert's up projection takes its gate's
        # probe, the two sharing one weight quantizer of a per-tensor amax (FP8's, and
        # NVFP4's global one: its block scales come from the rows).
        experts = family == "qwen3-moe" and not fmt.endswith("experts-off")
        shared = 0
        for r in results:
            mine, asked = r["probed"][family, fmt], r["made"][family, fmt]
            assert len(set(asked)) == len(asked) and set(asked) <= set(mine), fmt
            pairs = {k for k in mine if ".experts." in k and k.endswith(".up_proj.weight")
                     and k.replace(".up_proj.", ".gate_proj.") in mine}
            assert set(mine) - set(asked) == (pairs if experts else set()), fmt
            shared += len(pairs)
        assert shared > 0 if experts else shared == 0, fmt
        # The state is resolved once where the probes are made in the first round (after
        # ModelOpt's steps before it quantizes); again after the pre-quant scales' fusing.
        once = 2 if fmt in ("INT4_AWQ_CFG", "INT8_SMOOTHQUANT_CFG") else 1
        assert [r["resolved"][family, fmt] for r in results] == [once] * world, fmt
        # Every case's shared inputs are fused from the rows (the Llama's AWQ and SmoothQuant
        # scales by Resmooth), never by ModelOpt's own function, which unshards each group.
        assert [r["gathered"][family, fmt] for r in results] == [0] * world, fmt
        if fmt == "FP8_DEFAULT_CFG":  # every bf16 FP8 weight divided: no table kept
            assert [r["tables"][family, fmt] for r in results] == [0] * world
    alone = hf_models.read_checkpoint(os.path.join(modelopt_refs, "alone"))
    ref = hf_models.read_checkpoint(os.path.join(modelopt_refs, "ref", *CASES[0]))
    assert sorted(alone) == sorted(ref) and all(_same_bytes(ref[k], alone[k]) for k in ref)
    if world == 2:
        for differ in (r["differ"] for r in results):
            assert differ[0] == "ValueError", differ
            assert "the quantized model (formats, shapes, scales) differs between ranks" in \
                differ[1], differ[1]
    if world == 3:
        for odd in (r["odd"] for r in results):
            assert odd[0] == "ValueError", odd
            assert "mlp.gate_proj (int4_awq)" in odd[1], odd[1]
            assert "holds its rows 0..298 (299 rows)" in odd[1], odd[1]  # (counted right)
            # What a user of fsdp2_wrap can do: the worlds whose boundaries fall between pairs.
            assert "FSDP2 (fsdp2_wrap) gives each rank ceil(896 / world) rows: at world 1, 2, " \
                "4, 5, 6, 7 every boundary" in odd[1], odd[1]
            assert "multiple of 2" in odd[1], odd[1]
            assert not odd[2], odd  # nothing written


# The bench's two formats, and INT4 AWQ (its pre-quant scales fused from the GPU's rows first).
GPU_FORMATS = ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT4_AWQ_CFG"]
_HOST_KERNELS = ("fp8_divide", "map_through_table", "nvfp4_rows", "nvfp4_scales", "int4_rows")


def _gpu_exports(base: str, fmts: list[str], world: int) -> list[str]:
    """For each format, the Llama calibrated on the GPU, ``fsdp2_wrap``-ped there and
    exported by us: at world 1 in an NCCL group of one, after ModelOpt's own export of the
    same model (the reference); at world 2 over gloo (NCCL refuses two ranks on one GPU),
    every rank writing its own bytes. Returns the host kernels the export called (none
    should run: a GPU's rows are quantized on the GPU)."""
    import contextlib

    from modelopt.torch.export import export_hf_checkpoint

    import distributed_ext as dx
    from distributed_ext.export.plan import row_kernels

    called: list[str] = []
    for name in _HOST_KERNELS:
        real = getattr(row_kernels, name)
        setattr(row_kernels, name,
                lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k))
    # ModelOpt compiles its CUDA fake-quant extensions on first use (minutes of a lent GPU's
    # time): its torch fallbacks calibrate instead, the reference and ours alike.
    from modelopt.torch.quantization import extensions

    for get in (extensions.get_cuda_ext, extensions.get_cuda_ext_fp8, extensions.get_cuda_ext_mx):
        get.extension = None
    torch.cuda.set_device(0)
    group = nccl_group_of_one(os.path.join(base, "group")) if world == 1 else \
        contextlib.nullcontext()
    with group:
        for fmt in fmts:
            if world == 1:
                export_hf_checkpoint(_quantized("llama", fmt, device="cuda"),
                                     dtype=torch.bfloat16, export_dir=os.path.join(base, "ref", fmt))
            model = _quantized("llama", fmt, device="cuda")
            dx.fsdp2_wrap(model)
            dx.export_hf_checkpoint(model, os.path.join(base, f"ours-{world}", fmt),
                                    writers="all")
    return called


@pytest.mark.cuda
def test_a_gpu_calibrated_model_is_quantized_on_the_gpu_as_modelopt_exports_it(tmp_path):
    # The compiled core's row kernels take host rows: a GPU's rows are computed there by
    # ModelOpt's own arithmetic (its probes too, beside the quantizers' GPU buffers), then
    # cross to the host as quantized bytes; at world 2 each rank probes its share.
    base = str(tmp_path)
    (called,) = assert_all_ok(run_ranks(_gpu_exports, 1, base, GPU_FORMATS, 1, init=False,
                                        timeout=300))
    assert called == [], called
    for called in assert_all_ok(run_ranks(_gpu_exports, 2, base, GPU_FORMATS, 2,
                                          timeout=300)):
        assert called == [], called
    for fmt in GPU_FORMATS:
        ref_dir = os.path.join(base, "ref", fmt)
        ref = hf_models.read_checkpoint(ref_dir)
        for world in (1, 2):
            our_dir = os.path.join(base, f"ours-{world}", fmt)
            ours = hf_models.read_checkpoint(our_dir)
            assert sorted(ours) == sorted(ref), (fmt, world, sorted(set(ours) ^ set(ref)))
            assert not [k for k in ref if not _same_bytes(ref[k], ours[k])], (fmt, world)
            assert ours["model.layers.0.mlp.down_proj.weight"].dtype != torch.bfloat16, fmt
            for name in ("hf_quant_config.json", "config.json"):
                with open(os.path.join(ref_dir, name)) as f, \
                        open(os.path.join(our_dir, name)) as g:
                    assert json.load(g) == json.load(f), (fmt, world, name)


# One layer of a 2048 x 16384 MLP in bf16: 0.2 GB of weights, 0.1 GB a rank at world 2; the
# largest weight 64 MiB, a rank's shard of it 32 MiB (its FP8 copy 16 MiB).
BIG = dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=1,
           num_attention_heads=16, num_key_value_heads=8)
CHUNK = 4 * 2**20


def _peaks_plain_then_quantized(base: str, fmt: str) -> tuple[int, int]:
    """RSS growth of the export of an FSDP2 model, then of the same model quantized (4 MiB
    transport chunks). Allocations of 128 KiB and more are mapped and unmapped whole
    (glibc's M_MMAP_THRESHOLD fixed): RSS then follows what is alive, not what one thread's
    heap kept of earlier work (which moved the figures by 12 MiB from run to run)."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    warnings.filterwarnings("ignore")
    import modelopt.torch.quantization as mtq

    import distributed_ext as dx

    model = hf_models.build("llama", 0, dtype=torch.bfloat16, **BIG).to(torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    dx.fsdp2_wrap(model)
    plain = rss_growth_during(lambda: dx.export_hf_checkpoint(
        model, os.path.join(base, "plain"), writers="dst", chunk_bytes=CHUNK), trim=True)
    batch = hf_models.make_input()
    mtq.quantize(model, getattr(mtq, fmt), lambda m: m(batch))
    quantized = rss_growth_during(lambda: dx.export_hf_checkpoint(
        model, os.path.join(base, "quantized"), writers="dst", chunk_bytes=CHUNK), trim=True)
    return plain, quantized


@pytest.mark.parametrize("fmt", ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG"])
def test_a_quantized_export_holds_a_few_chunks_more_than_a_plain_one(fmt, tmp_path):
    # Each rank computes the quantized bytes of a message from only the rows that make
    # them, 1 MiB of rows at a time: its peak grows by the messages in flight (at most three
    # chunks) and the arithmetic's temporaries (ModelOpt's NVFP4 makes several float32
    # copies of its rows) -- never by a full weight (64 MiB), however large the weights.
    values = assert_all_ok(run_ranks(_peaks_plain_then_quantized, 2, str(tmp_path), fmt,
                                     timeout=300))
    for plain, quantized in values:
        assert quantized - plain < 3 * CHUNK + 24 * 2**20, (plain / 2**20, quantized / 2**20)
    written = hf_models.read_checkpoint(str(tmp_path / "quantized"))
    assert written["model.layers.0.mlp.gate_proj.weight"].shape[0] == 16384


def _export_twice_with_an_expert_turned_on(base: str) -> None:
    """One process: a quantized MoE with the weight quantizers of one expert's down
    projection and of a linear disabled, exported; enabled again, exported again (what an
    export remembers of the model is forgotten by the next)."""
    import distributed_ext as dx

    model = _quantized("qwen3-moe", "FP8_DEFAULT_CFG")
    layer = model.model.layers[0]
    quantizers = (layer.mlp.experts.down_proj_weight_quantizers[3],
                  layer.self_attn.o_proj.weight_quantizer)
    for quantizer in quantizers:
        quantizer.disable()
    dx.export_hf_checkpoint(model, os.path.join(base, "before"))
    for quantizer in quantizers:
        quantizer.enable()
    dx.export_hf_checkpoint(model, os.path.join(base, "after"))


def test_a_second_export_sees_the_quantizers_as_they_are_then(tmp_path):
    assert_all_ok(run_ranks(_export_twice_with_an_expert_turned_on, 1, str(tmp_path),
                            init=False, timeout=300))
    before = hf_models.read_checkpoint(str(tmp_path / "before"))
    after = hf_models.read_checkpoint(str(tmp_path / "after"))
    on = "model.layers.0.mlp.experts.2.down_proj."
    assert before[on + "weight"].dtype == torch.float8_e4m3fn and on + "weight_scale" in before
    for off in ("model.layers.0.mlp.experts.3.down_proj.", "model.layers.0.self_attn.o_proj."):
        assert before[off + "weight"].dtype == torch.bfloat16, off
        assert off + "weight_scale" not in before, off
        assert after[off + "weight"].dtype == torch.float8_e4m3fn, off
        assert off + "weight_scale" in after, off


def test_probe_ranges_cover_every_weight_once_the_last_rank_less_for_the_config():
    from distributed_ext.export.plan.probes import probe_range

    for count in range(1, 9):
        for weights in (0, 1, 2, 7, 64, 294, 1940):
            for sources in (0, 30, 294):
                ranges = [probe_range(i, count, weights, sources) for i in range(count)]
                assert ranges[0][0] == 0 and ranges[-1][1] == weights, ranges
                assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
                sizes = [end - first for first, end in ranges]
                assert min(sizes) >= 0, ranges
                if count > 1:
                    assert max(sizes[:-1]) - min(sizes[:-1]) <= 1, ranges
                    assert sizes[-1] <= min(sizes[:-1]), ranges
    # The config is worth ~130 probes of a 1 GiB Llama (294 quantized linears), ~50 of a
    # Qwen3-MoE's 1940 weights in 30 quantized modules: the same work each, not the same
    # count (a third of the MoE's probes on the last rank had it done 0.3 s before rank 0).
    assert [probe_range(i, 2, 294, 294) for i in range(2)] == [(0, 211), (211, 294)]
    assert [probe_range(i, 2, 1940, 30) for i in range(2)] == [(0, 994), (994, 1940)]
    assert probe_range(1, 2, 10, 30) == (10, 10)  # (the config alone is more than half)
