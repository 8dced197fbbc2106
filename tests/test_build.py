"""setup.py's choice of extension: printed, forced by DISTRIBUTED_EXT_CUDA, loud when impossible."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from harness import REPO
from torch.utils import cpp_extension


def _setup(env_value: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("DISTRIBUTED_EXT_CUDA", None)
    if env_value is not None:
        env["DISTRIBUTED_EXT_CUDA"] = env_value
    # --version builds nothing: it runs setup.py's choice and prints the version.
    return subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cpu_build_forced_and_printed():
    proc = _setup("0")
    assert proc.returncode == 0, proc.stderr
    assert "building CppExtension" in proc.stderr and "DISTRIBUTED_EXT_CUDA=0" in proc.stderr


def test_choice_printed_by_default():
    proc = _setup(None)
    assert proc.returncode == 0, proc.stderr
    cuda_possible = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    expected = "CUDAExtension" if cuda_possible else "CppExtension"
    assert f"building {expected} against torch {torch.__version__}" in proc.stderr


def test_cuda_forced_fails_loudly_when_impossible():
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None:
        pytest.skip("CUDA can be built here (a CUDA torch and a toolkit are present)")
    proc = _setup("1")
    assert proc.returncode != 0
    assert "DISTRIBUTED_EXT_CUDA=1 but CUDA cannot be built" in proc.stderr
    assert "is not a CUDA build" in proc.stderr or "no CUDA toolkit" in proc.stderr


def test_bad_setting_is_refused():
    proc = _setup("yes")
    assert proc.returncode != 0 and "must be 0, 1 or unset" in proc.stderr


def test_cuda_sources_compile_with_nvcc(tmp_path):
    # A syntax/type check of csrc/cuda/*.cu where nvcc exists, also on machines without a GPU.
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA sources can only be checked where a toolkit is")
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    cuda_dir = os.path.join(REPO, "csrc", "cuda")
    sources = sorted(f for f in os.listdir(cuda_dir) if f.endswith(".cu"))
    assert sources
    for name in sources:
        proc = subprocess.run(
            [nvcc, "-c", "-std=c++17", f"-I{include}", os.path.join(cuda_dir, name),
             "-o", str(tmp_path / (name + ".o"))],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
