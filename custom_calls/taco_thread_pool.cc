// The CPU library's thread pool (see taco_thread_pool.h).

#include "taco_thread_pool.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>

#if defined(__linux__)
#include <sched.h>
#endif

namespace taco {
namespace {

// TACO_FFI_THREADS=k caps the threads at k (k = 1: the calling thread only).
int64_t MaxThreadsFromEnv() {
  static const int64_t cap = [] {
    const char* v = std::getenv("TACO_FFI_THREADS");
    return v != nullptr && std::atoi(v) > 0 ? static_cast<int64_t>(std::atoi(v)) : INT64_MAX;
  }();
  return cap;
}

}  // namespace

int64_t SpinMicros() {
  static const int64_t us = [] {
    const char* v = std::getenv("TACO_FFI_SPIN_US");
    return v != nullptr && std::atoi(v) >= 0 ? static_cast<int64_t>(std::atoi(v)) : int64_t{200};
  }();
  return us;
}

namespace {

// CPUs this process may run on, read once (a system call).
int64_t AffinityCpus() {
  static const int64_t n = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
#endif
    return INT64_MAX;
  }();
  return n;
}

}  // namespace

int64_t ThreadCount(int64_t xla_threads) {
  const int64_t n = std::min({xla_threads, AffinityCpus(), MaxThreadsFromEnv()});
  return std::max<int64_t>(1, n);
}

// The process-wide pool with `helpers` threads (fixed by the first call); never destroyed, so
// its threads may outlive static destructors at exit.
SpinPool& SpinPool::Get(int helpers) {
  static SpinPool* pool = new SpinPool(helpers);
  return *pool;
}

// Called when a caller found the pool busy: helpers stop spinning between jobs for 50 ms.
void SpinPool::MarkContended() {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
  contended_until_.store(until.time_since_epoch().count(), std::memory_order_relaxed);
}

SpinPool::SpinPool(int helpers) : helpers_(helpers) {
  for (int t = 0; t < helpers_; ++t) std::thread([this] { HelperLoop(); }).detach();
}

// Claims and runs chunks of job `id` until none is left or the job changed; a helper
// (`helper`) first takes the job's floating-point state.
void SpinPool::ClaimAndRun(uint32_t id, bool helper) {
  uint64_t t = ticket_.load(std::memory_order_acquire);
  for (;;) {
    if (static_cast<uint32_t>(t >> 32) != id) return;
    const uint32_t c = static_cast<uint32_t>(t);
    if (c == kClosed || static_cast<int64_t>(c) >= nchunks_.load(std::memory_order_relaxed)) return;
    if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      // Chunk c of job id is ours; the job cannot close before it is done, so its fields hold.
      if (helper) SetFpState(fp_state_);
      call_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), c);
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }
}

void SpinPool::HelperLoop() {
  uint32_t seen = 0;  // job ids start at 1
  const auto spin = std::chrono::microseconds(SpinMicros());
  for (;;) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    // While callers contend for the pool (several XLA devices in one process, which already
    // keep the cores busy), a spinning helper only takes CPU from them: sleep at once.
    const auto now = std::chrono::steady_clock::now();
    const bool contended = now.time_since_epoch().count() < contended_until_.load(std::memory_order_relaxed);
    const auto deadline = contended ? now : now + spin;
    for (int spins = 0; static_cast<uint32_t>(t >> 32) == seen; ++spins) {
      CpuRelax();
      if (spins % 64 == 63) {
        if (std::chrono::steady_clock::now() >= deadline) {
          std::unique_lock<std::mutex> lock(mu_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lock, [&] { return static_cast<uint32_t>(ticket_.load(std::memory_order_seq_cst) >> 32) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_relaxed);
        } else {
          std::this_thread::yield();  // let any other runnable thread have this core
        }
      }
      t = ticket_.load(std::memory_order_acquire);
    }
    seen = static_cast<uint32_t>(t >> 32);
    ClaimAndRun(seen, /*helper=*/true);
  }
}

}  // namespace taco
