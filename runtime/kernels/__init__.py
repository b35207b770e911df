"""Compute kernels of the runtime: ``reference`` (plain torch, every device), ``cpu_*`` (C++)
and ``triton_*`` (CUDA). The engine reaches them through one backend (``runtime.backends``)."""

from . import reference

__all__ = ["reference"]
