"""What each rank holds, described and placed (distributed_ext/export/plan/entries.py, plan/blocks.py):
DTensors on meshes whose ranks are not ascending, keys that hold NUL, tensors with no
elements, a tied pair half sharded -- each exported on real gloo ranks and compared with
torch's own ``full_tensor()`` or ``save_pretrained``'s files."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, outcome, run_ranks

import distributed_ext as dx

pytest.importorskip("transformers", reason="the export tests build Hugging Face models")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


def _read(directory):
    return safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))


def _export_permuted(out, mesh_ranks, writers):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", mesh_ranks)
    torch.manual_seed(0)
    layouts = [[Shard(0)], [Shard(1)]] if mesh.ndim == 1 else [
        [Shard(0), Shard(1)], [Shard(0), Shard(0)], [Shard(1), Replicate()],
        [Replicate(), Shard(0)]]
    state, reference = {}, {}
    for i, placements in enumerate(layouts):
        dt = distribute_tensor(torch.randn(8, 12), mesh, placements)
        state[f"t{i}"] = dt
        reference[f"t{i}"] = dt.full_tensor()  # torch's own answer
    dx.export_hf_checkpoint(state, out, writers=writers)
    return reference if dist.get_rank() == 0 else None


@pytest.mark.parametrize("world, mesh_ranks", [(2, [1, 0]), (4, [[3, 1], [2, 0]]),
                                               (4, [[0, 2], [1, 3]])])
@pytest.mark.parametrize("writers", ["dst", "all"])
def test_a_mesh_whose_ranks_are_not_ascending_is_written_as_full_tensor_gives_it(
        world, mesh_ranks, writers, tmp_path):
    out = str(tmp_path / "ckpt")
    reference = assert_all_ok(run_ranks(_export_permuted, world, out, mesh_ranks, writers,
                                        timeout=120))[0]
    got = _read(out)
    assert sorted(got) == sorted(reference)
    for k, v in reference.items():
        assert torch.equal(got[k], v), k


def _export_permuted_uneven(out):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [1, 0])
    dt = distribute_tensor(torch.randn(3, 4), mesh, [Shard(0)])
    return outcome(lambda: dx.export_hf_checkpoint({"w": dt}, out))


def test_uneven_shards_on_a_mesh_whose_ranks_are_not_ascending_are_refused(tmp_path):
    out = str(tmp_path / "ckpt")
    values = assert_all_ok(run_ranks(_export_permuted_uneven, 2, out, timeout=120))
    assert all(v[:2] == ("raised", "ValueError") for v in values), values
    assert "state['w']" in values[0][2] and "not ascending" in values[0][2], values[0]
    assert "ascending ranks" in values[0][2]  # the fix
    assert not os.path.exists(out)


def _export_nul_keys(out):
    if dist.get_rank() == 0:
        state = {"a\0b": torch.full((2,), 1.0), "c": torch.full((3,), 2.0)}
    else:
        state = {"a": torch.full((2,), 3.0), "b\0c": torch.full((3,), 4.0)}
    dx.export_hf_checkpoint(state, out)
    return True


def test_keys_equal_when_joined_with_nul_are_still_different_keys(tmp_path):
    out = str(tmp_path / "ckpt")
    assert_all_ok(run_ranks(_export_nul_keys, 2, out, timeout=120))
    got = _read(out)
    assert sorted(got) == ["a", "a\0b", "b\0c", "c"]  # no rank's tensors dropped
    assert torch.equal(got["a"], torch.full((2,), 3.0))
    assert torch.equal(got["b\0c"], torch.full((3,), 4.0))
    assert torch.equal(got["c"], torch.full((3,), 2.0))


def _export_empty(out, writers):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    state = {"plain": torch.empty(0, 4), "rows": distribute_tensor(torch.empty(0, 4), mesh,
                                                                   [Shard(0)]),
             "cols": distribute_tensor(torch.empty(4, 0), mesh, [Shard(0)]),
             "cols1": distribute_tensor(torch.empty(3, 0, 2), mesh, [Shard(1)]),
             "w": torch.arange(6.0)}
    dx.export_hf_checkpoint(state, out, writers=writers)
    return True


@pytest.mark.parametrize("writers", ["dst", "all"])
def test_tensors_with_no_elements_are_written_as_safetensors_stores_them(writers, tmp_path):
    out = str(tmp_path / "ckpt")
    assert_all_ok(run_ranks(_export_empty, 2, out, writers, timeout=120))
    got = _read(out)
    shapes = {k: tuple(v.shape) for k, v in got.items()}
    assert shapes == {"plain": (0, 4), "rows": (0, 4), "cols": (4, 0), "cols1": (3, 0, 2),
                      "w": (6,)}
    assert torch.equal(got["w"], torch.arange(6.0))
    # What safetensors itself writes for the same tensors reads back alike.
    reference = tmp_path / "reference.safetensors"
    safetensors_torch.save_file({k: torch.empty(s) for k, s in shapes.items() if k != "w"}
                                | {"w": torch.arange(6.0)}, str(reference))
    assert {k: tuple(v.shape) for k, v in safetensors_torch.load_file(str(reference)).items()} \
        == shapes


def _export_half_tied(out, reference_dir):
    import transformers as tf
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = tf.Qwen2Config(vocab_size=130, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True)
    model = tf.Qwen2ForCausalLM(config)
    fully_shard(model.model.embed_tokens)  # the embedding sharded, lm_head left plain
    assert type(model.lm_head.weight) is torch.nn.Parameter
    dx.export_hf_checkpoint(model, out)
    embed = model.model.embed_tokens.weight.full_tensor()
    if dist.get_rank() != 0:
        return None
    # The reference: save_pretrained of the same tensors, the pair as untied in memory.
    torch.manual_seed(0)
    plain = tf.Qwen2ForCausalLM(config)
    with torch.no_grad():
        plain.model.embed_tokens.weight = torch.nn.Parameter(embed.clone())
        plain.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    plain.save_pretrained(reference_dir)
    return True


def test_a_tied_pair_with_one_side_sharded_is_written_as_save_pretrained_writes_it(tmp_path):
    out, reference_dir = str(tmp_path / "ckpt"), str(tmp_path / "reference")
    assert_all_ok(run_ranks(_export_half_tied, 2, out, reference_dir, timeout=180))
    got, reference = _read(out), _read(reference_dir)
    assert sorted(got) == sorted(reference)
    for k, v in reference.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
