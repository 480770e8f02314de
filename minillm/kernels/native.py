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


def _on_path(*names: str | None) -> str | None:
    """The first of ``names`` that is a program on the PATH (None entries skipped), or None."""
    return next((shutil.which(n) for n in names if n and shutil.which(n)), None)


def compiler() -> str | None:
    return _on_path(os.environ.get("CC"), "cc", "gcc", "clang")


def _built_once(key: str, switch: str, find, missing: str, build, failed: str = ""):
    """``_state[key]``: ``build(tool)`` on first use, ``tool = find()``; or None, with the reason
    in ``_state[key + "_error"]``: turned off by the environment variable ``switch``, no tool
    (``missing``), or the OSError ``build`` raised (after ``failed``)."""
    if key not in _state:
        value, error = None, None
        if os.environ.get(switch, "1") == "0":
            error = f"turned off by {switch}=0"
        elif (tool := find()) is None:
            error = missing
        else:
            try:
                value = build(tool)
            except OSError as e:  # a build that failed (now or before), a cache it cannot write
                error = f"{failed}{e}"
        _state.update({key: value, f"{key}_error": error})
    return _state[key]


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


NO_CC = "no C compiler found (set CC, or install gcc or clang)"


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on first use), or None where they cannot be built here."""
    return _built_once("lib", "MINILLM_NATIVE", compiler, NO_CC, lambda cc: _declare(ctypes.CDLL(str(_build(cc)))))


def library_built_with(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernels built with these flags only (another instruction set's path, for tests)."""
    cc = compiler()
    if cc is None:
        raise OSError(NO_CC)
    return _declare(ctypes.CDLL(str(_build(cc, (flags,)))))


def library_error() -> str | None:
    library()
    return _state["lib_error"]


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
    return _on_path(os.environ.get("CXX"), "c++", "g++", "clang++")


def operators() -> Path | None:
    """The C++ implementations of ``compression.cpu_kernels``' operators, built against this
    torch (its headers and libraries), or None where they cannot be (``operators_error()`` says
    why): the operators then keep their Python implementations. ``MINILLM_CPP_OPS=0`` keeps those.
    A build that failed is remembered beside where it would be (``.failed``), not retried by
    every process."""
    missing = "no C++ compiler found (set CXX, or install g++ or clang++)"
    failed = "the C++ operators did not build: "
    return _built_once("ops", "MINILLM_CPP_OPS", cxx_compiler, missing, _build_operators, failed)


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
