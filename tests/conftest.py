import os
import sys

import pytest

# The harness module lives next to the tests; make it importable under one name everywhere.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ram_path():
    """A fresh directory on a RAM filesystem (/dev/shm), removed afterwards: where every rank
    writes through a shared mapping of the files (``files.writers.MAP_RAM_FILES``)."""
    import shutil
    import tempfile

    from distributed_ext import _direct_io

    if not os.path.isdir("/dev/shm") or not _direct_io.on_ram_filesystem("/dev/shm/x"):
        pytest.skip("needs /dev/shm on tmpfs (a RAM filesystem) to write mapped files")
    path = tempfile.mkdtemp(prefix="dext-test-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
