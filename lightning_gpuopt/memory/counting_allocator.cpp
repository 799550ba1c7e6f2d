
// Counting CPU allocator for lightning_gpuopt.testing.SimulatedMemory (built by counting_allocator.py).
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

constexpr int kAbiVersion = 3;

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

// Called before an over-limit allocation throws (SimulatedMemory's OOM observer), without the lock held.
// While it runs on a thread, that thread's allocations are counted but never refused: an exception could not
// cross the callback's frames.
using OomCallback = void (*)(int64_t requested, int64_t in_use, int64_t limit);
OomCallback g_oom_callback = nullptr;
thread_local bool t_in_callback = false;

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
        if (g_limit >= 0 && g_cur + bytes > g_limit && !t_in_callback) {
          ++g_num_ooms;
          const int64_t in_use = g_cur, limit = g_limit;
          const OomCallback callback = g_oom_callback;
          lock.unlock();
          if (callback != nullptr) {
            t_in_callback = true;
            callback(bytes, in_use, limit);
            t_in_callback = false;
          }
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

SIMMEM_API void simmem_set_oom_callback(OomCallback callback) {
  std::lock_guard<std::mutex> lock(mu());
  g_oom_callback = callback;
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
// Put back a peak read earlier (never below what is allocated now): a measurement that is not the
// simulated program's own (a kernel's scratch, measured for a prediction) leaves no trace in it.
SIMMEM_API void simmem_set_peak(int64_t peak) {
  std::lock_guard<std::mutex> lock(mu());
  g_peak = peak > g_cur ? peak : g_cur;
}
SIMMEM_API int64_t simmem_limit() {
  std::lock_guard<std::mutex> lock(mu());
  return g_limit;
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
