"""The project's small C++ kernels: built once per machine with torch's C++ extension builder (cached under
`~/.cache/torch_extensions`), loaded into the process, and checked against torch before anything uses them."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path


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
