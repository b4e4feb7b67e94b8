// Parallel loop of the CPU library: the calling thread plus helper threads of its own that spin
// briefly between calls (no XLA dependency).
#pragma once

#include <atomic>
#include <cfenv>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "taco_cpu_common.h"

#if TACO_X86
#include <immintrin.h>
#endif

namespace taco {

//
// Why not XLA's intra-op pool: its threads sleep between tasks, and waking one costs tens of
// microseconds on a virtual machine -- as long as a whole 1 MB encode on one core. These
// helpers wait for the next job by spinning (with `pause`, yielding the core every few
// microseconds) for TACO_FFI_SPIN_US (default 200) after their last job, then sleep on a
// condition variable; back-to-back codec calls (one per layer and collective) find them awake,
// as OpenMP's and Eigen's spinning workers do. While callers contend for the pool (several XLA
// devices in one process keep the cores busy anyway) helpers sleep right after each job. Both
// knobs and the helper count are fixed at the first call.
//
// Protocol (one job at a time): the caller publishes the job's fields, then a 64-bit ticket
// (job id << 32 | next chunk). Everyone claims chunks by CAS on the ticket, which also checks the
// job id, so a helper can never run a chunk of a finished job: the caller closes a job (next =
// kClosed) only after all its chunks are done. A caller that finds the pool busy (concurrent
// calls, e.g. several XLA devices of one process) runs its whole loop itself.


// TACO_FFI_SPIN_US: how long helpers spin for the next job before they sleep (read once).
int64_t SpinMicros();

inline void CpuRelax() {
#if TACO_X86
  _mm_pause();
#endif
}

// The floating-point control state a job runs under: XLA runs computations with denormals
// flushed (FTZ/DAZ) and round-to-nearest, and a helper runs the caller's chunks under the
// caller's state, so a chunk's result does not depend on the thread that ran it.
#if TACO_X86
using FpState = unsigned int;  // MXCSR
inline FpState GetFpState() { return _mm_getcsr(); }
inline void SetFpState(FpState s) {
  if (_mm_getcsr() != s) _mm_setcsr(s);
}
#else
using FpState = std::fenv_t;
inline FpState GetFpState() {
  FpState s;
  std::fegetenv(&s);
  return s;
}
inline void SetFpState(const FpState& s) { std::fesetenv(&s); }
#endif

class SpinPool {
 public:
  // The process-wide pool with `helpers` threads (fixed by the first call); never destroyed, so
  // its threads may outlive static destructors at exit.
  static SpinPool& Get(int helpers);

  // Called when a caller found the pool busy: helpers stop spinning between jobs for 50 ms.
  void MarkContended();

  int helpers() const { return helpers_; }


  // Runs fn(c) for every chunk c in [0, nchunks), on the caller and the helpers. Returns false
  // (running nothing) if another caller holds the pool.
  template <typename F>
  bool Run(int64_t nchunks, const F& fn) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    const uint32_t id = static_cast<uint32_t>(ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    fp_state_ = GetFpState();  // published by the ticket store below
    call_.store(&Trampoline<F>, std::memory_order_relaxed);
    ctx_.store(&fn, std::memory_order_relaxed);
    nchunks_.store(nchunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(static_cast<uint64_t>(id) << 32, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    ClaimAndRun(id);
    // Chunks still running on helpers take at most one chunk's time (a few microseconds).
    for (int spins = 0; done_.load(std::memory_order_acquire) < nchunks; ++spins) {
      CpuRelax();
      if (spins % 256 == 255) std::this_thread::yield();
    }
    ticket_.store((static_cast<uint64_t>(id) << 32) | kClosed, std::memory_order_release);
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  static constexpr uint32_t kClosed = 0xFFFFFFFFu;
  using Call = void (*)(const void*, int64_t);

  template <typename F>
  static void Trampoline(const void* ctx, int64_t c) {
    (*static_cast<const F*>(ctx))(c);
  }

  explicit SpinPool(int helpers);
  // Claims and runs chunks of job `id` until none is left or the job changed; a helper
  // (`helper`) first takes the job's floating-point state.
  void ClaimAndRun(uint32_t id, bool helper = false);
  void HelperLoop();




  const int helpers_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<Call> call_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> nchunks_{0};
  FpState fp_state_{};  // written by the pool's holder before it publishes the ticket
  std::atomic<int64_t> contended_until_{0};  // steady_clock ticks; see MarkContended
  std::atomic<int> sleeping_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};



// Threads for a call: `xla_threads` (XLA's intra-op pool size, about the cores it may use), capped
// by the CPUs this process may run on and TACO_FFI_THREADS; at least 1.
int64_t ThreadCount(int64_t xla_threads);

// Runs fn(begin, end) over [0, n) in chunks of `grain`, on the calling thread and the pool's
// helpers (or the calling thread alone, for one chunk or when the pool is busy).
template <typename F>
void ParallelFor(int64_t xla_threads, int64_t n, int64_t grain, const F& fn) {
  const int64_t nchunks = (n + grain - 1) / grain;
  const int64_t threads = ThreadCount(xla_threads);
  if (nchunks > 1 && threads > 1 && nchunks < (int64_t{1} << 31)) {  // chunk ids fit the ticket's 32 bits
    SpinPool& sp = SpinPool::Get(static_cast<int>(threads - 1));
    auto chunk = [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); };
    if (sp.helpers() > 0) {
      if (sp.Run(nchunks, chunk)) return;
      sp.MarkContended();
    }
  }
  if (n > 0) fn(0, n);
}

}  // namespace taco
