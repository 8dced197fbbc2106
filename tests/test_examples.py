"""examples/export_shards.py at world 2 on CPU; the files load back equal to the model."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

import pytest
import torch
from harness import REPO, free_port, run_command

EXAMPLE = os.path.join(REPO, "examples", "export_shards.py")

pytest.importorskip("transformers", reason="the example builds a Hugging Face model")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


def _example_module():
    spec = importlib.util.spec_from_file_location("export_shards", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_shards_world_2(tmp_path):
    out = tmp_path / "shards"
    proc = run_command([sys.executable, EXAMPLE, "--world", "2", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    example = _example_module()
    full = example.build_model().state_dict()
    loaded = {}
    for r in range(2):
        shard = safetensors_torch.load_file(example.shard_path(str(out), r, 2))
        assert set(shard) == set(example.shard_of(full, r, 2))
        loaded.update(shard)
    assert set(loaded) == set(full)
    for k, v in full.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def test_export_shards_under_torchrun(tmp_path):
    out = tmp_path / "shards"
    proc = run_command(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), EXAMPLE, "--out", str(out)],
        timeout=300, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    example = _example_module()
    full = example.build_model().state_dict()
    for r in range(2):
        shard = safetensors_torch.load_file(example.shard_path(str(out), r, 2))
        for k, v in shard.items():
            assert torch.equal(v, full[k]), k


EXPORT = os.path.join(REPO, "examples", "export_fsdp2_hf.py")


def _export_example():
    spec = importlib.util.spec_from_file_location("export_fsdp2_hf", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loaded_logits(out):
    from transformers import AutoModelForCausalLM

    example = _export_example()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        return model(example.sample_input()).logits[0, 0].tolist()


def test_export_fsdp2_hf_example_locally(tmp_path):
    out = tmp_path / "ckpt"
    proc = run_command([sys.executable, EXPORT, "--world", "2", "--out", str(out),
                        "--max-shard-size", "100KB"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    printed = proc.stdout.split("logits[0, 0, :3] = ")[1].strip()
    got = _loaded_logits(out)[:3]
    assert [round(x, 5) for x in ast.literal_eval(printed)] == [round(x, 5) for x in got]


def test_export_fsdp2_hf_example_under_torchrun(tmp_path):
    out = tmp_path / "ckpt"
    proc = run_command(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), EXPORT, "--out", str(out)],
        timeout=300, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.split("logits[0, 0, :3] = ")[1].strip()
    got = _loaded_logits(out)[:3]
    assert [round(x, 5) for x in ast.literal_eval(printed)] == [round(x, 5) for x in got]
