"""Decode time per weight of each weight format in this runtime, measured once per machine.

A decode step multiplies one activation row by every weight, so its time per weight is what a
format costs at decode. For each format one matrix with random codes is built, laid out by the
backend the engine would choose on the CPU, and multiplied by one row; the matrix holds at least
``MIN_BYTES`` so that it streams from memory as a model's weights do, not from the cache. The
formats take turns over several rounds; the median seconds over its weights is a format's figure. Results are cached per CPU model, thread
count, torch version and kernel build (``cache_dir("format_speed")``), so a machine measures once
(delete the file to measure again, e.g. after the first measurement ran on a busy machine).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
from llmopt.core.atomic import atomic_file
from llmopt.core.paths import cache_dir
from llmopt.formats.registry import format_for
from llmopt.formats.schemes import QuantScheme

from .backends import choose_backend
from .layers import DenseLinear, QuantLinear

IN_FEATURES = 4096
MIN_BYTES = 64 << 20  # each format's matrix: past the last-level cache of common CPUs
REPEATS = 15
CACHE_VERSION = 1


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type."""
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _stored_bits(scheme: QuantScheme | None) -> float:
    return 32.0 if scheme is None else float(format_for(scheme).info_bits)  # grid codes run as 4-bit indices


def _random_linear(scheme: QuantScheme | None, rows: int, generator: torch.Generator) -> DenseLinear | QuantLinear:
    """A ``[rows, IN_FEATURES]`` linear of ``scheme`` (None: float32) with random codes and scales."""
    k = IN_FEATURES
    if scheme is None:
        return DenseLinear.from_weight(torch.randn(rows, k, generator=generator) * 0.02)
    groups = k // (scheme.group_size or k)
    fmt = format_for(scheme)
    codes = fmt.random_codes(rows, k, generator)
    scale = torch.rand(rows, groups, generator=generator) * 0.01 + 1e-3
    zero = None if scheme.symmetric else torch.randint(-2, 2, (rows, groups), generator=generator, dtype=torch.int32)
    return QuantLinear(codes, scale, zero, scheme.group_size, None, scheme.name, kernel=fmt.kernel)


def _timed_linear(scheme: QuantScheme | None, backend, min_bytes: int):
    rows = max(256, math.ceil(min_bytes * 8 / (IN_FEATURES * _stored_bits(scheme))))
    lin = _random_linear(scheme, -(-rows // 64) * 64, torch.Generator().manual_seed(0))
    backend.prepare_linear(lin)
    return lin, lin.out_features * IN_FEATURES


def measure_formats(schemes: list[QuantScheme | None], threads: int, min_bytes: int | None = None) -> list[float]:
    """Seconds per weight of one decode-row product in each scheme (None: float32) on the CPU.
    The formats take turns in ``REPEATS`` rounds, so a change in the machine's load touches all."""
    torch.set_num_threads(threads)
    backend = choose_backend("auto", torch.device("cpu"), torch.float32)
    linears = [_timed_linear(scheme, backend, min_bytes or MIN_BYTES) for scheme in schemes]
    x = torch.randn(1, IN_FEATURES, generator=torch.Generator().manual_seed(1))
    times: list[list[float]] = [[] for _ in linears]
    for round_ in range(REPEATS + 1):
        for (lin, _), seconds in zip(linears, times):
            start = time.perf_counter()
            lin(x)
            lin(x)
            if round_:  # the first round pages the weights in
                seconds.append((time.perf_counter() - start) / 2)
    return [statistics.median(seconds) / weights for (_, weights), seconds in zip(linears, times)]


def signature(scheme: QuantScheme | None) -> str:
    """What the kernels' speed depends on: bits, group size, symmetry (``float32`` for float)."""
    if scheme is None:
        return "float32"
    group = f"g{scheme.group_size}" if scheme.group_size else "row"
    fmt = format_for(scheme)
    if fmt.grid is not None:  # nl4 / nl4x: the kernels run grid indices (super-block scales cost nothing extra)
        return f"grid{len(fmt.grid)}_{group}"
    return f"{scheme.weight_type}{scheme.num_bits}_{group}_{'sym' if scheme.symmetric else 'asym'}"


def _key(threads: int) -> str:
    sources = hashlib.sha256()
    for path in sorted((Path(__file__).parent / "kernels" / "csrc").iterdir()):
        sources.update(path.read_bytes())
    return f"v{CACHE_VERSION}|{cpu_model()}|threads={threads}|torch={torch.__version__}|kernels={sources.hexdigest()[:12]}"


def format_speeds(formats: dict[str, QuantScheme | None], threads: int | None = None,
                  cache: Path | None = None) -> dict[str, float]:
    """Seconds per weight at decode for every format named in ``formats`` (name → scheme, None
    for float), measured where the cache for this machine does not have them yet."""
    threads = threads or torch.get_num_threads()
    path = cache or cache_dir("format_speed") / "format_speed.json"
    try:
        stored = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        stored = {}
    key = _key(threads)
    known = dict(stored.get(key, {}))
    previous_threads = torch.get_num_threads()
    todo = {signature(scheme): scheme for scheme in formats.values() if signature(scheme) not in known}
    try:
        if todo:
            known.update(zip(todo, measure_formats(list(todo.values()), threads)))
    finally:
        torch.set_num_threads(previous_threads)
    if known != stored.get(key):
        stored[key] = known
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    return {name: known[signature(scheme)] for name, scheme in formats.items()}
