"""Publishing a checkpoint (distributed_ext/export/files/publish.py): the user's directory and what
it holds are never replaced, re-created, re-permissioned or descended through; a crash at any
instant leaves the earlier checkpoint, the new one or a directory every loader refuses; bad
directories are refused on every rank, naming the argument."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, outcome, rename_failing_at, run_ranks

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export.files import publish

pytest.importorskip("transformers", reason="the publish tests load checkpoints with transformers")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def _tiny(seed):
    import transformers as tf

    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_TINY))


class _Crash(BaseException):
    """Stands for SIGKILL in one process: nothing after it runs (cleanup patched away)."""


def _loads_as(directory, models):
    """Which of ``models`` (name -> state dict) ``from_pretrained(directory)`` gives, or
    "refused" where it raises; AssertionError for a mix of them."""
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        # Refused for what is missing (the weights' entry point, or config.json), never for
        # a file that is there but wrong.
        assert any(w in str(exc) for w in ("model.safetensors", "no file named",
                                           "config.json")), exc
        return "refused"
    got = loaded.state_dict()
    for name, state in models.items():
        if all(torch.equal(got[k], v) for k, v in state.items() if k in got):
            return name
    raise AssertionError(f"{directory} loads as a mix of the checkpoints")


@pytest.mark.parametrize("earlier_shards", ["20KB", "5GB"])
def test_a_crash_at_every_instant_of_the_publish_leaves_earlier_new_or_refused(
        earlier_shards, tmp_path, monkeypatch):
    out = str(tmp_path / "ckpt")
    earlier, new = _tiny(1), _tiny(2)
    states = {"earlier": {k: v.clone() for k, v in earlier.state_dict().items()},
              "new": {k: v.clone() for k, v in new.state_dict().items()}}
    seen, k = [], 0
    while True:
        if os.path.exists(out):
            subprocess.run(["rm", "-rf", out], check=True)
        earlier.save_pretrained(out, max_shard_size=earlier_shards)  # the reference writer
        with open(os.path.join(out, "tokenizer.json"), "w") as f:
            f.write("{}")
        real_rename, calls = os.rename, []

        def rename(a, b, real_rename=real_rename, calls=calls, k=k):
            if len(calls) == k:
                raise _Crash
            real_rename(a, b)
            calls.append(b)

        with monkeypatch.context() as m:
            m.setattr(os, "rename", rename)
            m.setattr(publish.Stage, "abort", lambda self: None)  # a crash cleans nothing
            m.setattr(publish.Stage, "_put_back", lambda self, *a: None)
            try:
                dx.export_hf_checkpoint(new, out, max_shard_size="30KB")
                crashed = False
            except _Crash:
                crashed = True
        state = _loads_as(out, states)
        assert "tokenizer.json" in os.listdir(out)
        seen.append(state)
        if not crashed:
            break
        k += 1
    # Every instant: first the earlier checkpoint, then refused, then the new one.
    assert seen[0] == "earlier" and seen[-1] == "new", seen
    assert "refused" in seen, seen
    order = {"earlier": 0, "refused": 1, "new": 2}
    assert [order[s] for s in seen] == sorted(order[s] for s in seen), seen
    assert k >= 4, seen  # the renames were really crashed one by one


def _export_tiny(out, seed=2, **kwargs):
    model = _tiny(seed)
    return outcome(lambda: dx.export_hf_checkpoint(model, out, **kwargs))


def test_a_failed_publish_puts_the_earlier_checkpoint_back(tmp_path, monkeypatch):
    out = str(tmp_path / "ckpt")
    _tiny(1).save_pretrained(out, max_shard_size="20KB")
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    monkeypatch.setattr(os, "rename", rename_failing_at(5, OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        dx.export_hf_checkpoint(_tiny(2), out, max_shard_size="30KB")
    monkeypatch.undo()
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before


def test_files_written_into_a_subdirectory_during_three_publishes_are_all_kept(tmp_path):
    out = tmp_path / "ckpt"
    logs = out / "logs"
    logs.mkdir(parents=True)
    stop, written = threading.Event(), []

    def logger():
        i = 0
        while not stop.is_set():
            path = logs / f"event.{i}"
            path.write_text(str(i))
            written.append(path.name)
            i += 1

    thread = threading.Thread(target=logger)
    thread.start()
    try:
        for seed in range(3):
            assert _export_tiny(str(out), seed=seed, max_shard_size="30KB") == ("ok",)
    finally:
        stop.set()
        thread.join()
    assert len(written) > 10
    assert sorted(os.listdir(logs)) == sorted(written)  # 0 files lost
    assert all((logs / n).read_text() == n.split(".")[1] for n in written)


def test_a_filesystem_mounted_inside_the_directory_is_never_touched(tmp_path):
    out = tmp_path / "ckpt"
    data = out / "data"
    data.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(data)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here: {mounted.stderr.strip()}")
    try:
        (data / "shard.bin").write_bytes(b"x" * 1000)
        # Also an old sibling stage (of versions that staged beside the directory) with a
        # mount inside: removed around the mount, never through it.
        for seed in range(2):
            assert _export_tiny(str(out), seed=seed) == ("ok",)
        assert (data / "shard.bin").read_bytes() == b"x" * 1000
        assert os.path.ismount(data)
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no stage left anywhere
        assert not [n for n in os.listdir(out) if n.startswith(".")]
        old_stage = tmp_path / ".ckpt.dext-export-feed"
        (old_stage / "m").mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                        str(old_stage / "m")], check=True)
        try:
            (old_stage / "m" / "keep").write_text("k")
            (old_stage / "model.safetensors").write_text("stale")
            assert _export_tiny(str(out)) == ("ok",)
            assert (old_stage / "m" / "keep").read_text() == "k"  # not descended into
            assert not (old_stage / "model.safetensors").exists()
        finally:
            subprocess.run(["umount", str(old_stage / "m")], check=True)
    finally:
        subprocess.run(["umount", str(data)], check=True)


@pytest.mark.parametrize("mode", [0o700, 0o2770, 0o1777])
def test_the_directory_and_its_subdirectories_keep_their_modes(mode, tmp_path):
    out = tmp_path / "ckpt"
    (out / "sub").mkdir(parents=True)
    os.chmod(out, mode)
    os.chmod(out / "sub", mode)
    ino = os.stat(out).st_ino
    for seed in range(2):
        assert _export_tiny(str(out), seed=seed) == ("ok",)
    assert stat.S_IMODE(os.stat(out).st_mode) == mode
    assert stat.S_IMODE(os.stat(out / "sub").st_mode) == mode
    assert os.stat(out).st_ino == ino  # the same directory, not a new one in its place


def _export_into_cwd(cwd, directory):
    os.chdir(cwd)
    state = {f"r{dist.get_rank()}": torch.ones(4)}
    res = outcome(lambda: dx.export_hf_checkpoint(state, directory))
    return res + (os.getcwd(),)


def test_a_scratch_directory_exported_into_as_dot_keeps_its_mode(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    values = assert_all_ok(run_ranks(_export_into_cwd, 2, str(scratch), "."))
    assert all(v[0] == "ok" and v[-1] == str(scratch) for v in values), values
    assert stat.S_IMODE(os.stat(scratch).st_mode) == 0o1777
    assert sorted(os.listdir(scratch)) == [E.WEIGHTS_NAME]


def test_the_empty_string_is_refused_on_every_rank_and_the_cwd_is_kept(tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "config.json").write_text("{}")
    values = assert_all_ok(run_ranks(_export_into_cwd, 2, str(cwd), ""))
    for v in values:
        assert v[:2] == ("raised", "ValueError") and "directory=''" in v[2], v
        assert v[-1] == str(cwd)
    assert sorted(os.listdir(cwd)) == ["config.json"]


def test_a_directory_name_of_255_bytes_is_written(tmp_path):
    out = tmp_path / ("d" * 255)
    assert _export_tiny(str(out)) == ("ok",)
    assert "model.safetensors" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["d" * 255]


def _export_to(directory):
    state = {f"r{dist.get_rank()}": torch.ones(1000)}
    return outcome(lambda: dx.export_hf_checkpoint(state, directory))


@pytest.mark.parametrize("kind", ["loop", "under-loop", "dangling", "file", "proc", "sys"])
def test_a_directory_that_cannot_take_a_checkpoint_is_refused_on_every_rank(kind, tmp_path):
    target = {"loop": tmp_path / "a", "under-loop": tmp_path / "a" / "sub",
              "dangling": tmp_path / "gone", "file": tmp_path / "f",
              "proc": "/proc/out", "sys": "/sys/out"}[kind]
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "nowhere", tmp_path / "gone")
    (tmp_path / "f").write_text("x")
    before = sorted(os.listdir(tmp_path))
    values = assert_all_ok(run_ranks(_export_to, 2, str(target)))
    why = {"loop": "symbolic link loop", "under-loop": "symbolic link loop",
           "dangling": "missing path", "file": "not a directory", "proc": "cannot be written",
           "sys": "cannot be written"}[kind]
    # dst raises the ValueError in the metadata round (before any byte moves), every peer
    # a RuntimeError naming it.
    assert values[0][:2] == ("raised", "ValueError"), values[0]
    assert f"directory={str(target)!r}" in values[0][2] and why in values[0][2], values[0]
    assert values[1][:2] == ("raised", "RuntimeError"), values[1]
    assert "metadata" in values[1][2] and "rank 0 failed with ValueError" in values[1][2]
    assert sorted(os.listdir(tmp_path)) == before


def test_config_json_is_what_save_pretrained_writes_for_a_config_built_model(tmp_path):
    import json

    model = _tiny(3).to(torch.bfloat16)
    assert model.config.architectures is None  # built from a config
    dx.export_hf_checkpoint(model, str(tmp_path / "ckpt"))
    assert model.config.architectures is None  # the model's own config left as it was
    model.save_pretrained(str(tmp_path / "reference"))
    for name in ("config.json", "generation_config.json"):
        ours = json.loads((tmp_path / "ckpt" / name).read_text())
        theirs = json.loads((tmp_path / "reference" / name).read_text())
        assert ours == theirs, name
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]


def test_a_directory_made_by_another_checker_at_the_same_moment_is_accepted(tmp_path,
                                                                             monkeypatch):
    # Two ranks that each take themselves for dst (a dst that differs between ranks, refused
    # in the same round) check the same missing directory at once: the one whose mkdir finds
    # it made passes, and leaves it to its maker -- the round then names the real mistake.
    target = tmp_path / "ckpt"
    real = os.mkdir

    def made_meanwhile(path, *args, **kwargs):
        if os.fspath(path) == str(target):
            real(path, *args, **kwargs)  # the other rank's, just before ours
            raise FileExistsError(17, "File exists", os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", made_meanwhile)
    publish.check_directory(str(target), "export_hf_checkpoint", on_dst=True)
    assert target.is_dir()  # (the other checker's: not ours to remove)
    monkeypatch.setattr(os, "mkdir", real)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        publish.check_directory(str(tmp_path / "file" / "ckpt"), "export_hf_checkpoint", True)


_RACER = r"""
import os, sys, time
import torch
import distributed_ext as dx
out, tag, start = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = {"w": torch.full((2, 2**20), float(tag)), "b": torch.arange(1000.0) + tag}
while not os.path.exists(start):
    time.sleep(0.005)
