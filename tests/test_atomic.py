"""distributed_ext._atomic: a file appears whole under its name, or not at all."""

from __future__ import annotations

import os

import pytest

from distributed_ext._atomic import replacing


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "result.json"
    path.write_bytes(b"old")
    with replacing(path, durable=True) as f:
        f.write(b"new bytes")
        assert path.read_bytes() == b"old"  # nothing under the name until the block ends
    assert path.read_bytes() == b"new bytes"
    with pytest.raises(KeyboardInterrupt):
        with replacing(str(path)) as f:
            f.write(b"half")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"new bytes"
    assert os.listdir(tmp_path) == ["result.json"]  # no temporary sibling left
