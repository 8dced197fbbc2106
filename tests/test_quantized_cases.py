"""The quantized export's harder cases, each against ModelOpt's own one-process export of the
same quantized model (tensor by tensor, byte for byte, and both JSON files): quantized layers
inside a compiled or DDP-wrapped submodule; tied word embeddings with either side's weight
quantizer on; and ModelOpt's own refusals, raised on every rank naming the module."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import pytest
import torch
from harness import assert_all_ok, run_ranks

if importlib.util.find_spec("modelopt") is None:
    pytest.skip("needs nvidia-modelopt (the [test] extra)", allow_module_level=True)

import hf_models  # noqa: E402
from test_quantized import DIMS, _same_bytes  # noqa: E402

# Quantized, then: a layer compiled; a layer in DDP; torch's ColwiseParallel on the linears that
# read the layer's input (their rows split, their quantizers' amax made replicated DTensors);
# tied word embeddings with lm_head's, the embedding's or both weight quantizers on.
CASES = ["compiled-layer", "ddp-layer", "tp-colwise", "tied-lm_head", "tied-embed", "tied-both"]


def _build(case: str):
    """A tiny Llama in bf16, quantized to FP8 by ModelOpt's ``mtq.quantize``; for the tied
    cases with tied word embeddings and the named side's weight quantizer turned on."""
    import copy

    warnings.filterwarnings("ignore")
    import modelopt.torch.quantization as mtq

    model = hf_models.build("llama", 0, dtype=torch.bfloat16, tie_word_embeddings=case.startswith(
        "tied"), **DIMS).to(torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if case in ("tied-lm_head", "tied-both"):
        config["quant_cfg"] += [{"quantizer_name": "*lm_head*weight_quantizer", "enable": True},
                                {"quantizer_name": "*lm_head*input_quantizer", "enable": True}]
    if case in ("tied-embed", "tied-both"):
        config["quant_cfg"].append({"quantizer_name": "*embed_tokens*weight_quantizer",
                                    "enable": True})
    batch = torch.randint(0, 130, (4, 32), generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, config, lambda m: m(batch))
    return model


def _references(base: str) -> None:
    from modelopt.torch.export import export_hf_checkpoint

    for case in CASES:
        export_hf_checkpoint(_build(case), dtype=torch.bfloat16,
                             export_dir=os.path.join(base, "ref", case))


def _ours(base: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import distributed_ext as dx

    for case in CASES:
        model = _build(case)
        layers = model.model.layers
        if case == "compiled-layer":
            layers[0] = torch.compile(layers[0])  # (never run: its keys gain _orig_mod.)
        if case == "ddp-layer":
            layers[0] = DistributedDataParallel(layers[0])  # (replicated on both ranks)
        elif case == "tp-colwise":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            parallelize_module(layers[0], mesh, {
                f"{m}": ColwiseParallel() for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                   "self_attn.v_proj", "mlp.gate_proj",
                                                   "mlp.up_proj")})
        else:
            dx.fsdp2_wrap(model)
        dx.export_hf_checkpoint(model, os.path.join(base, "ours", case))
    dist.barrier()


def test_wrapped_layers_and_tied_embeddings_are_written_as_modelopt_writes_them(tmp_path):
    base = str(tmp_path)
    assert_all_ok(run_ranks(_references, 1, base, init=False, timeout=300))
    assert_all_ok(run_ranks(_ours, 2, base, timeout=300))
    for case in CASES:
        ref_dir, our_dir = (os.path.join(base, w, case) for w in ("ref", "ours"))
        ref, ours = hf_models.read_checkpoint(ref_dir), hf_models.read_checkpoint(our_dir)
        assert sorted(ours) == sorted(ref), (case, sorted(set(ours) ^ set(ref)))
        differ = [k for k in ref if not _same_bytes(ref[k], ours[k])]
        assert not differ, (case, differ)
        for name in ("hf_quant_config.json", "config.json"):
            with open(os.path.join(ref_dir, name)) as f, open(os.path.join(our_dir, name)) as g:
                assert json.load(g) == json.load(f), (case, name)
        # What each case is about, as written.
        q_proj = "model.layers.0.self_attn.q_proj."
        assert ours[q_proj + "weight"].dtype == torch.float8_e4m3fn, case
        assert q_proj + "weight_scale" in ours and q_proj + "input_scale" in ours, case
        if case in ("tied-lm_head", "tied-both"):
            assert ours["lm_head.weight"].dtype == torch.float8_e4m3fn, case
        if case.startswith("tied"):
            assert ours["model.embed_tokens.weight"].dtype == torch.bfloat16, case


def _refused_blocks(base: str) -> dict:
    """Each model whose weights ModelOpt's export cannot pack, ``fsdp2_wrap``-ped and exported
    (the outcome per case on this rank)."""
    import copy

    import modelopt.torch.quantization as mtq

    import distributed_ext as dx

    warnings.filterwarnings("ignore")
    out = {}
    for case, name, dims in (("W4A16_NVFP4_CFG", None, {"intermediate_size": 136}),
                             ("INT4_AWQ_CFG", 16, {"hidden_size": 72})):
        config = copy.deepcopy(getattr(mtq, case))
        if name is not None:  # (INT4 AWQ in blocks of 16 columns)
            config["quant_cfg"][1]["cfg"]["block_sizes"] = {-1: name, "type": "static"}
        model = hf_models.build("llama", 0, dtype=torch.bfloat16, **{**DIMS, **dims}).to(
            torch.bfloat16)
        model.config.architectures = [type(model).__name__]
        batch = torch.randint(0, 130, (4, 32), generator=torch.Generator().manual_seed(1))
        mtq.quantize(model, config, lambda m, batch=batch: m(batch))
        dx.fsdp2_wrap(model)
        where = os.path.join(base, case)
        try:
            dx.export_hf_checkpoint(model, where)
            out[case] = ("ok",)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            out[case] = (type(exc).__name__, str(exc), os.path.exists(where))
    return out


def test_weights_modelopt_cannot_pack_are_refused_on_every_rank_naming_the_module(tmp_path):
    results = assert_all_ok(run_ranks(_refused_blocks, 2, str(tmp_path), timeout=300))
    for out in results:
        kind, message, written = out["W4A16_NVFP4_CFG"]
        assert kind == "ValueError" and not written, out
        assert message.startswith("model.layers.0.mlp.down_proj (w4a16_nvfp4): its weight has "
                                  "136 columns, not a multiple of the format's block of 16"), message
        assert "make that dimension a multiple of 16" in message, message
        kind, message, written = out["INT4_AWQ_CFG"]
        assert kind == "ValueError" and not written, out
        assert "self_attn.q_proj (int4_awq): its weight has 72 columns, not a multiple of the " \
               "format's block of 16" in message, message


def test_modelopts_refusal_to_fuse_a_group_names_the_group_and_the_fix():
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    from distributed_ext.export.plan.shared_inputs import _fuse_group

    warnings.filterwarnings("ignore")
    config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    nvfp4 = mtq.NVFP4_DEFAULT_CFG["quant_cfg"]
    config["quant_cfg"] += [{"quantizer_name": "*k_proj*weight_quantizer", "cfg": nvfp4[1]["cfg"]},
                            {"quantizer_name": "*k_proj*input_quantizer", "cfg": nvfp4[2]["cfg"]}]
    model = hf_models.build("llama", 0, dtype=torch.bfloat16, **DIMS).to(torch.bfloat16)
    batch = torch.randint(0, 130, (4, 32), generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, config, lambda m: m(batch))
    attn = model.model.layers[0].self_attn
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    with pytest.raises(ValueError) as info:  # ModelOpt's own assertion, under our name
        _fuse_group(preprocess_linear_fusion, names, [attn.q_proj, attn.k_proj])
    message = str(info.value)
    assert message.startswith(", ".join(names) + ": these linears read one input"), message
    assert "Modules have different quantization formats" in message, message
    assert "Quantize them alike" in message, message
