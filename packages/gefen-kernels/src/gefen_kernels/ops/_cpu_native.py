"""Build and load the native CPU step (``_cpu_step.c``) with the system C compiler.

The library is compiled once per machine at first use (about a second) into a cache
directory and loaded with :mod:`ctypes`; nothing is built at install time. Where no compiler
is found, the build fails, or ``GEFEN_CPU_STEP=reference`` is set, :func:`library` returns
``None`` and the CPU ops take the PyTorch references (same bits, slower). Why a compiled
C file and not ``torch.compile``'s CPU code generation: docs/decisions.md ("The CPU step").

Environment:

* ``GEFEN_CPU_STEP``: ``native`` (default) or ``reference``;
* ``GEFEN_KERNELS_CACHE``: the cache directory (default ``$XDG_CACHE_HOME/gefen_kernels`` or
  ``~/.cache/gefen_kernels``, else the system temporary directory);
* ``CC``: the compiler (default: the first of ``cc``, ``gcc``, ``clang`` on ``PATH``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = ["library", "status"]

# -ffp-contract=off: no fused multiply-add, every operation rounded on its own (the canonical
# rounding sequence of gefen_kernels._numerics); no -ffast-math. -march=native for this CPU's
# vector units: the cache key includes the CPU's feature flags, so another CPU sharing the
# cache directory builds its own library.
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off",
          "-fno-math-errno")
_SOURCE = Path(__file__).with_name("_cpu_step.c")

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    env = os.environ.get("GEFEN_KERNELS_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "gefen_kernels"


def _compiler() -> str | None:
    env = os.environ.get("CC")
    if env:
        return shutil.which(env.split()[0]) and env
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    """This CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines()
            if line.split(":")[0].strip() in ("flags", "Features", "model name")]
    return "\n".join(dict.fromkeys(keep))


def _build(source: bytes, cc: str) -> Path:
    version = subprocess.run([*cc.split(), "--version"], capture_output=True, timeout=60,
                             check=False).stdout
    key = hashlib.sha256(source + repr((_FLAGS, cc, platform.machine(), sys.platform,
                                        _cpu_flags())).encode() + version).hexdigest()[:20]
    suffix = ".dll" if sys.platform == "win32" else ".so"
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / "gefen_kernels"):
        target = directory / f"cpu_step-{key}{suffix}"
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=directory)
        os.close(fd)
        try:
            done = subprocess.run([*cc.split(), *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)  # atomic: concurrent builds of one key agree
            return target
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"no writable cache directory (tried {_cache_dir()} and the temporary "
                       "directory); set GEFEN_KERNELS_CACHE")


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64, u64, f = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64,
                         ctypes.c_float)
    lib.gefen_cpu_step.restype = None
    lib.gefen_cpu_step.argtypes = [p, i, p, i, p, p, i64, i64, i64, p, p, p, i64, f, p, p,
                                   f, f, f, f, f, f, f, i, i, u64, i]
    lib.gefen_cpu_muon.restype = None
    lib.gefen_cpu_muon.argtypes = [p, i, p, p, i64, i64, i64, p, p, p, p, f, f, i, i, u64, i]


def library() -> ctypes.CDLL | None:
    """The loaded native library, or ``None`` (then :func:`status` says why). Built when
    the process first needs it; a failure is remembered for the process and reported once as
    a warning."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib: ctypes.CDLL | None = None
        mode = os.environ.get("GEFEN_CPU_STEP", "native").strip().lower()
        if mode == "reference":
            reason = "GEFEN_CPU_STEP=reference"
        elif mode not in ("", "native"):
            reason = f"GEFEN_CPU_STEP={mode!r} is not 'native' or 'reference'"
        else:
            cc = _compiler()
            if cc is None:
                reason = "no C compiler found (install gcc or clang, or set CC)"
            else:
                try:
                    lib = ctypes.CDLL(str(_build(_SOURCE.read_bytes(), cc)))
                    _declare(lib)
                    reason = "native"
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    lib = None
                    reason = f"building the native CPU step failed: {exc}"
            if lib is None:
                warnings.warn(
                    f"gefen_kernels: {reason}; CPU tensors take the PyTorch reference step "
                    "(same results, several times slower). Set GEFEN_CPU_STEP=reference to "
                    "silence this.", RuntimeWarning, stacklevel=3)
        _state["reason"] = reason
        _state["lib"] = lib
        return lib


def status() -> str:
    """``"native"`` when the native CPU step is in use, else why not (builds it first)."""
    library()
    return str(_state["reason"])
