"""The project's small C++ kernels: built once per machine with torch's C++ extension builder (cached under
`~/.cache/torch_extensions`), loaded into the process, and checked against torch before anything uses them."""
from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path


def compiler_missing() -> str | None:
    """None where the C++ compiler (`CXX`, else g++) is on PATH; else why not."""
    compiler = os.environ.get("CXX", "g++")
    return None if shutil.which(compiler) else f"no C++ compiler ({compiler}) on PATH"


def avx2_missing() -> str | None:
    """None where torch runs AVX2 (or AVX-512) code here, which the kernels are compiled for; else why not."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return None if capability in ("AVX2", "AVX512") else f"the CPU lacks AVX2 ({capability})"


def build_checked(name: str, source: Path, flags: list[str], check: Callable[[], str | None], what: str) -> str | None:
    """Build (or find built) and load the extension `name` from `source` with `flags` (OpenMP linked), then run
    `check` (None, or how the kernel disagrees with torch). -> None, or why the kernel cannot be used; a failed
    build is a warning, never an error: callers fall back to torch's own paths."""
    try:
        from torch.utils.cpp_extension import load

        load(name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
        return check()
    except Exception as e:  # noqa: BLE001 - any build failure just drops the kernel
        warnings.warn(f"{what} could not be built, it is not used: {e}", stacklevel=3)
        return f"build failed: {type(e).__name__}"
