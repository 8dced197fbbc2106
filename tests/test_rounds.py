"""The export's agreed rounds under hostile conditions, on real gloo ranks: arguments that
differ, hooks that raise, failures and kills in the transfer and the commit, Ctrl-C, a
launch with no group -- every rank raises alike and the directory holds the earlier
checkpoint or the new one, never a mix."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, outcome, rename_failing_at, run_ranks

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export import rounds as export_rounds
from distributed_ext.export.files import sinks as export_sinks

pytest.importorskip("transformers", reason="the export tests build Hugging Face models")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

from hf_models import (  # noqa: E402
    TINY,
    read_checkpoint,
)


def _state_of(r, n=4, numel=3000):
    return {f"r{r}.w{i}": torch.full((numel,), float(10 * r + i)) for i in range(n)}


def _export_with_args(out, per_rank):
    import time

    r = dist.get_rank()
    kwargs = per_rank.get(r, {})
    directory = kwargs.pop("directory", out)
    start = time.monotonic()
    try:
        dx.export_hf_checkpoint(_state_of(r), directory, **kwargs)
        return ("ok", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001
        return ("raised", time.monotonic() - start, type(exc).__name__, str(exc))


@pytest.mark.parametrize("name, per_rank", [
    ("dst", {1: {"dst": 1}}),
    ("chunk_bytes", {1: {"chunk_bytes": 4096}}),
    ("max_shard_size", {0: {"max_shard_size": "10KB"}}),
    ("directory", {1: {"directory": "/tmp/somewhere-else"}}),
])
def test_arguments_that_differ_between_ranks_are_refused_on_every_rank(name, per_rank, tmp_path):
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_export_with_args, 3, str(out), per_rank, pg_timeout=120))
    for v in values:
        assert v[0] == "raised" and v[2] == "ValueError", v
        assert f"{name} differs between ranks" in v[3], v
        assert v[1] < 20, v  # promptly: no rank waited for messages that never come
    assert not out.exists()


def _hook_raises_on_one_rank(out):
    import transformers as tf

    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY))
    if dist.get_rank() == 1:
        def hook(module, state_dict, prefix, local_metadata):
            raise RuntimeError("a state-dict hook failed on this rank")

        model._register_state_dict_hook(hook)
    return outcome(lambda: dx.export_hf_checkpoint(model, out))


def test_a_state_dict_hook_raising_on_one_rank_fails_every_rank(tmp_path):
    values = assert_all_ok(run_ranks(_hook_raises_on_one_rank, 2, str(tmp_path / "c"),
                                     pg_timeout=120, timeout=120))
    assert values[1][:2] == ("raised", "RuntimeError") and "state-dict hook" in values[1][2]
    assert values[0][0] == "raised" and "rank 1 failed with RuntimeError" in values[0][2], values
    assert not (tmp_path / "c").exists()


def _write_earlier(out):
    """An earlier checkpoint of two shards and a tokenizer file the user keeps there."""
    state = {f"old.w{i}": torch.full((3000,), -1.0 - i) for i in range(4)}
    os.makedirs(out, exist_ok=True)
    dx.export_hf_checkpoint(state, out, max_shard_size="20KB")
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("{}")


def _snapshot(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def _failing_step(out, where):
    r = dist.get_rank()
    if r == 0:
        if where == "allocation":
            def fail(*args, **kwargs):
                raise MemoryError("cannot allocate the receive buffers")

            export_rounds._prepare_transfer = fail
        elif where == "rename":
            # The commit's third rename fails (the earlier entry points are aside by then,
            # some new files in): the earlier files are put back.
            os.rename = rename_failing_at(3, OSError(5, "Input/output error"))
    state = _state_of(r)
    model = None
    if where == "config":
        import transformers as tf

        model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY))
        model.config.quantizer = object()  # what quantization tools attach: not JSON
        state = model
    return outcome(lambda: dx.export_hf_checkpoint(state, out, max_shard_size="20KB"))


@pytest.mark.parametrize("where, text", [
    ("allocation", "cannot allocate the receive buffers"),
    ("config", "model.config does not serialize to JSON"),
    ("rename", "Input/output error"),
])
def test_a_failure_on_dst_before_or_in_the_commit_fails_every_rank_and_keeps_the_earlier(
        where, text, tmp_path):
    out = str(tmp_path / "ckpt")
    _write_earlier(out)
    before = _snapshot(out)
    values = assert_all_ok(run_ranks(_failing_step, 3, out, where, pg_timeout=120, timeout=120))
    assert values[0][0] == "raised" and text in values[0][2], values[0]
    for v in values[1:]:
        assert v[0] == "raised" and v[1] == "RuntimeError", v
        assert "rank 0 failed with" in v[2] and text in v[2], v
    assert _snapshot(out) == before  # the earlier checkpoint, byte for byte
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"]  # no stage left


def _killed_in_commit(out, when):
    import signal

    r = dist.get_rank()
    if r == 0:
        real_rename, calls = os.rename, []

        def rename(a, b):
            real_rename(a, b)
            calls.append(b)
            entry_placed = b == os.path.join(out, E.INDEX_NAME)
            if (when == "entry-moved-aside" and len(calls) == 1) or \
                    (when == "mid-renames" and len(calls) == 6) or \
                    (when == "entry-placed" and entry_placed):
                os.kill(os.getpid(), signal.SIGKILL)

        os.rename = rename
    return outcome(lambda: dx.export_hf_checkpoint(_state_of(r), out, max_shard_size="20KB"))


def _read_indexed(directory):
    """The tensors the index names (what a loader reads), by key."""
    from safetensors import safe_open

    index = json.load(open(os.path.join(directory, E.INDEX_NAME)))
    out = {}
    for key, name in index["weight_map"].items():
        with safe_open(os.path.join(directory, name), "pt") as f:
            out[key] = f.get_tensor(key)
    return out


@pytest.mark.parametrize("when", ["entry-moved-aside", "mid-renames", "entry-placed"])
def test_dst_killed_in_the_commit_leaves_the_earlier_or_the_new_checkpoint_never_a_mix(
        when, tmp_path):
    out = str(tmp_path / "ckpt")
    _write_earlier(out)
    res = run_ranks(_killed_in_commit, 2, out, when, pg_timeout=120, timeout=120)
    assert res[0].exit_code == -9, res[0]
    assert res[1].value[0] == "raised" and "rank 0" in res[1].value[2], res[1]
    names = sorted(os.listdir(out))
    assert "tokenizer.json" in names  # the user's file, untouched at every instant
    if when == "entry-placed":
        # The new checkpoint, whole (stale shards of the earlier one may remain: the
        # index does not name them).
        got = _read_indexed(out)
        assert sorted(got) == sorted(f"r{r}.w{i}" for r in range(2) for i in range(4))
        for r in range(2):
            for i in range(4):
                assert torch.equal(got[f"r{r}.w{i}"], torch.full((3000,), float(10 * r + i)))
    else:
        # Partial: no entry point, so every loader refuses it (it fails loudly).
        assert E.INDEX_NAME not in names and E.WEIGHTS_NAME not in names, names
    # A later export removes what the killed one left (its stage) and publishes whole.
    assert_all_ok(run_ranks(_export_with_args, 2, out, {}))
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"], os.listdir(tmp_path)
    assert sorted(os.listdir(out)) == [E.WEIGHTS_NAME, "tokenizer.json"]
    got = read_checkpoint(out)
    assert sorted(got) == sorted(f"r{r}.w{i}" for r in range(2) for i in range(4))


def test_stale_temporary_files_of_a_crashed_export_are_removed(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    legacy = out / f".model.safetensors.{'a' * 32}.tmp"  # an older version's temp file
    legacy.write_bytes(b"x" * 1000)
    stage = tmp_path / ".ckpt.dext-export-0123"
    stage.mkdir()
    (stage / "model.safetensors").write_bytes(b"x" * 1000)
    assert_all_ok(run_ranks(_export_with_args, 2, str(out), {}))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert sorted(os.listdir(out)) == [E.WEIGHTS_NAME]


def _no_group_under_a_launch(out):
    return outcome(lambda: dx.export_hf_checkpoint({"w": torch.ones(3)}, out))


def test_a_launch_without_a_process_group_is_refused(tmp_path):
    out = str(tmp_path / "ckpt")
    values = assert_all_ok(run_ranks(_no_group_under_a_launch, 2, out, init=False,
                                     env={"WORLD_SIZE": "2"}))
    for v in values:
        assert v[:2] == ("raised", "RuntimeError") and "process group is not set up" in v[2], v
    assert not os.path.exists(out)


def _many_files_few_descriptors(out, n):
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    r = dist.get_rank()
    state = {f"r{r}.w{i:05d}": torch.full((1000,), float(i)) for i in range(n)}
    dx.export_hf_checkpoint(state, out, max_shard_size=4500)  # one tensor per file
    return True


def test_thousands_of_shard_files_need_few_descriptors(tmp_path):
    out = str(tmp_path / "ckpt")
    n = 700  # per rank: 1400 files, each two descriptors while open, under a limit of 256
    assert_all_ok(run_ranks(_many_files_few_descriptors, 2, out, n, timeout=300))
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(files) == 2 * n
    index = json.load(open(os.path.join(out, E.INDEX_NAME)))
    for key in ["r0.w00000", "r1.w00699", "r0.w00350"]:
        with safetensors_torch.safe_open(os.path.join(out, index["weight_map"][key]), "pt") as f:
            assert torch.equal(f.get_tensor(key), torch.full((1000,), float(int(key[-5:]))))


def _bad_key(out, kind):
    r = dist.get_rank()
    state = {f"r{r}": torch.ones(3)}
    if kind == "metadata":
        state["__metadata__"] = torch.ones(2)
    elif kind == "surrogate":
        state["w\udc80"] = torch.ones(2)
    else:  # a lazily conjugated view: its memory is not what it reads as
        state["c"] = torch.ones(2, dtype=torch.complex64).mul(1 + 1j).conj()
    return outcome(lambda: dx.export_hf_checkpoint(state, out))


@pytest.mark.parametrize("kind, text", [
    ("metadata", "reserves this key"),
    ("surrogate", "not valid UTF-8"),
    ("conj", "lazily conjugated view"),
])
def test_keys_and_views_safetensors_cannot_hold_are_refused_on_every_rank(kind, text, tmp_path):
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_bad_key, 2, str(out), kind))
    for v in values:
        assert v[0] == "raised" and text in v[2], v
    assert not out.exists()


def _interrupted_on_dst(out, where):
    import signal

    r = dist.get_rank()
    if r == 0:
        def interrupt():
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: lands in dst's main thread

        if where == "transfer":
            real_write, calls = E.FileSink.write_batch, []

            def write(self, data, rows, **kw):
                calls.append(1)
                if len(calls) == 2:
                    interrupt()
                real_write(self, data, rows, **kw)

            E.FileSink.write_batch = write
        elif where == "commit-start":
            real_commit, calls = E.FileSink.commit, []

            def commit(self):
                calls.append(1)
                if len(calls) == 1:
                    interrupt()
                real_commit(self)

            E.FileSink.commit = commit
        else:  # in the commit's fsyncs
            real_fsync, calls = export_sinks._fsync_path, []

            def fsync(path, directory=False):
                calls.append(1)
                if len(calls) == 1:
                    interrupt()
                real_fsync(path, directory)

            export_sinks._fsync_path = fsync
    outcomes = []
    for i in range(3):  # the group stays in step: the same round on every rank each time
        try:
            # (writers="dst": the patch counts dst's writes of what arrives)
            dx.export_hf_checkpoint(_state_of(r), out, max_shard_size="20KB",
                                    writers="dst" if where == "transfer" else "auto")
            outcome = ("ok",)
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included
            outcome = ("raised", type(exc).__name__, str(exc))
        outcomes.append((outcome, dx.all_reduce(f"after {i}", lambda: 1, sum),
                         _snapshot(out) if r == 0 and i == 0 else None))
    return outcomes


@pytest.mark.parametrize("where", ["transfer", "commit-start", "commit-fsync"])
def test_ctrl_c_on_dst_in_the_transfer_or_the_commit_fails_every_rank_alike(where, tmp_path):
    out = str(tmp_path / "ckpt")
    _write_earlier(out)
    before = _snapshot(out)
    values = assert_all_ok(run_ranks(_interrupted_on_dst, 3, out, where, pg_timeout=120,
                                     timeout=120))
    for r, outcomes in enumerate(values):
        for i, (got, after, _snap) in enumerate(outcomes):
            assert after == 3, (r, i, after)  # every rank joined the next collective
            if i > 0:
                assert got == ("ok",), (r, i, got)  # the patch fires once
            elif r == 0:
                assert got[:2] == ("raised", "KeyboardInterrupt"), got
            else:
                assert got[:2] == ("raised", "RuntimeError"), got
                assert "rank 0 failed with KeyboardInterrupt" in got[2], got
    after_first = values[0][0][2]
    if where != "transfer":  # in the commit: deferred until it ended, published, then raised
        index = json.loads(after_first[E.INDEX_NAME])
        assert sorted(index["weight_map"]) == sorted(f"r{r}.w{i}" for r in range(3)
                                                    for i in range(4))
        assert "tokenizer.json" in after_first
    else:  # interrupted before publishing: the earlier checkpoint, byte for byte
        assert after_first == before
    got = read_checkpoint(out)
    assert sorted(got) == sorted(f"r{r}.w{i}" for r in range(3) for i in range(4))


def _peer_dies_after_the_data(out):
    import signal

    r = dist.get_rank()
    if r == 1:
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        export_rounds._commit_round = die  # every byte has arrived; rank 1 dies before the commit round
    return outcome(lambda: dx.export_hf_checkpoint(_state_of(r), out, max_shard_size="20KB"))


def test_a_peer_dying_after_the_data_is_named_and_the_checkpoint_is_complete(tmp_path):
    out = str(tmp_path / "ckpt")
    res = run_ranks(_peer_dies_after_the_data, 3, out, pg_timeout=120, timeout=120)
    assert res[1].exit_code == -9
    for r in (0, 2):
        outcome = res[r].value
        assert outcome[:2] == ("raised", "RuntimeError") and "rank 1 died" in outcome[2], outcome
    assert "the checkpoint itself is complete" in res[0].value[2]
    got = read_checkpoint(out)
    for r in range(3):
        for i in range(4):
            assert torch.equal(got[f"r{r}.w{i}"], torch.full((3000,), float(10 * r + i)))


def _export_into(out):
    dx.export_hf_checkpoint(_state_of(dist.get_rank()), out, max_shard_size="5GB" if
                            dist.get_rank() == 0 else 5 * 10**9)  # the same size, spelled apart
    return True


def test_missing_parents_are_made_and_a_symlinked_directory_keeps_its_link(tmp_path):
    nested = tmp_path / "a" / "b" / "ckpt"
    assert_all_ok(run_ranks(_export_into, 2, str(nested)))
    assert sorted(read_checkpoint(str(nested))) == sorted(
        f"r{r}.w{i}" for r in range(2) for i in range(4))
    target = tmp_path / "real"
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert_all_ok(run_ranks(_export_into, 2, str(link)))
    assert link.is_symlink() and (link / "tokenizer.json").exists()
    assert sorted(read_checkpoint(str(link))) == sorted(
        f"r{r}.w{i}" for r in range(2) for i in range(4))
