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


def _make_semaphore() -> str:
    """A named semaphore that the rank leaves alive, as tqdm's write lock is in a rank that
    saved with transformers or ModelOpt."""
    import multiprocessing

    _make_semaphore.kept = multiprocessing.get_context("spawn").Lock()  # type: ignore[attr-defined]
    return "made"


def test_a_ranks_semaphores_are_not_reported_leaked_when_the_spawner_exits():
    # The ranks leave by os._exit; the semaphores they made would outlive them, and the
    # spawner's resource tracker would warn "leaked semaphore objects" at its own exit.
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = (f"import sys; sys.path.insert(0, {here!r})\n"
              "from distributed_ext._spawn import run_local\n"
              "from test_spawn import _make_semaphore\n"
              "if __name__ == '__main__':\n"
              "    print([o.value for o in run_local(_make_semaphore, 2, timeout=60)])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "['made', 'made']" in done.stdout
    assert "leaked semaphore" not in done.stderr, done.stderr
