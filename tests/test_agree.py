"""The status record of the fail-together protocol: encode/decode, and malformed peers."""

from __future__ import annotations

import struct

import pytest

from distributed_ext import _agree
from distributed_ext._agree import Status


def test_round_trip_of_every_field():
    s = Status(kind=_agree.ERROR, code=0, fields=(1, -2, 2**62, 0, 5, 6, 7, 8), label="calib/amax",
               error_type="ValueError", message="bad batch")
    d = Status.decode(bytes(s.encode().numpy()))
    assert (d.kind, d.code, d.fields, d.label, d.error_type, d.message) == (
        s.kind, s.code, s.fields, s.label, s.error_type, s.message)
    assert d.same_label(s) and d.describe() == "ValueError: bad batch"


def test_long_and_odd_labels_compare_whole_and_show_clipped():
    a, b = "x" * 1000 + "a", "x" * 1000 + "b"
    da = Status.decode(bytes(Status(label=a).encode().numpy()))
    db = Status.decode(bytes(Status(label=b).encode().numpy()))
    assert not da.same_label(db) and da.same_label(Status(label=a))
    assert len(da.label.encode()) <= 256 and da.label.endswith("...")
    odd = Status.decode(bytes(Status(label="lone \udc80").encode().numpy()))
    assert odd.same_label(Status(label="lone \udc80")) and "\\udc80" in odd.label


def test_exit_records_and_unprintable_exceptions():
    assert Status.failed(SystemExit(3)).describe() == "SystemExit(3)"
    assert Status.failed(SystemExit("bye")).code == 1

    class Bad(Exception):
        def __str__(self):
            raise RuntimeError("no")

        def __repr__(self):
            raise RuntimeError("no")

    s = Status.failed(Bad())
    assert s.error_type == "Bad" and "whose str() and repr() raise" in s.message
    assert Status.failed(KeyboardInterrupt()).error_type == "KeyboardInterrupt"


def test_long_messages_are_clipped_to_the_record():
    s = Status.failed(ValueError("m" * 10_000))
    d = Status.decode(bytes(s.encode().numpy()))
    assert d.message.endswith("...") and len(d.message.encode()) <= 1024


@pytest.mark.parametrize("mutate, text", [
    (lambda r: r[:100], "wrong size or magic"),
    (lambda r: b"XXXX" + r[4:], "wrong size or magic"),
    (lambda r: r[:4] + bytes([9]) + r[5:], "kind or lengths"),
])
def test_malformed_records_from_a_peer_raise_value_error(mutate, text):
    record = bytes(Status(label="x").encode().numpy())
    with pytest.raises(ValueError, match=text):
        Status.decode(mutate(record))


def test_lengths_past_the_record_are_refused():
    record = bytearray(Status(label="x").encode().numpy())
    size = struct.calcsize(f"<4sBq{_agree.N_FIELDS}q16s")
    struct.pack_into("<H", record, size, 4000)  # a label length beyond the 2 KiB record
    with pytest.raises(ValueError, match="kind or lengths"):
        Status.decode(bytes(record))


def _one_round(failing_rank, kind):
    import torch.distributed as dist

    ctx = _agree.resolve_group(None, "test")
    cleaned = []

    def step():
        if dist.get_rank() == failing_rank:
            raise kind("the disk is full")
        return (dist.get_rank() * 10,)

    try:
        statuses = _agree.agree("test", ctx, step, stage="writing",
                                cleanup=lambda: cleaned.append(True))
        outcome = ("ok", [s.fields[0] for s in statuses])
    except BaseException as exc:  # noqa: BLE001 - the outcome is the test's subject
        outcome = (type(exc).__name__, str(exc))
    # The group is still usable: a failed round is agreed, not a hang.
    after = _agree.agree("test", ctx, lambda: None, stage="after")
    return outcome, cleaned, len(after)


@pytest.mark.parametrize("kind", [OSError, KeyboardInterrupt])
def test_a_round_that_fails_on_one_rank_raises_on_every_rank_after_cleaning_up(kind):
    from harness import assert_all_ok, run_ranks

    values = assert_all_ok(run_ranks(_one_round, 3, 1, kind, timeout=120))
    for r, (outcome, cleaned, after) in enumerate(values):
        assert cleaned == [True] and after == 3, (r, cleaned)
        if r == 1:  # its own exception, as raised
            assert outcome == (kind.__name__, "the disk is full"), outcome
        else:  # the others name it and the round
            assert outcome[0] == "RuntimeError" and outcome[1].startswith(
                f"test (writing): rank 1 failed with {kind.__name__}: the disk is full"), outcome
    values = assert_all_ok(run_ranks(_one_round, 2, None, OSError, timeout=120))
    assert [v[0] for v in values] == [("ok", [0, 10])] * 2 and [v[1] for v in values] == [[]] * 2
