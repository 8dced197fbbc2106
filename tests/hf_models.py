"""Tiny Hugging Face models of the families the export tests write, and the reference
checkpoint read back: shared by the tests of the export, its writers, keys and layouts."""

from __future__ import annotations

import os

import torch

TINY = dict(vocab_size=130, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
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


def build(family: str, seed: int = 0, **overrides):
    """A tiny model of ``family`` with seeded weights (``overrides``: config fields)."""
    import transformers as tf

    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    return getattr(tf, model_cls)(getattr(tf, config_cls)(**{**TINY, **extra, **overrides}))


def make_input():
    return torch.randint(0, 130, (2, 8), generator=torch.Generator().manual_seed(1))


def logits_on_threads(model, threads: int) -> torch.Tensor:
    """``model``'s logits on :func:`make_input`, computed on ``threads`` threads: equal to the
    bit to a rank's where it used as many (a reduction split over another number of threads
    rounds otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            return model(make_input()).logits
    finally:
        torch.set_num_threads(before)


def train_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(make_input(), labels=make_input()).loss.backward()
    opt.step()
    opt.zero_grad()


def read_checkpoint(directory):
    """Every tensor of the .safetensors files in ``directory``."""
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out
