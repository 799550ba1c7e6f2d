"""The counting CPU allocator: its C++ source (``counting_allocator.cpp``), built on first use, ctypes binding.

It backs :class:`~lightning_gpuopt.testing.SimulatedMemory` and the kernel-scratch measurement of
:func:`~lightning_gpuopt.memory.predict_peak` (:mod:`lightning_gpuopt.memory.scratch`).

A c10 CPU allocator (installed with ``c10::SetCPUAllocator`` while a SimulatedMemory is entered, the
previous one restored at exit) sees every CPU tensor allocation, including the temporaries that
kernels allocate below the dispatcher, and throws ``c10::OutOfMemoryError`` at allocation time, so
Python sees ``torch.OutOfMemoryError`` from any depth (autograd engine, optimizer kernels) just as on
CUDA. It also reports to the profiler like the default allocator, so ``torch.profiler`` memory events
still work under the simulation.

The library is built once per (source, torch build) into a cache directory with the
system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) -- no ninja, no pybind11: it only
includes c10 headers and exposes ``extern "C"`` functions, so a build takes a few seconds. Several
processes (DDP ranks) may ask at once: a file lock makes one build while the others wait, and the
result is moved into place atomically. Set ``LIGHTNING_GPUOPT_CACHE_DIR`` to choose the directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.resources
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

import torch

__all__ = ["NativeCounter", "NativeUnavailableError", "load_native", "native_status"]

_ABI_VERSION = 3

#: ``callback(requested, in_use, limit)``: called before an over-limit allocation raises.
OOM_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)

#: The C++ source, shipped as package data beside this module (``counting_allocator.cpp``).
_SOURCE = (importlib.resources.files(__package__) / "counting_allocator.cpp").read_text()


class NativeUnavailableError(RuntimeError):
    """The counting allocator cannot be built or loaded here (no compiler, unsupported platform...)."""


def _cache_dir() -> str:
    env = os.environ.get("LIGHTNING_GPUOPT_CACHE_DIR")
    if env:
        return os.path.join(env, "simulated_memory")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightning_gpuopt", "simulated_memory")


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _torch_dirs() -> tuple[str, str]:
    root = os.path.dirname(os.path.abspath(torch.__file__))
    return os.path.join(root, "include"), os.path.join(root, "lib")


def _build_key(include: str) -> str:
    # What the binary depends on: the source and the torch build it links against (not the
    # compiler: a library built by any compiler works, and a machine without one can use the cache).
    parts = (
        _SOURCE,
        torch.__version__,
        str(getattr(torch.version, "git_version", "")),
        include,
        str(int(torch.compiled_with_cxx11_abi())),
        sys.platform,
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: str):
    try:
        import fcntl
    except ImportError:  # no flock: concurrent builds each write their own temp file; still correct
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _compile(cxx: str, include: str, libdir: str, target: str) -> None:
    directory = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=".simmem-", suffix=".so", dir=directory)
    os.close(fd)
    src = tmp[: -len(".so")] + ".cpp"
    try:
        with open(src, "w") as f:
            f.write(_SOURCE)
        cmd = [
            cxx,
            "-O2",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-w",  # torch's headers warn under some compilers; the build output is not for users
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            "-I",
            include,
            src,
            "-o",
            tmp,
            "-L",
            libdir,
            "-lc10",
            f"-Wl,-rpath,{libdir}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise NativeUnavailableError(
                f"compiling the counting allocator failed ({' '.join(cmd)}):\n{proc.stderr.strip()[-3000:]}"
            )
        os.replace(tmp, target)  # atomic: a concurrent reader sees no file or the whole file
    finally:
        for path in (tmp, src):
            with contextlib.suppress(OSError):
                os.remove(path)


def _declare(lib: ctypes.CDLL) -> None:
    i64, u64 = ctypes.c_int64, ctypes.c_uint64
    signatures = {
        "simmem_abi_version": ([], ctypes.c_int),
        "simmem_begin": ([i64], ctypes.c_int),
        "simmem_end": ([], None),
        "simmem_active": ([], ctypes.c_int),
        "simmem_session": ([], u64),
        "simmem_set_limit": ([i64], None),
        "simmem_allocated": ([], i64),
        "simmem_peak": ([], i64),
        "simmem_reset_peak": ([], None),
        "simmem_set_peak": ([i64], None),
        "simmem_limit": ([], i64),
        "simmem_num_ooms": ([], i64),
        "simmem_num_allocs": ([], i64),
        "simmem_adopt": ([ctypes.c_void_p], ctypes.c_int),
        "simmem_charge": ([i64], u64),
        "simmem_release": ([i64, u64], None),
        "simmem_set_oom_callback": ([OOM_CALLBACK], None),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: NativeUnavailableError | None = None


def load_native() -> ctypes.CDLL:
    """The counting allocator library, built on first use; raises :class:`NativeUnavailableError`.

    The outcome is remembered for the process: a failed build is not retried.
    """
    global _lib, _error
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise _error
        try:
            _lib = _load_uncached()
        except NativeUnavailableError as err:
            _error = err
            raise
        except (OSError, subprocess.SubprocessError) as err:
            _error = NativeUnavailableError(f"building or loading the counting allocator failed: {err}")
            raise _error from err
        return _lib


def _load_uncached() -> ctypes.CDLL:
    if sys.platform not in ("linux", "darwin"):
        raise NativeUnavailableError(f"the counting allocator supports Linux and macOS, not {sys.platform!r}")
    include, libdir = _torch_dirs()
    directory = _cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        directory = os.path.join(tempfile.gettempdir(), f"lightning_gpuopt-{os.getuid()}", "simulated_memory")
        os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, f"simmem_{_build_key(include)}.so")
    if not os.path.isfile(target):
        cxx = _compiler()
        if cxx is None:
            raise NativeUnavailableError("no C++ compiler found (looked for $CXX, c++, g++, clang++)")
        if not os.path.isfile(os.path.join(include, "c10", "core", "CPUAllocator.h")):
            raise NativeUnavailableError(
                f"torch's C++ headers are missing (no {include}/c10/core/CPUAllocator.h)"
            )
        with _file_lock(target + ".lock"):
            if not os.path.isfile(target):  # another process may have built it while we waited
                _compile(cxx, include, libdir, target)
    lib = ctypes.CDLL(target)
    _declare(lib)
    if lib.simmem_abi_version() != _ABI_VERSION:
        raise NativeUnavailableError(f"{target} has ABI {lib.simmem_abi_version()}, expected {_ABI_VERSION}")
    return lib


def native_status() -> str | None:
    """None when the counting allocator is available here, else why not (for tests and diagnostics)."""
    try:
        load_native()
    except NativeUnavailableError as err:
        return str(err)
    return None


class NativeCounter:
    """Python face of the native allocator's counters (one session at a time per process)."""

    name = "allocator"

    def __init__(self) -> None:
        self._lib = load_native()
        self.session = 0
        self._callback = None  # the ctypes wrapper must outlive its use by the library

    def on_oom(self, callback: Callable[[int, int, int], None] | None) -> None:
        """Call ``callback(requested, in_use, limit)`` before each over-limit allocation raises (``None``: stop).

        It runs inside the allocation, on the allocating thread, without the allocator's lock; allocations it
        makes on that thread are never refused. It must not raise.
        """
        self._callback = OOM_CALLBACK(callback) if callback is not None else OOM_CALLBACK()
        self._lib.simmem_set_oom_callback(self._callback)

    def begin(self, limit: int | None) -> None:
        rc = self._lib.simmem_begin(-1 if limit is None else limit)
        if rc == 1:
            raise RuntimeError(
                "A SimulatedMemory is already active in this process; exit it before entering another"
            )
        if rc == 2:
            self._lib.simmem_end()
            raise RuntimeError(
                "SimulatedMemory could not install its CPU allocator: another allocator was installed with "
                "top priority (c10::SetCPUAllocator); remove it, or use SimulatedMemory(backend='dispatch')"
            )
        self.session = self._lib.simmem_session()

    def end(self) -> None:
        self._lib.simmem_end()

    def set_limit(self, limit: int | None) -> None:
        self._lib.simmem_set_limit(-1 if limit is None else limit)

    @property
    def allocated(self) -> int:
        return self._lib.simmem_allocated()

    @property
    def peak(self) -> int:
        return self._lib.simmem_peak()

    def reset_peak(self) -> None:
        self._lib.simmem_reset_peak()

    @property
    def num_ooms(self) -> int:
        return self._lib.simmem_num_ooms()

    def owns(self, ptr: int) -> bool:
        """Whether the block at ``ptr`` is this allocator's (and so counted in this session)."""
        return bool(self._lib.simmem_adopt(ptr))

    def charge(self, nbytes: int) -> None:
        self._lib.simmem_charge(nbytes)

    def release(self, nbytes: int, session: int) -> None:
        self._lib.simmem_release(nbytes, session)
