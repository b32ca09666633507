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

__all__ = ["Shared", "TensorDesc", "library", "status"]

# -ffp-contract=off: no fused multiply-add, every operation rounded on its own (the canonical
# rounding sequence of gefen_kernels._numerics); no -ffast-math. -fno-trapping-math only lets
# the vectoriser compute both sides of a select (no value changes: floating-point exceptions
# are never read). -march=native for this CPU's vector units: the cache key includes the CPU's
# feature flags, so another CPU sharing the cache directory builds its own library.
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off",
          "-fno-math-errno", "-fno-trapping-math")
# One call splits its blocks over threads itself: with OpenMP where the compiler has it (the
# library then resolves the libgomp torch has loaded, the same soname, and shares torch's
# pool: no thread of ours competes with the worker torch's last parallel region left spinning),
# else with its own POSIX threads.
_THREAD_FLAGS = (("-fopenmp",), ("-pthread",))
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
    key = hashlib.sha256(source + repr((_FLAGS, _THREAD_FLAGS, cc, platform.machine(),
                                        sys.platform, _cpu_flags())).encode()
                         + version).hexdigest()[:20]
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
            for threading_flags in _THREAD_FLAGS:
                done = subprocess.run(
                    [*cc.split(), *_FLAGS, *threading_flags, "-o", tmp, str(_SOURCE), "-lm"],
                    capture_output=True, text=True, timeout=300, check=False)
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)  # atomic: concurrent builds of one key agree
            return target
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"no writable cache directory (tried {_cache_dir()} and the temporary "
                       "directory); set GEFEN_KERNELS_CACHE")


class Shared(ctypes.Structure):
    """``gefen_shared`` of ``_cpu_step.c``: the codebook and options of one call."""

    _fields_ = [("cb", ctypes.c_void_p), ("cb_out", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("b1", ctypes.c_float), ("omb1", ctypes.c_float),
                ("eps", ctypes.c_float), ("maximize", ctypes.c_int32),
                ("stochastic", ctypes.c_int32), ("nesterov", ctypes.c_int32)]


class TensorDesc(ctypes.Structure):
    """``gefen_tensor`` of ``_cpu_step.c``: one tensor of a call (addresses and scalars)."""

    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p),
                ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("sqrt_v", ctypes.c_void_p), ("r", ctypes.c_void_p), ("k", ctypes.c_void_p),
                ("r_total", ctypes.c_void_p), ("num_blocks", ctypes.c_int64),
                ("period", ctypes.c_int64), ("rows", ctypes.c_int64), ("ncols", ctypes.c_int64),
                ("pdt", ctypes.c_int32), ("gdt", ctypes.c_int32), ("factored", ctypes.c_int32),
                ("write_param", ctypes.c_int32), ("lr", ctypes.c_float), ("bc2", ctypes.c_float),
                ("bc1_recip", ctypes.c_float), ("decay", ctypes.c_float),
                ("inv_rbar", ctypes.c_float), ("seed", ctypes.c_uint64)]


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.gefen_cpu_run.restype = None
    lib.gefen_cpu_run.argtypes = [p, i64, p, i, i]
    lib.gefen_cpu_block_v.restype = None
    lib.gefen_cpu_block_v.argtypes = [p, p, i64, i64, f, f]
    lib.gefen_cpu_factored_ema.restype = None
    lib.gefen_cpu_factored_ema.argtypes = [p, p, i64, f, f, f]


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
    """``"native"`` when CPU tensors step through the native CPU step, else why they take the
    PyTorch references (no compiler, a failed build, ``GEFEN_CPU_STEP=reference``). Builds
    the library first if this process has not. Public as ``gefen_kernels.cpu_step_status``:
    the first thing to check when a CPU or offloaded step is slow."""
    library()
    return str(_state["reason"])
