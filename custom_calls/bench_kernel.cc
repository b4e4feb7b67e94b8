// Single-thread microbenchmark of the CPU encoder's AVX2 kernel (no XLA, no thread pool): the
// time per group on data already in cache, best of R passes, and a hash of the codes and scales
// (unchanged by a pure speed change of the kernel).
//
//   make -C custom_calls bench && custom_calls/build/bench_kernel [groups=2048] [passes=2000] [G=128]
#include "taco_codec_cpu.cc"

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  using namespace taco;
  const int64_t n = argc > 1 ? std::atol(argv[1]) : 2048;
  const int passes = argc > 2 ? std::atoi(argv[2]) : 2000;
  const int g = argc > 3 ? std::atoi(argv[3]) : 128;
#if TACO_X86
  EncodeFn fn = HaveAvx2() ? EncodeAvxFor<kE4M3>(g) : nullptr;
#else
  void* fn = nullptr;
#endif
  if (fn == nullptr || n < 1 || passes < 1) {
    std::fprintf(stderr, "needs an AVX2 CPU, groups >= 1, passes >= 1 and G in {32, ..., 512}\n");
    return 2;
  }
  std::vector<float> x(n * g), s(n), a(n);
  std::vector<uint8_t> q(n * g);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  EncodeParams p{kE4M3, g, 0.0f, 448.0f, 448.0f, n, static_cast<float>(g), std::sqrt(static_cast<float>(g))};
  double best = 1e30;
  for (int r = 0; r < passes; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(x.data(), q.data(), s.data(), a.data(), 0, n, p, false);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a over codes and scale bits
  for (uint8_t c : q) h = (h ^ c) * 1099511628211ull;
  for (float v : s) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    h = (h ^ b) * 1099511628211ull;
  }
  std::printf("G=%d, %ld groups: best %.1f us, %.1f ns/group (one thread), hash %016llx\n", g, static_cast<long>(n),
              best * 1e6, best * 1e9 / n, static_cast<unsigned long long>(h));
  return 0;
}
