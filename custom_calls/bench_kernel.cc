// Single-thread microbenchmark of the CPU encoder's vector kernels (no XLA, no thread pool): the
// time per group on data already in cache, best of R passes, and a hash of the codes and scales
// (the same for every kernel level, and unchanged by a pure speed change of a kernel).
//
//   make -C custom_calls bench && custom_calls/build/bench_kernel [groups=2048] [passes=2000] [G=128] [dtype=f32] [level=all] [op=encode]
//
// dtype (f32, bf16, f16) is the message's: the encoder reads it as it is, the decoder writes it.
// level: avx2, avx512, or all (each level this CPU has, in one run, passes interleaved level by
// level). op: encode, or decode (of the codes the encoder wrote; hash of the decoded bits).
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "taco_kernel_avx2.h"
#include "taco_kernel_avx512.h"

// argv[i] as an integer in [lo, hi], or exit 2 naming the argument and its bad value.
long Arg(int argc, char** argv, int i, const char* name, long dflt, long lo, long hi) {
  if (i >= argc) return dflt;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(argv[i], &end, 10);
  if (errno != 0 || end == argv[i] || *end != '\0' || v < lo || v > hi) {
    std::fprintf(stderr, "bench_kernel: %s=%s must be an integer in [%ld, %ld]\n", name, argv[i], lo, hi);
    std::exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  using namespace taco;
  if (argc > 7) {
    std::fprintf(stderr,
                 "usage: bench_kernel [groups=2048] [passes=2000] [G=128] [dtype=f32|bf16|f16] [level=all|avx2|avx512] "
                 "[op=encode|decode]\n");
    return 2;
  }
  const std::string dname = argc > 4 ? argv[4] : "f32";
  const int dt = dname == "f32" ? kF32 : dname == "bf16" ? kBF16 : dname == "f16" ? kF16 : -1;
  if (dt < 0) {
    std::fprintf(stderr, "bench_kernel: dtype=%s must be f32, bf16 or f16\n", dname.c_str());
    return 2;
  }
  const std::string level = argc > 5 ? argv[5] : "all";
  if (level != "all" && level != "avx2" && level != "avx512") {
    std::fprintf(stderr, "bench_kernel: level=%s must be all, avx2 or avx512\n", level.c_str());
    return 2;
  }
  const std::string op = argc > 6 ? argv[6] : "encode";
  if (op != "encode" && op != "decode") {
    std::fprintf(stderr, "bench_kernel: op=%s must be encode or decode\n", op.c_str());
    return 2;
  }
  const int64_t n = Arg(argc, argv, 1, "groups", 2048, 1, 1L << 24);
  const int passes = static_cast<int>(Arg(argc, argv, 2, "passes", 2000, 1, 1L << 30));
  const int g = static_cast<int>(Arg(argc, argv, 3, "G", 128, 32, 512));
  if (g < MIN_GROUP_SIZE || g > MAX_GROUP_SIZE || (g & (g - 1)) != 0) {
    std::fprintf(stderr, "bench_kernel: G=%d must be a power of 2 in [32, 512]\n", g);
    return 2;
  }
  std::vector<std::string> names;
#if TACO_X86
  std::vector<EncodeFn> fns;
  std::vector<DecodeFn> dfns;
  if ((level == "all" || level == "avx2") && HaveAvx2()) {
    names.push_back("avx2");
    fns.push_back(EncodeAvx(kE4M3, g, dt));
    dfns.push_back(DecodeAvx(kE4M3, g, dt));
  }
  if ((level == "all" || level == "avx512") && HaveAvx512()) {
    names.push_back("avx512");
    fns.push_back(EncodeAvx512(kE4M3, g, dt));
    dfns.push_back(DecodeAvx512(kE4M3, g, dt));
  }
#endif
  if (names.empty()) {
    std::fprintf(stderr, "bench_kernel: this CPU has no %s kernel (AVX2+FMA+F16C; AVX-512 F/BW/DQ/VL)\n",
                 level == "all" ? "vector" : level.c_str());
    return 2;
  }
  std::vector<float> x(n * g), s(n), a(n);
  std::vector<uint16_t> xh(dt == kF32 ? 0 : n * g);
  std::vector<uint8_t> q(n * g);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  for (int64_t i = 0; i < static_cast<int64_t>(xh.size()); ++i) xh[i] = f32_to_narrow(x[i], dt, false);
  const void* xp = dt == kF32 ? static_cast<const void*>(x.data()) : static_cast<const void*>(xh.data());
  EncodeParams p{kE4M3, g, 0.0f, E4M3_MAX, E4M3_MAX, n, static_cast<float>(g), std::sqrt(static_cast<float>(g))};
  const size_t k = names.size();
  const bool dec = op == "decode";
  const float sqrt_g = std::sqrt(static_cast<float>(g));
  std::vector<uint8_t> out(dec ? n * g * DtypeBytes(dt) : 0);
  if (dec) fns[0](xp, q.data(), s.data(), a.data(), 0, n, p, false);  // the codes to decode
  std::vector<double> best(k, 1e30);
  for (int r = 0; r < passes; ++r) {
    for (size_t l = 0; l < k; ++l) {
      const auto t0 = std::chrono::steady_clock::now();
      if (dec) {
        dfns[l](q.data(), s.data(), a.data(), sqrt_g, out.data(), 0, n, false);
      } else {
        fns[l](xp, q.data(), s.data(), a.data(), 0, n, p, false);
      }
      best[l] = std::min(best[l], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  int rc = 0;
  uint64_t first = 0;
  for (size_t l = 0; l < k; ++l) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over codes and scale bits, or the decoded bits
    if (dec) {
      std::fill(out.begin(), out.end(), 0);
      dfns[l](q.data(), s.data(), a.data(), sqrt_g, out.data(), 0, n, false);
      for (uint8_t c : out) h = (h ^ c) * 1099511628211ull;
    } else {
      std::fill(q.begin(), q.end(), 0);
      std::fill(s.begin(), s.end(), 0.0f);
      fns[l](xp, q.data(), s.data(), a.data(), 0, n, p, false);
      for (uint8_t c : q) h = (h ^ c) * 1099511628211ull;
      for (float v : s) {
        uint32_t b;
        std::memcpy(&b, &v, 4);
        h = (h ^ b) * 1099511628211ull;
      }
    }
    if (l == 0) first = h;
    if (h != first) rc = 1;
    std::printf("%-6s %s G=%d %s, %ld groups: best %.1f us, %.1f ns/group (one thread), hash %016llx\n",
                names[l].c_str(), op.c_str(), g, dname.c_str(), static_cast<long>(n), best[l] * 1e6, best[l] * 1e9 / n,
                static_cast<unsigned long long>(h));
  }
  if (rc != 0) std::fprintf(stderr, "bench_kernel: the kernel levels' outputs differ\n");
  return rc;
}
