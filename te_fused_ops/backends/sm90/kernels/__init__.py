"""CuTe DSL kernels. Importing this package needs neither cutlass nor a GPU."""

import os

__all__ = ["sm90_unavailable_reason"]


def sm90_unavailable_reason() -> str | None:
    """None when the sm90 kernels can run here (or compile, with CUTE_DSL_ARCH=sm_90a), else why not."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"sm90 backend: nvidia-cutlass-dsl not importable ({type(e).__name__}: {e})"
    if os.environ.get("CUTE_DSL_ARCH", "") == "sm_90a":
        return None
    import torch

    if not torch.cuda.is_available():
        return "sm90 backend: no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"sm90 backend: compute capability {major}.{minor}, needs 9.0"
    return None
