"""Process state and distributed_run, in one process and across real gloo ranks."""

from __future__ import annotations

import datetime
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_ranks, run_torchrun

import distributed_ext as dx


def test_single_process_state(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dx.is_available() is True
    assert dx.is_initialized() is False
    assert dx.backend() is None
    assert (dx.size(), dx.rank(), dx.is_master()) == (1, 0, True)
    dx.barrier()  # a no-op, must not raise
    assert dx.is_distributed_launch() is False
    assert dx.is_distributed_run() is False


@pytest.mark.parametrize("value, expected", [(None, False), ("1", False), ("2", True), ("64", True)])
def test_is_distributed_launch_reads_world_size(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", value)
    assert dx.is_distributed_launch() is expected
    assert dx.is_distributed_run() is False  # no live group, whatever the env says


@pytest.mark.parametrize("value", ["two", "2.5", "0", "-3"])
def test_is_distributed_launch_malformed_is_value_error(monkeypatch, value):
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        dx.is_distributed_launch()


def test_distributed_state():
    s = dx.DistributedState(rank=0, world_size=4, device="cpu")
    assert s.is_main and (s.rank, s.world_size, s.device) == (0, 4, "cpu")
    assert not dx.DistributedState(3, 4, torch.device("cpu")).is_main


def _state():
    return (dx.rank(), dx.size(), dx.is_master(), dx.backend(), dx.is_initialized(),
            dx.is_distributed_run(), dx.is_distributed_launch())


def test_process_state_world_3():
    values = assert_all_ok(run_ranks(_state, 3))
    assert values == [(r, 3, r == 0, "torch", True, True, False) for r in range(3)]


def test_process_state_world_1_group():
    # A 1-rank group is initialized but not a distributed run.
    assert assert_all_ok(run_ranks(_state, 1)) == [(0, 1, True, "torch", True, False, False)]


def _barrier_and_subgroup_rank():
    sub = dist.new_group([0, 2])
    dx.barrier()
    dx.barrier(group=sub) if dist.get_rank() in (0, 2) else None
    return dx.rank(sub), dx.size(sub), dx.is_master(sub)


def test_rank_size_of_a_subgroup():
    values = assert_all_ok(run_ranks(_barrier_and_subgroup_rank, 3))
    assert values[0] == (0, 2, True) and values[2] == (1, 2, False)
    assert values[1][0] == -1  # torch's answer for a non-member


def test_distributed_run_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with dx.distributed_run(device="cpu") as state:
        assert state == dx.DistributedState(0, 1, "cpu")
        assert not dx.is_initialized()
    assert not dx.is_initialized()


def test_distributed_run_refuses_cpu_on_a_launch_with_gpus(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    with pytest.raises(ValueError, match="cuda"):
        with dx.distributed_run(device="cpu"):
            pytest.fail("the body must not run")
    assert not dx.is_initialized()


def test_distributed_run_refuses_other_devices_on_a_cpu_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='meta'"):
        with dx.distributed_run(device="meta"):
            pytest.fail("the body must not run")
    assert not dx.is_initialized()


_RUN_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import distributed_ext as dx

with dx.distributed_run(%s) as state:
    total = dx.all_reduce("ranks", lambda: state.rank, sum)
    t = torch.ones(1, device=state.device)
    dist.all_reduce(t)
    print(f"RESULT rank={state.rank} world={state.world_size} device={state.device} "
          f"backend={dist.get_backend()} total={total} t={t.item()}", flush=True)
"""


@pytest.mark.cuda
def test_distributed_run_binds_cuda_local_rank_under_torchrun(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; torch.cuda.is_available() is False here")
    script = tmp_path / "run.py"
    # WORLD_SIZE=1 is not a distributed launch (the spec's WORLD_SIZE>1): the state is a single
    # process's, on the CUDA device it names, and collectives run alone.
    script.write_text(
        "import torch, distributed_ext as dx\n"
        "with dx.distributed_run() as state:\n"
        "    t = torch.ones(1, device=state.device)\n"
        "    total = dx.all_reduce('ranks', lambda: state.rank, sum)\n"
        "    print(f'RESULT {state.rank} {state.world_size} {t.device} {total}', flush=True)\n")
    proc = run_torchrun([str(script)], nproc=1, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT 0 1 cuda:0 0" in proc.stdout, proc.stdout


@pytest.mark.parametrize("args", ["", "device='cpu'"], ids=["default", "cpu"])
def test_distributed_run_under_torchrun_without_gpus(tmp_path, args):
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs: distributed_run binds cuda:LOCAL_RANK there")
    script = tmp_path / "run.py"
    script.write_text(_RUN_SCRIPT % args)
    proc = run_torchrun([str(script)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(re.findall(r"RESULT [^\n]*?t=\d\.\d", proc.stdout))
    assert lines == [f"RESULT rank={r} world=2 device=cpu backend=gloo total=1 t=2.0"
                     for r in range(2)], proc.stdout


def _run_that_sets_up_a_group_in_the_body():
    with dx.distributed_run(device="cpu") as state:
        assert state.world_size == 1
        path = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        assert dx.is_initialized()
    return dx.is_initialized()


def test_distributed_run_destroys_the_group_the_body_set_up():
    assert assert_all_ok(run_ranks(_run_that_sets_up_a_group_in_the_body, 1, init=False)) == [False]


def _run_in_callers_group():
    with dx.distributed_run(timeout=datetime.timedelta(seconds=30), device="cpu") as state:
        seen = (state.rank, state.world_size, str(state.device))
    # The caller's group is left alone, and still works.
    t = torch.ones(1)
    dist.all_reduce(t)
    return seen, dx.is_initialized(), t.item()


def test_distributed_run_leaves_a_callers_group_alone():
    values = assert_all_ok(run_ranks(_run_in_callers_group, 2))
    assert values == [((r, 2, "cpu"), True, 2.0) for r in range(2)]


def _run_with_body_raising_on_rank_1():
    with dx.distributed_run(device="cpu"):
        if dist.get_rank() == 1:
            raise ValueError("body failed on purpose")
    return "rank 0 left the run normally"


def test_body_raising_in_a_run_of_several_ranks_aborts_that_rank():
    res = run_ranks(_run_with_body_raising_on_rank_1, 2, timeout=60)
    assert res[0].ok and res[0].value == "rank 0 left the run normally"
    assert res[1].exit_code == 1 and not res[1].timed_out
    assert res[1].error_type is None  # it left through abort(), not by raising
    assert "Traceback" in res[1].output and "ValueError: body failed on purpose" in res[1].output


def _run_with_system_exit():
    with dx.distributed_run(device="cpu"):
        if dist.get_rank() == 1:
            raise SystemExit(3)
    return "ok"


def test_system_exit_in_the_body_propagates():
    res = run_ranks(_run_with_system_exit, 2)
    assert res[0].ok and res[1].exit_code == 3 and "Traceback" not in res[1].output


def _abort_with_code():
    try:
        raise KeyError("why we abort")
    except KeyError:
        dx.abort(7)


def test_abort_prints_traceback_and_exits_with_code():
    res = run_ranks(_abort_with_code, 1, init=False)
    assert res[0].exit_code == 7 and "KeyError: 'why we abort'" in res[0].output


def test_a_single_process_without_a_gpu_runs_on_the_cpu_and_says_so(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="device='cpu'"):
        with dx.distributed_run() as state:
            t = torch.ones(2, device=state.device)  # the README's snippet's first tensor
    assert state.device == torch.device("cpu") and t.device.type == "cpu"
    assert (state.rank, state.world_size) == (0, 1)


def test_fsdp2_wrap_without_a_process_group_says_how_to_set_one_up(monkeypatch):
    import torch.distributed as dist

    transformers = pytest.importorskip("transformers")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(RuntimeError, match="no process group is set up") as info:
        dx.fsdp2_wrap(model)
    assert "distributed_run" in str(info.value) and "init_process_group" in str(info.value)
    assert not dx.is_fsdp2_model(model)  # nothing was wrapped
