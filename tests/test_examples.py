"""examples/export_shards.py at world 2 on CPU; the files load back equal to the model."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

import pytest
import torch
from harness import REPO, run_command, run_torchrun

EXAMPLE = os.path.join(REPO, "examples", "export_shards.py")

pytest.importorskip("transformers", reason="the example builds a Hugging Face model")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


def _load_example(path):
    """An example script imported as a module (its main() does not run)."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example_module():
    return _load_example(EXAMPLE)


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
    proc = run_torchrun([EXAMPLE, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    example = _example_module()
    full = example.build_model().state_dict()
    for r in range(2):
        shard = safetensors_torch.load_file(example.shard_path(str(out), r, 2))
        for k, v in shard.items():
            assert torch.equal(v, full[k]), k


EXPORT = os.path.join(REPO, "examples", "export_fsdp2_hf.py")


def _assert_loaded_logits_match_printed(proc, out):
    """The checkpoint loads with the logits the sharded model printed (first three)."""
    from transformers import AutoModelForCausalLM

    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = ast.literal_eval(proc.stdout.split("logits[0, 0, :3] = ")[1].strip())
    model = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        got = model(_load_example(EXPORT).sample_input()).logits[0, 0, :3].tolist()
    assert [round(x, 5) for x in printed] == [round(x, 5) for x in got]


def test_export_fsdp2_hf_example_locally(tmp_path):
    out = tmp_path / "ckpt"
    proc = run_command([sys.executable, EXPORT, "--world", "2", "--out", str(out),
                        "--max-shard-size", "100KB"], timeout=300)
    _assert_loaded_logits_match_printed(proc, out)
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()


def test_export_fsdp2_hf_example_under_torchrun(tmp_path):
    out = tmp_path / "ckpt"
    _assert_loaded_logits_match_printed(run_torchrun([EXPORT, "--out", str(out)]), out)


# A torch whose import a Ctrl-C cuts short and that then fails as something else: what a
# real import did once in CI (the interrupt inside numpy's C module, swallowed on the way,
# then "ImportError: cannot load module more than once per process").
_INTERRUPTED_IMPORT = """
import os, signal
try:
    os.kill(os.getpid(), signal.SIGINT)
except BaseException:
    pass
raise ImportError("cannot load module more than once per process")
"""


@pytest.mark.parametrize("entry", ["example", "cli"])
def test_an_import_that_fails_after_a_ctrl_c_is_the_ctrl_c(entry, tmp_path):
    import subprocess

    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(_INTERRUPTED_IMPORT)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    cmd = ([sys.executable, EXPORT, "--world", "2", "--out", str(tmp_path / "ckpt")]
           if entry == "example" else
           [sys.executable, "-c", "import sys, distributed_ext_cli; "
            "sys.exit(distributed_ext_cli.bench())"])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "interrupted while starting" in proc.stderr
    # (without the interrupt, the same failure is raised as it is)
    (fake / "__init__.py").write_text('raise ImportError("no torch here")')
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert proc.returncode == 1 and "ImportError: no torch here" in proc.stderr


@pytest.mark.parametrize("when", ["importing", "ranks running"])
def test_export_fsdp2_hf_example_ctrl_c_is_a_message_not_a_traceback(when, tmp_path):
    import signal
    import subprocess
    import time

    import psutil

    out = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, EXPORT, "--world", "2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        if when == "importing":
            time.sleep(0.5)
        else:  # once the forkserver and both ranks exist
            deadline = time.monotonic() + 60
            while len(psutil.Process(proc.pid).children(recursive=True)) < 3:
                assert time.monotonic() < deadline and proc.poll() is None, "no ranks started"
                time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "interrupted" in err, err[-2000:]
