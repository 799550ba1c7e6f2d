"""The counting CPU allocator behind SimulatedMemory: C++ source, build on first use, ctypes binding.

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
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import torch

__all__ = ["NativeCounter", "NativeUnavailableError", "load_native"]

_ABI_VERSION = 1

_SOURCE = r"""
// Counting CPU allocator for lightning_gpuopt.testing.SimulatedMemory (built by _native.py).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

#define SIMMEM_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kAbiVersion = 1;

struct Block {
  int64_t bytes;
  uint64_t session;  // the session that counts this block; blocks of an ended session count nowhere
};

// Heap objects that are never destroyed: tensors may be freed during static destruction at exit.
std::mutex& mu() {
  static auto* m = new std::mutex();
  return *m;
}
std::unordered_map<void*, Block>& blocks() {
  static auto* b = new std::unordered_map<void*, Block>();
  return *b;
}

bool g_active = false;
uint64_t g_session = 0;
int64_t g_cur = 0, g_peak = 0, g_limit = -1, g_num_ooms = 0, g_num_allocs = 0;
c10::Allocator* g_prev = nullptr;

std::string human(int64_t n) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[96];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(n));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s (%lld bytes)", v, units[u], static_cast<long long>(n));
  }
  return buf;
}

void bump(int64_t bytes) {  // caller holds mu()
  g_cur += bytes;
  if (g_cur > g_peak) g_peak = g_cur;
}

void counting_delete(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mu());
    auto it = blocks().find(p);
    if (it != blocks().end()) {
      if (g_active && it->second.session == g_session) g_cur -= it->second.bytes;
      blocks().erase(it);
    }
  }
  c10::profiledCPUMemoryReporter().Delete(p);
  c10::free_cpu(p);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const int64_t bytes = static_cast<int64_t>(n);
    uint64_t session = 0;
    if (n > 0) {
      // Check and count before the real allocation, so that an over-limit request of any size
      // fails like CUDA's (without first asking the host for it).
      std::unique_lock<std::mutex> lock(mu());
      if (g_active) {
        if (g_limit >= 0 && g_cur + bytes > g_limit) {
          ++g_num_ooms;
          const int64_t in_use = g_cur, limit = g_limit;
          lock.unlock();
          c10::profiledCPUMemoryReporter().OutOfMemory(n);
          C10_THROW_ERROR(OutOfMemoryError,
                          "CUDA out of memory (simulated). Tried to allocate " + human(bytes) + "; " +
                              human(in_use) + " in use; limit " + human(limit) +
                              ". Raised by lightning_gpuopt.testing.SimulatedMemory: raise its "
                              "`limit_bytes` or use smaller batches.");
        }
        bump(bytes);
        ++g_num_allocs;
        session = g_session;
      }
    }
    void* data = nullptr;
    try {
      data = c10::alloc_cpu(n);
    } catch (...) {
      if (session != 0) {
        std::lock_guard<std::mutex> lock(mu());
        if (g_active && g_session == session) g_cur -= bytes;
      }
      c10::profiledCPUMemoryReporter().OutOfMemory(n);
      throw;
    }
    if (session != 0 && data != nullptr) {
      std::lock_guard<std::mutex> lock(mu());
      blocks()[data] = Block{bytes, session};
    }
    c10::profiledCPUMemoryReporter().New(data, n);
    return {data, data, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Never destroyed, like the mutex and the table: memory may be allocated and freed during exit.
CountingAllocator* counting_allocator() {
  static auto* a = new CountingAllocator();
  return a;
}

// A forked child (DataLoader worker) is not the simulated device: stop counting there, and hand the
// child the previous allocator. The lock is held across fork so the child never inherits it locked.
void before_fork() { mu().lock(); }
void after_fork_parent() { mu().unlock(); }
void after_fork_child() {
  mu().unlock();
  g_active = false;
  if (g_prev != nullptr && c10::GetCPUAllocator() == counting_allocator()) c10::SetCPUAllocator(g_prev, 255);
}
struct ForkHandlers {
  ForkHandlers() { pthread_atfork(&before_fork, &after_fork_parent, &after_fork_child); }
} g_fork_handlers;

}  // namespace

