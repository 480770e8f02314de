"""Build and load the C kernels shipped beside this file (``quant_matvec.c``) with the machine's own
C compiler, for the CPU this runs on (``-march=native``), once per machine.

The library is cached under ``$MINILLM_CACHE`` (default ``~/.cache/minillm``) by a hash of the
source, the compiler, its flags and the CPU's feature flags: a home directory shared by machines
with different CPUs builds one library per CPU. Several processes building at once each write a
file of their own and rename it into place. No compiler, or a build that fails: ``library()``
returns None and ``library_error()`` says why; the callers keep their other paths.

``operators()`` builds ``quant_ops.cpp`` the same way with the C++ compiler, against the installed
torch: the kernels as PyTorch operators whose implementation is C++, so that calling one from a
compiled step does not go through Python (a few seconds to build, once per torch and compiler).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("quant_matvec.c")
# tried in order: the first that builds is used (OpenMP and -march=native are not everywhere)
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3", "-mcpu=native"),
    ("-O3",),
)
BUILD_TIMEOUT_S = 120

_state: dict = {}


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> str:
    """The CPU's feature flags as the kernel sees them (Linux), else the machine's name."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm")) / "kernels"


def _target(source: bytes, cc: str, flags: tuple[str, ...], name: str = "quant_matvec") -> Path:
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(), cpu_flags().encode()]))
    return cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def _compile(cmd: list[str], target: Path) -> str | None:
    """Run ``cmd`` with the output file its last argument, into ``target`` -> None, or the error.
    Each process writes a file of its own and renames it into place. A cache folder it cannot
    write raises OSError."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cmd, tmp], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        return str(e)
    if done.returncode == 0:
        os.replace(tmp, target)
        return None
    os.unlink(tmp)
    lines = done.stderr.strip().splitlines() or ["?"]
    return next((line for line in lines if "error" in line), lines[-1])


def _build(cc: str, flag_sets: tuple[tuple[str, ...], ...] = FLAG_SETS) -> Path:
    source = SOURCE.read_bytes()
    targets = {flags: _target(source, cc, flags) for flags in flag_sets}
    built = next((t for t in targets.values() if t.exists()), None)  # a flag set that built before
    if built is not None:
        return built
    errors = []
    for flags, target in targets.items():
        error = _compile([cc, *flags, "-shared", "-fPIC", str(SOURCE), "-lm", "-o"], target)
        if error is None:
            return target
        errors.append(f"{' '.join(flags)}: {error}")
    raise OSError("the C kernels did not build: " + "; ".join(errors))


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on first use), or None where they cannot be built here."""
    if "lib" in _state:
        return _state["lib"]
    lib, error = None, None
    if os.environ.get("MINILLM_NATIVE", "1") == "0":
        error = "turned off by MINILLM_NATIVE=0"
    elif (cc := compiler()) is None:
        error = "no C compiler found (set CC, or install gcc or clang)"
    else:
        try:
            lib = _declare(ctypes.CDLL(str(_build(cc))))
        except OSError as e:
            error = str(e)
    _state.update(lib=lib, error=error)
    return lib


def library_built_with(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernels built with these flags only (another instruction set's path, for tests)."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC, or install gcc or clang)")
    return _declare(ctypes.CDLL(str(_build(cc, (flags,)))))


def library_error() -> str | None:
    library()
    return _state["error"]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.q8_f32.argtypes = [p, i, i, p, p, i, p, n]
    lib.q8_f32.restype = None
    lib.q8_i8.argtypes = [p, i, i, p, p, i, p, n]
    lib.q8_i8.restype = n
    lib.q4_f32.argtypes = [p, i, i, p, p, p, i, i, i, p, n]
    lib.q4_f32.restype = n
    lib.minillm_isa.restype = n
    return lib


# ---- the kernels as PyTorch operators implemented in C++ (quant_ops.cpp) ----------------------

OPS_SOURCE = Path(__file__).with_name("quant_ops.cpp")


def cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def operators() -> Path | None:
    """The C++ implementations of ``compression.cpu_kernels``' operators, built against this
    torch (its headers and libraries), or None where they cannot be (``operators_error()`` says
    why): the operators then keep their Python implementations. ``MINILLM_CPP_OPS=0`` keeps those.
    A build that failed is remembered beside where it would be (``.failed``), not retried by
    every process."""
    if "ops" in _state:
        return _state["ops"]
    path, error = None, None
    if os.environ.get("MINILLM_CPP_OPS", "1") == "0":
        error = "turned off by MINILLM_CPP_OPS=0"
    elif (cxx := cxx_compiler()) is None:
        error = "no C++ compiler found (set CXX, or install g++ or clang++)"
    else:
        try:
            path = _build_operators(cxx)
        except OSError as e:  # a cache it cannot write, a build that failed (now or before)
            error = f"the C++ operators did not build: {e}"
    _state.update(ops=path, ops_error=error)
    return path


def _build_operators(cxx: str) -> Path:
    import torch
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()[0]
    flags = (
        "-O2",
        "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-L{libs}",
        f"-Wl,-rpath,{libs}",
    )
    target = _target(OPS_SOURCE.read_bytes(), cxx, (*flags, torch.__version__), "quant_ops")
    failed = target.with_suffix(".failed")
    if target.exists():
        return target
    if failed.exists():
        raise OSError(f"{failed.read_text().strip()} (an earlier build; delete {failed} to retry)")
    cmd = [cxx, *flags, "-shared", "-fPIC", str(OPS_SOURCE), "-lc10", "-ltorch_cpu", "-o"]
    if (error := _compile(cmd, target)) is not None:
        if "timed out" not in error:  # a compiler that refused, not a machine too busy to finish
            failed.write_text(error + "\n")
        raise OSError(error)
    return target


def operators_error() -> str | None:
    operators()
    return _state["ops_error"]
