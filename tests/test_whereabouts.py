"""Where each rank is (distributed_ext/_watch/whereabouts.py): a rank waiting for a late peer
names it, and where it is, while it waits; ranks in different calls of ours raise at once,
naming both; the group's timeout is raised naming our call and the absent rank."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import distributed_ext as dx
from distributed_ext._watch import whereabouts


def _late_rank(out: str) -> float:
    dx.all_reduce("warm", lambda: 1, sum)
    if dist.get_rank() == 1:
        time.sleep(11)  # alive (its heartbeat beats), only not in the call
    start = time.monotonic()
    dx.export_hf_checkpoint({f"r{dist.get_rank()}": torch.ones(1000)}, out)
    return time.monotonic() - start


def test_a_rank_waiting_for_a_late_one_names_it_every_interval_and_the_call_then_succeeds(
        tmp_path):
    # Every 5 s here (30 s by default: test_the_warning_interval_is_checked).
    results = run_ranks(_late_rank, 2, str(tmp_path / "ckpt"), timeout=150, pg_timeout=120,
                        env={"DISTRIBUTED_EXT_WAIT_WARNING_S": "5"})
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert results[0].value > 9  # it did wait for rank 1
    said = [line for line in results[0].output.splitlines() if "has waited" in line]
    # A warning at 5 s and at 10 s, naming the absent rank and where it is.
    assert len(said) == 2, results[0].output[-3000:]
    assert "has waited 5 s for rank 1" in said[0] and "has waited 10 s" in said[1], said
    assert "export_hf_checkpoint (metadata)" in said[0], said[0]
    assert "rank 1 is in none of distributed_ext's calls since" in said[0], said[0]
    assert "its last: all_reduce('warm')" in said[0], said[0]
    assert "died" not in results[0].output and "has waited" not in results[1].output
    assert os.path.exists(tmp_path / "ckpt" / "model.safetensors")


def _different_calls(out: str, other: str) -> tuple:
    dx.all_reduce("warm", lambda: 1, sum)
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            dx.export_hf_checkpoint(torch.nn.Linear(4, 4), out)
        elif other == "gather_bytes":  # (its status round an all-gather too: records differ)
            dx.gather_bytes(b"abc", dst=0)
        else:  # (a broadcast against an all-gather: the two waits never meet)
            dx.broadcast_from("config", lambda: 1, 1)
        return ("ok", time.monotonic() - start)
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - start)


@pytest.mark.parametrize("other", ["gather_bytes", "broadcast_from"])
def test_ranks_in_different_calls_raise_at_once_naming_both(other, tmp_path):
    results = run_ranks(_different_calls, 2, str(tmp_path / "ckpt"), other, timeout=120)
    assert all(r.error_type is None for r in results), [r.describe() for r in results]
    for r in results:
        message, took = r.value
        assert took < 15, r.value
        assert "at the same point" in message, message
        # The export's first round is named as its own ("opening"), never as quantized layers.
        assert "export_hf_checkpoint (opening)" in message and other in message, message
        assert "quantized" not in message
    assert not os.path.exists(tmp_path / "ckpt")


def _never_joins() -> tuple:
    dx.all_reduce("warm", lambda: 1, sum)
    if dist.get_rank() == 1:
        time.sleep(14)  # alive, in none of our calls, past the group's timeout
        return ("slept",)
    start = time.monotonic()
    try:
        dx.all_reduce("batch_size", lambda: 8, min)
        return ("ok",)
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - start)


def test_the_groups_timeout_names_our_call_and_the_absent_rank_never_only_glooos_text():
    results = run_ranks(_never_joins, 2, timeout=90, pg_timeout=5,
                        env={"DISTRIBUTED_EXT_WAIT_WARNING_S": "off"})
    assert results[1].value == ("slept",), results[1].describe()
    message, took = results[0].value
    assert took < 13, results[0].value
    assert message.startswith("all_reduce('batch_size') (status round): the process group's "
                              "timeout passed while this rank waited for rank 1"), message
    assert "rank 1 is in none of distributed_ext's calls since" in message, message
    assert "died" not in message
    assert "has waited" not in results[0].output  # warnings off


def test_the_warning_interval_is_checked(monkeypatch):
    monkeypatch.delenv("DISTRIBUTED_EXT_WAIT_WARNING_S", raising=False)
    assert whereabouts._warn_every_s() == 30.0  # the default
    for raw, want in (("30", 30.0), ("2.5", 2.5), ("0", None), ("off", None)):
        monkeypatch.setenv("DISTRIBUTED_EXT_WAIT_WARNING_S", raw)
        assert whereabouts._warn_every_s() == want
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv("DISTRIBUTED_EXT_WAIT_WARNING_S", bad)
        with pytest.raises(ValueError, match="DISTRIBUTED_EXT_WAIT_WARNING_S"):
            whereabouts._warn_every_s()
        assert whereabouts._warn_every_s(strict=False) == 30.0


def test_a_note_round_trips_and_what_is_not_one_is_none():
    note = whereabouts.Note(3, "in", "abc", 7, "all_reduce('x')", "all_reduce('x') (data)", 1.5)
    assert whereabouts.Note.decode(note.encode().encode()) == note
    for bad in (b"", b"x", b"1\x1fmaybe\x1fa\x1f1\x1fc\x1fw\x1f0", b"1\x1fin\x1fa\x1fN\x1fc\x1fw\x1f0"):
        assert whereabouts.Note.decode(bad) is None
    mine = whereabouts.Note(1, "in", "abc", 7, "c", "w", 0.0)
    assert whereabouts.joined(note, mine)  # (at our point, in a call)
    assert whereabouts.joined(whereabouts.Note(1, "out", "abc", 8, "c", "w", 0.0), mine)
    assert not whereabouts.joined(whereabouts.Note(1, "out", "abc", 7, "c", "w", 0.0), mine)
    assert not whereabouts.joined(whereabouts.Note(1, "in", "xyz", 9, "c", "w", 0.0), mine)
    assert not whereabouts.joined(None, mine)