SIMMEM_API int simmem_abi_version() { return kAbiVersion; }

// 0: started; 1: a session is already active; 2: another allocator outranks this one.
SIMMEM_API int simmem_begin(int64_t limit) {
  std::lock_guard<std::mutex> lock(mu());
  if (g_active) return 1;
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != counting_allocator()) g_prev = current;
  // 255 is the top priority: allocators registered statically (priority 0) never outrank it.
  c10::SetCPUAllocator(counting_allocator(), 255);
  if (c10::GetCPUAllocator() != counting_allocator()) return 2;
  ++g_session;
  g_cur = g_peak = g_num_ooms = g_num_allocs = 0;
  g_limit = limit;
  g_active = true;
  return 0;
}

SIMMEM_API void simmem_end() {
  std::lock_guard<std::mutex> lock(mu());
  if (!g_active) return;
  g_active = false;
  if (g_prev != nullptr) c10::SetCPUAllocator(g_prev, 255);
}

SIMMEM_API int simmem_active() {
  std::lock_guard<std::mutex> lock(mu());
  return g_active ? 1 : 0;
}
SIMMEM_API uint64_t simmem_session() {
  std::lock_guard<std::mutex> lock(mu());
  return g_session;
}
SIMMEM_API void simmem_set_limit(int64_t limit) {
  std::lock_guard<std::mutex> lock(mu());
  g_limit = limit;
}
SIMMEM_API int64_t simmem_allocated() {
  std::lock_guard<std::mutex> lock(mu());
  return g_cur;
}
SIMMEM_API int64_t simmem_peak() {
  std::lock_guard<std::mutex> lock(mu());
  return g_peak;
}
SIMMEM_API void simmem_reset_peak() {
  std::lock_guard<std::mutex> lock(mu());
  g_peak = g_cur;
}
SIMMEM_API int64_t simmem_num_ooms() {
  std::lock_guard<std::mutex> lock(mu());
  return g_num_ooms;
}
SIMMEM_API int64_t simmem_num_allocs() {
  std::lock_guard<std::mutex> lock(mu());
  return g_num_allocs;
}

// Is the block at `ptr` one of this allocator's? If it belongs to an earlier session, it now counts
// in this one (a tensor kept across sessions). 1: counted here; 0: not this allocator's block.
SIMMEM_API int simmem_adopt(void* ptr) {
  std::lock_guard<std::mutex> lock(mu());
  auto it = blocks().find(ptr);
  if (it == blocks().end()) return 0;
  if (g_active && it->second.session != g_session) {
    it->second.session = g_session;
    bump(it->second.bytes);
  }
  return 1;
}

// Count / uncount memory this allocator did not make (tensors created before the session).
SIMMEM_API uint64_t simmem_charge(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu());
  if (!g_active) return 0;
  bump(bytes);
  return g_session;
}
SIMMEM_API void simmem_release(int64_t bytes, uint64_t session) {
  std::lock_guard<std::mutex> lock(mu());
  if (g_active && session == g_session) g_cur -= bytes;
}
"""


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
        str(int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))),
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
            f"-D_GLIBCXX_USE_CXX11_ABI={int(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', True))}",
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
        "simmem_num_ooms": ([], i64),
        "simmem_num_allocs": ([], i64),
        "simmem_adopt": ([ctypes.c_void_p], ctypes.c_int),
        "simmem_charge": ([i64], u64),
        "simmem_release": ([i64, u64], None),
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


class NativeCounter:
    """Python face of the native allocator's counters (one session at a time per process)."""

    name = "allocator"

    def __init__(self) -> None:
        self._lib = load_native()
        self.session = 0

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