ok = refused = 0
for _ in range(20):
    try:
        dx.export_hf_checkpoint(state, out)
        ok += 1
    except ValueError as exc:
        assert "another export into directory=" in str(exc) and "is live (pid " in str(exc), exc
        refused += 1
print(ok, refused)
"""


def test_two_processes_exporting_into_one_directory_never_remove_each_others_stage(tmp_path):
    out, start = str(tmp_path / "ckpt"), str(tmp_path / "start")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, out, str(tag), start], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for tag in (1, 2)]
    try:
        time.sleep(3)  # (both imported torch by now)
        open(start, "w").close()
        results = [r.communicate(timeout=240) for r in racers]
    finally:
        for r in racers:
            r.kill()
    for r, (_out, err) in zip(racers, results):
        assert r.returncode == 0, err[-3000:]  # every call succeeded or was refused clearly
    counts = [tuple(map(int, out.split())) for out, _err in results]
    assert all(ok + refused == 20 for ok, refused in counts), counts
    # They did overlap (some were refused), and exports went through.
    assert sum(refused for _ok, refused in counts) > 0 and sum(ok for ok, _r in counts) > 0, counts
    # One complete checkpoint (one racer's, never a mix), and nothing of ours beside it.
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    got = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    tag = got["b"][0].item()
    assert tag in (1.0, 2.0) and torch.equal(got["w"], torch.full((2, 2**20), tag))


_STALLED = r"""
import sys, time
import torch
import distributed_ext as dx
from distributed_ext.export.files import publish
publish.Stage.publish = lambda self, *a: (print("staged", flush=True), time.sleep(600))
dx.export_hf_checkpoint({"w": torch.ones(1000)}, sys.argv[1])
"""


def test_a_live_export_is_refused_by_name_and_a_killed_ones_stage_is_removed_by_the_next(
        tmp_path):
    out = tmp_path / "ckpt"
    _tiny(1).save_pretrained(str(out))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    stalled = subprocess.Popen([sys.executable, "-c", _STALLED, str(out)], text=True,
                               stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert stalled.stdout.readline().strip() == "staged"
        stages = [n for n in os.listdir(out) if n.startswith(".dext-export-")]
        assert len(stages) == 1
        # Live: refused at once, naming the directory and the holder; its stage is kept.
        got = _export_tiny(str(out))
        assert got[:2] == ("raised", "ValueError"), got
        assert f"directory={str(out)!r}" in got[2] and f"pid {stalled.pid}" in got[2], got
        assert stages[0] in os.listdir(out)
    finally:
        stalled.kill()
        stalled.wait()
    # Killed (the kernel released its lock): the next export removes its stage and publishes.
    assert _export_tiny(str(out)) == ("ok",)
    names = sorted(os.listdir(out))
    assert not [n for n in names if n.startswith(".dext-export")], names
    assert set(before) <= set(names)
    assert _loads_as(str(out), {"new": _tiny(2).state_dict()}) == "new"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json",
                                  "model.safetensors.index.json"])
def test_a_users_directory_named_like_a_checkpoint_file_is_refused_and_kept(name, tmp_path):
    out = tmp_path / "ckpt"
    (out / name).mkdir(parents=True)
    (out / name / "notes.txt").write_text("mine")
    got = _export_tiny(str(out))
    assert got[:2] == ("raised", "ValueError"), got
    assert repr(name) in got[2] and "is a directory" in got[2] and "nothing was written" in got[2]
    assert sorted(os.listdir(out)) == [name]  # no stage, no lock file left
    assert (out / name / "notes.txt").read_text() == "mine"
