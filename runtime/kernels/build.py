"""Compile C++ kernel sources once, at first use, into the user cache.

Every extension is built with torch's ``cpp_extension`` into ``<cache>/kernels/<name>-<hash>``,
where the hash covers the sources, the compiler flags and the torch version, so an edited source
or a new torch rebuilds and an unchanged one loads in milliseconds. ``LLMOPT_KERNEL_CACHE``
overrides the folder (tests share one across their per-test caches). Instruction-set choice is
made at run time inside the sources (``__attribute__((target(...)))`` variants selected with
``__builtin_cpu_supports``), so one build serves every x86-64 CPU. When no compiler is found or
the build fails, ``load_extension`` warns once and returns None: callers fall back to the plain
torch reference kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCES = Path(__file__).resolve().parent / "csrc"
CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]

_loaded: dict[str, ModuleType | None] = {}


def compiler_available() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def _digest(sources: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    for path in sorted(sources):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for path in sorted(SOURCES.glob("*.h")):  # shared headers
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(str(Path(torch.__file__).parent).encode())  # another venv's torch: its own folder (include paths differ)
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One build per folder at a time, by an OS lock that dies with its process; torch's own
    lock file, left behind by a build that was killed (which would make every later build wait
    for ever), is removed once this lock is held."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock file alone
        yield
        return
    with open(build_dir / "llmopt-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load_extension(name: str, sources: list[str]) -> ModuleType | None:
    """The compiled extension ``name`` from ``csrc/<sources>``, or None (with one warning) when it
    cannot be built here. Loaded modules are memoised per process."""
    if name in _loaded:
        return _loaded[name]
    module = None
    if os.environ.get("LLMOPT_KERNELS") == "reference":
        _loaded[name] = None
        return None
    if not compiler_available():
        warnings.warn(f"no C++ compiler found: llmopt's {name} kernels fall back to plain torch (slower); "
                      "install g++ or clang++ to enable them", RuntimeWarning, stacklevel=2)
    else:
        from llmopt.core.console import notice
        from llmopt.core.paths import cache_dir
        from torch.utils import cpp_extension

        paths = [SOURCES / s for s in sources]
        tag = f"{name}-{_digest(paths, CFLAGS)}"
        root = os.environ.get("LLMOPT_KERNEL_CACHE")
        build_dir = Path(root) / tag if root else cache_dir("kernels", tag)
        build_dir.mkdir(parents=True, exist_ok=True)
        fresh = not any(build_dir.glob("*.so"))
        if fresh:
            notice(f"compiling llmopt's {name} kernels (once, about a minute)")
        try:
            with _build_lock(build_dir):
                module = cpp_extension.load(
                    name=name, sources=[str(p) for p in paths], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                    extra_include_paths=[str(SOURCES)], build_directory=str(build_dir), verbose=False,
                )
        except Exception as exc:  # compiler errors, missing headers: fall back, say why
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"building llmopt's {name} kernels failed ({first}); falling back to plain torch",
                          RuntimeWarning, stacklevel=2)
    _loaded[name] = module
    return module


ISAS = ("scalar", "avx2", "avx512")  # the codes the C++ sources use (0, 1, 2); -1 = the best supported


class Extension:
    """A C++ extension built at first use (:func:`load_extension`); ``module()`` is None when it
    cannot be built here, and callers keep plain torch."""

    def __init__(self, name: str, sources: list[str]) -> None:
        self.name = name
        self.sources = sources

    def module(self) -> ModuleType | None:
        return load_extension(self.name, self.sources)

    def available(self) -> bool:
        """True when the extension is built (or can be) and not disabled by ``LLMOPT_KERNELS=reference``."""
        return self.module() is not None


class IsaExtension(Extension):
    """An extension whose kernels come in per-instruction-set variants chosen at run time; it
    exports ``supported_isas()`` and takes an ISA code (:meth:`isa_code`) with every call."""

    def __init__(self, name: str, sources: list[str]) -> None:
        super().__init__(name, sources)
        self._env_code: int | None = None  # LLMOPT_CPU_ISA's code, read once (a lookup costs as much as a small GEMV)

    def supported_isas(self) -> list[str]:
        """Instruction sets this CPU runs, slowest first (``scalar`` always)."""
        module = self.module()
        return list(module.supported_isas()) if module is not None else []

    def isa_code(self, isa: str | None) -> int:
        """The code of ``isa`` (None: ``LLMOPT_CPU_ISA``, read once; ``auto``: -1, the best one)."""
        from llmopt.core.errors import LlmoptError

        if isa is None:
            if self._env_code is None:
                self._env_code = self.isa_code(os.environ.get("LLMOPT_CPU_ISA") or "auto")
            return self._env_code
        if isa == "auto":
            return -1
        if isa not in ISAS:
            raise LlmoptError(f"unknown instruction set {isa!r} for the CPU kernels", f"use one of auto, {', '.join(ISAS)}")
        if isa not in self.supported_isas():
            raise LlmoptError(f"this CPU cannot run the {isa} kernels", f"use one of: auto, {', '.join(self.supported_isas())}")
        return ISAS.index(isa)
