"""Builds distributed_ext._C; everything else about the package lives in pyproject.toml.

CUDAExtension when torch is a CUDA build and a CUDA toolkit is found (chosen by toolkit, not
by GPU: a GPU-less build machine still builds the CUDA module); CppExtension otherwise.
DISTRIBUTED_EXT_CUDA=0 forces the CPU build; DISTRIBUTED_EXT_CUDA=1 fails loudly if the CUDA
build is not possible. Build without isolation (pip install --no-build-isolation) so the
extension compiles against the torch that is installed, not a second one pip would fetch.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as exc:  # pragma: no cover - only on a broken build setup
    raise SystemExit(
        "distributed_ext: building needs torch installed first; run "
        "`pip install torch` then `pip install --no-build-isolation .`"
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))


def resolve_cuda_build() -> tuple[bool, str]:
    """Returns (build CUDA?, why), honouring DISTRIBUTED_EXT_CUDA."""
    wanted = os.environ.get("DISTRIBUTED_EXT_CUDA", "").strip()
    if wanted not in ("", "0", "1"):
        raise SystemExit(f"DISTRIBUTED_EXT_CUDA must be 0, 1 or unset, got {wanted!r}")
    if wanted == "0":
        return False, "DISTRIBUTED_EXT_CUDA=0"
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is not a CUDA build")
    if cpp_extension.CUDA_HOME is None:
        missing.append("no CUDA toolkit found (set CUDA_HOME)")
    if missing:
        if wanted == "1":
            raise SystemExit("DISTRIBUTED_EXT_CUDA=1 but CUDA cannot be built: " + "; ".join(missing))
        return False, "; ".join(missing)
    return True, f"torch CUDA {torch.version.cuda}, toolkit at {cpp_extension.CUDA_HOME}"


def resolve_extension():
    with_cuda, why = resolve_cuda_build()
    common = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    macros = [("DEXT_TORCH_VERSION", torch.__version__)]
    cxx = ["-O3", "-std=c++17"]
    if with_cuda:
        sources = [s for s in common if not s.endswith("_cpu.cpp")]
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        macros.append(("DEXT_CUDA_VERSION", torch.version.cuda))
        ext = cpp_extension.CUDAExtension(
            "distributed_ext._C",
            sources,
            define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
        )
        kind = "CUDAExtension"
    else:
        ext = cpp_extension.CppExtension(
            "distributed_ext._C", common, define_macros=macros, extra_compile_args={"cxx": cxx}
        )
        kind = "CppExtension"
    print(f"distributed_ext: building {kind} against torch {torch.__version__} ({why})", file=sys.stderr)
    return ext


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension with ninja, compiling into a folder of the checkout that
    outlives pip's temporary one: a second ``pip install -e .`` (the README's second command
    in the same venv) then recompiles only what changed, instead of every source again."""

    def finalize_options(self) -> None:
        super().finalize_options()
        tag = f"{sys.implementation.cache_tag}-torch{torch.__version__}"
        self.build_temp = os.path.join(HERE, "build", f"temp-{tag}")


setup(
    ext_modules=[resolve_extension()],
    cmdclass={"build_ext": BuildExt},
)
