"""Compute kernels of the runtime. ``reference`` is plain torch (every device, the fallback);
faster backends (C++ for CPUs, Triton for CUDA) implement the same functions."""

from . import reference

__all__ = ["reference"]
