"""Models exported through the wrappers users hold (distributed_ext.export.plan.wrappers), on real
gloo ranks: ``torch.compile`` (of the model, and of one layer inside it) and DDP are written as
``save_pretrained`` writes the model inside; any other module around a Hugging Face model is
refused on every rank, naming it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import assert_all_ok, outcome, run_ranks

import distributed_ext as dx

pytest.importorskip("transformers", reason="the wrapped models are Hugging Face models")
pytest.importorskip("safetensors", reason="needs safetensors")

from hf_models import (  # noqa: E402
    build,
    logits_on_threads,
    make_input,
    read_checkpoint,
    train_step,
)


class Holder(nn.Module):
    """A user's own wrapper: its state is the model's under ``inner.``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _wrapped(kind: str):
    """(the module handed to the export, the model inside it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    family = "llama" if kind == "nested-compile" else "qwen3-moe"
    model = build(family)
    if kind == "ddp":  # replicated: DDP's own broadcast makes every rank rank 0's model
        wrapped = DDP(model)
        train_step(wrapped)
        return wrapped, model
    dx.fsdp2_wrap(model)
    train_step(model)
    if kind == "compile":
        return torch.compile(model), model
    if kind == "compile-ddp":  # wrappers stacked at the top
        return torch.compile(DDP(build(family))), None
    # one layer compiled in place, as torchtitan compiles each block
    model.model.layers[1] = torch.compile(model.model.layers[1])
    return model, model


def _export_wrapped(kind, out, reference_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    wrapped, model = _wrapped(kind)
    if model is None:
        model = wrapped._orig_mod.module
    dx.export_hf_checkpoint(wrapped, out)
    gathered = dx.gather_full_state(wrapped)
    # eager, as the loaded model runs (inductor's fused kernels round otherwise)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        logits = wrapped(make_input()).logits
    if kind == "ddp" or kind == "compile-ddp":
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:  # the reference is torch's own gather, keyed as DCP keys a compiled model
        full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    plain = build("llama" if kind == "nested-compile" else "qwen3-moe", seed=1)
    plain.load_state_dict(full)
    plain.save_pretrained(reference_dir)
    return logits, sorted(gathered), sorted(plain.state_dict()), torch.get_num_threads()


@pytest.mark.parametrize("kind", ["compile", "ddp", "compile-ddp", "nested-compile"])
def test_a_wrapped_model_is_written_as_save_pretrained_writes_the_model_inside(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    out, reference_dir = str(tmp_path / "ckpt"), str(tmp_path / "reference")
    values = assert_all_ok(run_ranks(_export_wrapped, 2, kind, out, reference_dir,
                                     timeout=240))
    logits, gathered_keys, model_keys, threads = values[0]
    written, reference = read_checkpoint(out), read_checkpoint(reference_dir)
    assert sorted(written) == sorted(reference)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in written)
    for k, v in reference.items():
        assert written[k].dtype == v.dtype and written[k].shape == v.shape, k
        assert torch.equal(written[k], v), k
    for name in ("config.json", "generation_config.json"):
        assert json.loads(open(os.path.join(out, name)).read()) == \
            json.loads(open(os.path.join(reference_dir, name)).read()), name
    # gather_full_state: the inner model's own keys, as its load_state_dict takes them
    assert gathered_keys == model_keys
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits_on_threads(loaded, threads), logits)


def _export_held(out):
    model = build("llama")
    dx.fsdp2_wrap(model)
    return outcome(lambda: dx.export_hf_checkpoint(Holder(model), out))


def test_another_wrapper_around_a_model_is_refused_on_every_rank_naming_it(tmp_path):
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_export_held, 2, str(out), timeout=120))
    for v in values:
        assert v[:2] == ("raised", "ValueError"), v
        assert "model_or_state is a Holder whose whole state is the FSDPLlamaForCausalLM at " \
               "'inner'" in v[2] and "export_hf_checkpoint(model.inner, ...)" in v[2], v
    assert not out.exists()
