"""Decoder-layer detection on tiny Hugging Face models, and FSDP2 wraps at world 2 (gloo, CPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import assert_all_ok, run_ranks

import distributed_ext as dx
from distributed_ext.fsdp import resolve_decoder_layers

transformers = pytest.importorskip("transformers", reason="the FSDP2 tests need transformers "
                                   "(pip install -e '.[test]')")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def build(family: str) -> nn.Module:
    """A tiny, randomly initialised model of ``family``, built from a config (no downloads)."""
    t = transformers
    torch.manual_seed(0)
    if family == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**TINY))
    if family == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**TINY))
    if family == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**TINY))
    if family == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**TINY, head_dim=16))
    if family == "qwen3_moe":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=4,
                                                       num_experts_per_tok=2,
                                                       moe_intermediate_size=32))
    if family == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**TINY, num_local_experts=4,
                                                    num_experts_per_tok=2))
    if family == "gemma":
        return t.GemmaForCausalLM(t.GemmaConfig(**TINY, head_dim=16))
    if family == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(**TINY, head_dim=16))
    if family == "phi3":
        return t.Phi3ForCausalLM(t.Phi3Config(**TINY, pad_token_id=0))
    if family == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128,
                                              n_positions=64))
    if family == "gpt_neox":
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=2,
                                                    vocab_size=128))
    if family == "opt":
        return t.OPTForCausalLM(t.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                            num_attention_heads=2, vocab_size=128,
                                            word_embed_proj_dim=32, max_position_embeddings=64))
    if family == "falcon":
        return t.FalconForCausalLM(t.FalconConfig(hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, vocab_size=128))
    if family == "bloom":
        return t.BloomForCausalLM(t.BloomConfig(hidden_size=32, n_layer=2, n_head=2,
                                                vocab_size=128))
    if family == "deepseek_v3":
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            **{**TINY, "num_hidden_layers": 2}, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, n_shared_experts=1))
    if family == "llava":
        return t.LlavaForConditionalGeneration(t.LlavaConfig(
            vision_config=t.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=3, num_attention_heads=2,
                                             image_size=32, patch_size=8),
            text_config=t.LlamaConfig(**TINY)))
    if family == "nemotron_h":
        return t.NemotronHForCausalLM(t.NemotronHConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=128, hybrid_override_pattern="M*-",
            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
            mamba_n_groups=1, head_dim=16))
    raise KeyError(family)


EXPECTED_LAYER_CLASS = {
    "llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer",
    "qwen3_moe": "Qwen3MoeDecoderLayer", "mixtral": "MixtralDecoderLayer",
    "gemma": "GemmaDecoderLayer", "gemma2": "Gemma2DecoderLayer", "phi3": "Phi3DecoderLayer",
    "gpt2": "GPT2Block", "gpt_neox": "GPTNeoXLayer", "opt": "OPTDecoderLayer",
    "falcon": "FalconDecoderLayer", "bloom": "BloomBlock",
    "deepseek_v3": "DeepseekV3DecoderLayer", "llava": "LlamaDecoderLayer",
    "nemotron_h": "NemotronHBlock",
}


@pytest.mark.parametrize("family", sorted(EXPECTED_LAYER_CLASS))
def test_detects_decoder_layers(family):
    model = build(family)
    layers = resolve_decoder_layers(model)
    assert [type(m).__name__ for m in layers] == [EXPECTED_LAYER_CLASS[family]] * len(layers)
    assert len(layers) == model.config.get_text_config().num_hidden_layers


def test_detects_through_a_peft_wrapper():
    peft = pytest.importorskip("peft", reason="peft is not installed")
    model = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    layers = resolve_decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)


class Odd(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.stack = nn.ModuleDict({"a": Block(), "b": Block()})


def test_falls_back_to_no_split_modules_and_explicit_layers():
    model = Odd()
    assert resolve_decoder_layers(model) == [model.stack["a"], model.stack["b"]]
    assert resolve_decoder_layers(model, layers="Block") == [model.stack["a"], model.stack["b"]]
    assert resolve_decoder_layers(model, layers=Block) == [model.stack["a"], model.stack["b"]]
    assert resolve_decoder_layers(model, layers=[model.stack["b"]]) == [model.stack["b"]]
    with pytest.raises(ValueError, match="matches no submodule"):
        resolve_decoder_layers(model, layers="Missing")


def test_nothing_found_says_what_was_looked_for():
    with pytest.raises(ValueError) as info:
        resolve_decoder_layers(nn.Sequential(nn.Linear(2, 2)))
    msg = str(info.value)
    assert "model.layers" in msg and "transformer.h" in msg and "layers=" in msg


def test_is_fsdp2_model_false_for_plain():
    assert not dx.is_fsdp2_model(build("llama"))


# -- real wraps at world 2 ---------------------------------------------------------------------


def _input():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


def _wrap_and_compare(family, shard_root):
    from torch.distributed.tensor import DTensor

    model = build(family)
    reference = copy.deepcopy(model)
    before = dx.is_fsdp2_model(model)
    layers = dx.fsdp2_wrap(model, shard_root=shard_root)
    # Before any forward: a root FSDP module keeps its parameters unsharded after one.
    embed_sharded = isinstance(model.get_input_embeddings().weight, DTensor)
    layer_sharded = isinstance(next(layers[0].parameters()), DTensor)
    with torch.no_grad():
        got, want = model(_input()).logits, reference(_input()).logits
    try:
        dx.distribution_plan(model)
        plan_error = None
    except RuntimeError as exc:
        plan_error = str(exc)
    return {
        "layers": len(layers), "before": before, "after": dx.is_fsdp2_model(model),
        "max_diff": (got - want).abs().max().item(),
        "embed_sharded": embed_sharded,
        "layer_sharded": layer_sharded,
        "architectures": model.config.architectures, "plan_error": plan_error,
    }


@pytest.mark.parametrize("shard_root", [True, False])
def test_wrap_llama_logits_match_unsharded(shard_root):
    for v in assert_all_ok(run_ranks(_wrap_and_compare, 2, "llama", shard_root, timeout=180)):
        assert v["layers"] == 2 and v["before"] is False and v["after"] is True
        assert v["max_diff"] == 0.0
        assert v["layer_sharded"] is True and v["embed_sharded"] is shard_root
        assert v["architectures"] == ["LlamaForCausalLM"]
        assert "FSDP2-sharded" in v["plan_error"]


def _wrap_bf16_with_fp32_router():
    model = build("deepseek_v3").to(torch.bfloat16)
    gates = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopkRouter"):
            module.weight.data = module.weight.data.float()  # an fp32 router, as checkpoints keep it
            gates.append(f"{name}.weight")
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dx.fsdp2_wrap(model)
    messages = [str(w.message) for w in caught if "mixed parameter dtypes" in str(w.message)]
    with torch.no_grad():
        got, want = model(_input()).logits, reference(_input()).logits
    return gates, messages, got.dtype == torch.bfloat16, (got.float() - want.float()).abs().max().item()


def test_wrap_bf16_model_with_fp32_router_runs():
    for rank, (gates, messages, is_bf16, diff) in enumerate(assert_all_ok(
        run_ranks(_wrap_bf16_with_fp32_router, 2, timeout=180)
    )):
        assert gates, "the tiny DeepSeek-V3 has no router"
        if rank == 0:  # one warning, on the master only, naming the first few
            assert len(messages) == 1 and all(g in messages[0] for g in sorted(gates)[:3])
        else:
            assert messages == []
        assert is_bf16 and diff == 0.0


def _wrap_with_policies():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = build("qwen3")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = dx.fsdp2_wrap(model, mp_policy=policy)
    state = layers[0]._get_fsdp_state()
    mp = state._mp_policy
    with torch.no_grad():
        out = model(_input()).logits
    return mp.param_dtype == torch.bfloat16, bool(torch.isfinite(out.float()).all())


def test_mp_policy_is_passed_through():
    for ok, finite in assert_all_ok(run_ranks(_wrap_with_policies, 2, timeout=180)):
        assert ok and finite


def test_cpu_offload_and_ignored_params_are_passed_through(monkeypatch, tmp_path):
    # FSDP2's CPU offload needs an accelerator, so record what fully_shard is handed instead
    # (in a one-rank group: fsdp2_wrap refuses to run without one).
    import torch.distributed.fsdp as fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        _check_passed_through(monkeypatch, fsdp)
    finally:
        dist.destroy_process_group()


def _check_passed_through(monkeypatch, fsdp):
    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    model = build("llama").to(torch.bfloat16)
    model.lm_head.weight.data = model.lm_head.weight.data.float()
    with pytest.warns(UserWarning, match="mixed parameter dtypes.*lm_head.weight"):
        layers = dx.fsdp2_wrap(model, cpu_offload=True)
    assert [m for m, _ in calls] == [*layers, model]
    for _m, kw in calls:
        assert isinstance(kw["offload_policy"], fsdp.CPUOffloadPolicy)
        assert kw["ignored_params"] == {model.lm_head.weight}
        assert "mp_policy" not in kw
    assert model.lm_head.weight.device.type == "cpu"  # the compute device here


def _plan_then_wrap():
    model = build("llama")
    dx.fsdp2_wrap(model)
    plan = dx.DistributionPlan(world_size=dist.get_world_size(), dense="fsdp")
    dx.set_distribution_plan(model, plan)
    return dx.distribution_plan(model.model.layers[0]) == plan


def test_plan_recorded_on_a_wrapped_model():
    assert assert_all_ok(run_ranks(_plan_then_wrap, 2, timeout=180)) == [True, True]


def _off_dtype_with_warnings():
    from distributed_ext.fsdp import _off_dtype_params

    model = build("llama").to(torch.bfloat16)
    model.lm_head.weight.data = model.lm_head.weight.data.float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = _off_dtype_params(model)
    mixed = [w for w in caught if "mixed parameter dtypes" in str(w.message)]
    return model, off, mixed


def test_off_dtype_params_is_a_set_and_warns_once_like_modelopt():
    from distributed_ext.fsdp import _off_dtype_params

    model, off, mixed = _off_dtype_with_warnings()
    assert off == {model.lm_head.weight} and isinstance(off, set)
    assert len(mixed) == 1 and issubclass(mixed[0].category, UserWarning)
    assert _off_dtype_params(build("llama")) == set()


def _off_dtype_on_ranks():
    _model, off, mixed = _off_dtype_with_warnings()
    return len(off), len(mixed)


def test_off_dtype_params_warns_on_the_master_only():
    assert assert_all_ok(run_ranks(_off_dtype_on_ranks, 2, timeout=120)) == [(1, 1), (1, 0)]


def _fsdp2_on_one_gpu(path):
    from harness import nccl_group_of_one

    torch.cuda.set_device(0)
    with nccl_group_of_one(path):
        model = build("llama").cuda()
        reference = copy.deepcopy(model)
        dx.fsdp2_wrap(model)
        x = _input().cuda()
        with torch.no_grad():
            diff = (model(x).logits - reference(x).logits).abs().max().item()
        return dx.is_fsdp2_model(model), diff


@pytest.mark.cuda
def test_fsdp2_wrap_on_one_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; torch.cuda.is_available() is False here")
    ((wrapped, diff),) = assert_all_ok(run_ranks(_fsdp2_on_one_gpu, 1, str(tmp_path / "s"),
                                                 init=False, timeout=300))
    assert wrapped and diff < 1e-5
