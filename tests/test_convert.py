"""convert_dcp_to_hf against save_pretrained: checkpoints that torch's ``dcp.save`` and
transformers' ``save_pretrained(..., distributed_checkpoint=True)`` wrote from the layouts
torch and transformers build, converted at worlds 1, 2 and 3 and compared file by file with
``save_pretrained`` of the same model unsharded (keys, dtypes, shapes, bytes, config.json);
bad input refused on every rank with nothing written."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_command, run_ranks

import distributed_ext as dx

pytest.importorskip("transformers", reason="the models are transformers' own")
pytest.importorskip("accelerate", reason="transformers' distributed loader needs accelerate")
pytest.importorskip("safetensors", reason="needs safetensors")

from hf_models import build, read_checkpoint  # noqa: E402


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _save(state: dict, directory: str, **kwargs) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=directory, **kwargs)


def _save_world_2(root: str, src: str) -> None:
    """FSDP2 Llama (with its optimizer's state beside, under "model."), in torch.save items
    and in DCP's safetensors; transformers' TP Llama through its own distributed save."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    mesh = init_device_mesh("cpu", (2,))
    model = _fsdp2(build("llama"), mesh)
    opt = torch.optim.AdamW(model.parameters())
    model_sd, opt_sd = get_state_dict(model, opt)
    _save({"model": model_sd, "optimizer": opt_sd, "step": 7}, os.path.join(root, "fsdp2"))
    _save(model_sd, os.path.join(root, "fsdp2-st"), storage_writer=FileSystemWriter(
        os.path.join(root, "fsdp2-st"), serialization_format=SerializationFormat.SAFETENSORS))
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # what torchrun sets; the loader reads it
    tp = AutoModelForCausalLM.from_pretrained(os.path.join(src, "llama"),
                                              distributed_config=DistributedConfig(tp_size=2))
    tp.save_pretrained(os.path.join(root, "hf-tp"), distributed_checkpoint=True)


def _save_world_4(root: str, src: str) -> None:
    """FSDP2 at 4; torch's 2-D recipe (FSDP x TP); HSDP 2x2; a Qwen3-MoE transformers
    loaded with ep + fsdp (replicated twice), through dcp.save and through its own distributed save."""
    from test_layouts import _torch_2d_model
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    _save(get_model_state_dict(_fsdp2(build("llama"), init_device_mesh("cpu", (4,)))),
          os.path.join(root, "fsdp4"))
    _save(get_model_state_dict(_torch_2d_model()), os.path.join(root, "2d"))
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = build("llama")
    for layer in hsdp.model.layers:
        fully_shard(layer, mesh=hsdp_mesh)
    fully_shard(hsdp, mesh=hsdp_mesh)
    _save(get_model_state_dict(hsdp), os.path.join(root, "hsdp"))
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    ep = AutoModelForCausalLM.from_pretrained(
        os.path.join(src, "qwen3-moe"), distributed_config=DistributedConfig(
            dp_replicate_size=2, fsdp_size=2, ep_size=2))
    _save(get_model_state_dict(ep), os.path.join(root, "ep"))
    ep.save_pretrained(os.path.join(root, "hf-ep"), distributed_checkpoint=True)


# (checkpoint, reference family, prefix, kwargs): what each world's saves wrote
CASES = [("fsdp2", "llama", "model.", {}), ("fsdp2-st", "llama", "", {}),
         ("hf-tp", "llama", "", {}), ("fsdp4", "llama", "", {}), ("2d", "llama", "", {}),
         ("hsdp", "llama", "", {}), ("ep", "qwen3-moe", "", {}),
         ("hf-ep", "qwen3-moe", "", {}),
         ("fsdp2", "llama", "model.", {"dtype": "bfloat16", "max_shard_size": "60KB"}),
         ("2d", "llama", "", {"writers": "dst"})]


def _label(case) -> str:
    name, _family, _prefix, kwargs = case
    return name + "".join(f"-{v}" for v in kwargs.values())


def _dcp_dir(root: str, name: str) -> str:
    """Where the save wrote: transformers' distributed save goes to a folder of its own."""
    path = os.path.join(root, name)
    for folder, _dirs, files in os.walk(path):
        if ".metadata" in files or any(f.startswith("shard-") for f in files):
            return folder
    return path


def _convert_all(root: str, src: str, out: str) -> None:
    for case in CASES:
        name, family, prefix, kwargs = case
        kw = dict(kwargs)
        if "dtype" in kw:
            kw["dtype"] = getattr(torch, kw["dtype"])
        dx.convert_dcp_to_hf(_dcp_dir(root, name), os.path.join(out, _label(case)),
                             os.path.join(src, family), prefix=prefix, **kw)


def _assert_as_save_pretrained(out: str, reference_dir: str, dtype: str | None = None) -> None:
    reference = read_checkpoint(reference_dir)
    written = read_checkpoint(out)
    assert sorted(written) == sorted(reference), set(written) ^ set(reference)
    for k, v in reference.items():
        want = v.to(getattr(torch, dtype)) if dtype and v.is_floating_point() else v
        assert written[k].dtype == want.dtype and written[k].shape == want.shape, k
        assert torch.equal(written[k], want), k
    names = sorted(n for n in os.listdir(out) if not n.startswith("."))
    for name in ("config.json", "generation_config.json"):
        got = json.loads(open(os.path.join(out, name)).read())
        want = json.loads(open(os.path.join(reference_dir, name)).read())
        if dtype and name == "config.json":
            want["dtype"] = dtype
        assert got == want, name
    if dtype is None:
        assert names == sorted(os.listdir(reference_dir)), names


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case's checkpoint, saved once for the module (and the reference models)."""
    root = tmp_path_factory.mktemp("dcp")
    src = root / "src"
    build("llama").save_pretrained(src / "llama")
    build("qwen3-moe").save_pretrained(src / "qwen3-moe")
    assert_all_ok(run_ranks(_save_world_2, 2, str(root), str(src), timeout=300))
    assert_all_ok(run_ranks(_save_world_4, 4, str(root), str(src), timeout=400))
    return str(root), str(src)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_checkpoints_saved_by_torch_and_transformers_convert_as_save_pretrained(
        world, saved, tmp_path):
    root, src = saved
    out = str(tmp_path / "out")
    if world == 1:
        _convert_all(root, src, out)
    else:
        assert_all_ok(run_ranks(_convert_all, world, root, src, out, timeout=300))
    for case in CASES:
        name, family, _prefix, kwargs = case
        _assert_as_save_pretrained(os.path.join(out, _label(case)), os.path.join(src, family),
                                   kwargs.get("dtype"))
    # The MoE as the hub lays it out: one tensor per expert, which DCP's own
    # consolidation (the in-memory keys) does not write.
    keys = read_checkpoint(os.path.join(out, "hf-ep"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys


def _convert_expecting(dcp_dir: str, out: str, config: str, prefix: str) -> tuple:
    try:
        dx.convert_dcp_to_hf(dcp_dir, out, config, prefix=prefix)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return (type(exc).__name__, str(exc))
    return ("ok",)


def test_bad_input_is_refused_on_every_rank_with_nothing_written(saved, tmp_path):
    root, src = saved
    bad = tmp_path / "bad"
    shutil.copytree(os.path.join(root, "fsdp4"), bad / "truncated")
    victim = sorted(n for n in os.listdir(bad / "truncated") if n.endswith(".distcp"))[1]
    with open(bad / "truncated" / victim, "r+b") as f:
        f.truncate(os.path.getsize(bad / "truncated" / victim) // 2)
    shutil.copytree(os.path.join(root, "fsdp4"), bad / "missing")
    os.remove(bad / "missing" / victim)
    import transformers

    other = transformers.LlamaConfig.from_pretrained(os.path.join(src, "llama"))
    other.intermediate_size = 128
    other.save_pretrained(bad / "other-config")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cases = [  # (dcp_dir, config, prefix, what every rank's message must say)
        (str(bad / "truncated"), os.path.join(src, "llama"), "", [victim, "truncated"]),
        (str(bad / "missing"), os.path.join(src, "llama"), "", [victim, "missing"]),
        (os.path.join(root, "fsdp2"), os.path.join(src, "llama"), "",
         ["no key 'model.embed_tokens.weight'", "prefix"]),
        (os.path.join(root, "fsdp4"), str(bad / "other-config"), "",
         ["mlp.gate_proj.weight", "[96, 64]", "[128, 64]"]),
    ]
    for dcp_dir, config, prefix, words in cases:
        results = assert_all_ok(run_ranks(_convert_expecting, 2, dcp_dir, str(out), config,
                                          prefix, timeout=120))
        for got in results:
            assert got[0] == "ValueError", got
            assert all(w in got[1] for w in words), (words, got[1])
        assert sorted(os.listdir(out)) == ["keep.txt"], os.listdir(out)
    assert (out / "keep.txt").read_text() == "mine"


def test_cli_converts_in_local_ranks(saved, tmp_path):
    root, src = saved
    out = tmp_path / "cli"
    proc = run_command(["distributed-ext", "convert", _dcp_dir(root, "hf-ep"), str(out),
                        "--config", os.path.join(src, "qwen3-moe"), "--world", "2"],
                       timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "distributed-ext convert:" in proc.stdout
    _assert_as_save_pretrained(str(out), os.path.join(src, "qwen3-moe"))
    usage = run_command(["distributed-ext", "convert", str(tmp_path / "nowhere"), str(out),
                         "--config", os.path.join(src, "qwen3-moe")], timeout=60)
    assert usage.returncode == 2 and "is not a directory" in usage.stderr


def _convert_measuring(dcp_dir: str, out: str, config: str) -> int:
    import transformers  # noqa: F401 - imported before: its import is not the call's memory
    from harness import rss_growth_during

    dx.convert_dcp_to_hf(dcp_dir, out + "-warm-up", config)  # (the code paths' first use)
    return rss_growth_during(lambda: dx.convert_dcp_to_hf(dcp_dir, out, config), trim=True)


def test_a_rank_holds_a_few_blocks_whatever_the_size_of_a_saved_chunk(tmp_path):
    """Saved chunks of 128 MiB (an embedding and a head of 64k x 512 fp32, saved by one
    process): each rank's RSS grows by less than one of them, the 128 MiB the docstring
    states, while it converts."""
    import torch.distributed.checkpoint as dcp

    model = build("llama", vocab_size=65536, hidden_size=512)
    model.config.save_pretrained(tmp_path / "config")
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    del model
    grown = assert_all_ok(run_ranks(_convert_measuring, 2, str(tmp_path / "dcp"),
                                    str(tmp_path / "out"), str(tmp_path / "config"),
                                    timeout=300))
    assert all(g < 128 * 2**20 for g in grown), [g / 2**20 for g in grown]


def _convert_past_the_check(dcp_dir: str, out: str, config: str) -> tuple:
    """The conversion with the files' sizes not checked up front (a file truncated after the
    plan was made): the short read is met while the bytes move."""
    from distributed_ext.export.files import saved as saved_files

    saved_files.Saved.check_files = lambda self, keys: None
    return _convert_expecting(dcp_dir, out, config, "")


@pytest.mark.parametrize("name, words", [
    ("fsdp2-st", "a short read"),  # raw bytes cut short
    ("fsdp4", "cannot be read without loading it"),  # a torch.save item's zip cut
])
def test_a_file_cut_while_the_bytes_move_fails_every_rank_and_publishes_nothing(
        saved, tmp_path, name, words):
    root, src = saved
    shutil.copytree(_dcp_dir(root, name), tmp_path / "cut")
    victim = sorted(n for n in os.listdir(tmp_path / "cut") if n.endswith(".distcp"))[-1]
    with open(tmp_path / "cut" / victim, "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "cut" / victim) - 100)
    out = tmp_path / "out"
    results = assert_all_ok(run_ranks(_convert_past_the_check, 2, str(tmp_path / "cut"),
                                      str(out), os.path.join(src, "llama"), timeout=120))
    # The rank that read it raises its own error; every other one a RuntimeError naming it.
    kinds = sorted(got[0] for got in results)
    assert kinds == ["RuntimeError", "ValueError"], results
    for got in results:
        assert victim in got[1] and words in got[1], got
    assert not out.exists() or sorted(os.listdir(out)) == [], os.listdir(out)
