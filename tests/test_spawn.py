"""The local spawner (distributed_ext._spawn): what each rank's process is given."""

from __future__ import annotations

import torch

from distributed_ext._spawn import run_local


def _threads() -> int:
    return torch.get_num_threads()


def test_ranks_get_one_thread_each_as_under_torchrun_unless_told(monkeypatch):
    # Set in the rank's environment after the forkserver imported torch, OMP_NUM_THREADS
    # would be ignored; the spawner applies it (two ranks with two threads each on a 2-core
    # host spin against each other).
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [o.value for o in run_local(_threads, 2, timeout=60)] == [1, 1]
    told = run_local(_threads, 2, timeout=60, env={"OMP_NUM_THREADS": "3"})
    assert [o.value for o in told] == [3, 3]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the spawner's own setting, as torchrun keeps
    assert [o.value for o in run_local(_threads, 2, timeout=60)] == [3, 3]
