// TACO group codec as XLA FFI handlers for CUDA GPUs (TACO spec §2; TACO (arXiv 2604.24088),
// structure after the COCCL taco plugin's reference CUDA codec).
//
// One warp per group, grid-stride over groups. Lane l holds elements [l*E, (l+1)*E) with
// E = G/32 (1..16), loaded and stored with the widest vector type that fits (float4 / uint4).
// Walsh-Hadamard butterflies: strides < E inside each lane's registers, strides >= E across
// lanes with __shfl_xor_sync. Sum of squares and absmax are warp reductions. FP8 conversion
// uses the hardware RNE saturating cvt (sm >= 89; emulated by cuda_fp8.h below that).
//
// Targets, attributes and shapes are those of taco_codec_cpu.cc (same Python wrapper, same bound
// signatures: taco_ffi_bind.h): taco_encode, taco_decode, taco_fp8_cast. The `impl` attribute is
// accepted and ignored.
//
// Build (see Makefile): nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr
//   -Xcompiler -fPIC -shared -I$(python -c "import jax; print(jax.ffi.include_dir())")
//   taco_codec_cuda.cu -o ../taco_jax/kernels/_lib/libtaco_codec_cuda.so

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "taco_constants.h"
#include "taco_ffi_bind.h"
#include "taco_fp8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace taco {
namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kWarpsPerBlock = 8;

struct EncodeParams {
  float lam, fmax, range, sqrt_g, last_count;
  int64_t n_groups;
};

__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }

template <int E>
__device__ __forceinline__ void load_f32(const float* p, float (&v)[E]) {
  if constexpr (E % 4 == 0) {
#pragma unroll
    for (int i = 0; i < E; i += 4) {
      const float4 t = *reinterpret_cast<const float4*>(p + i);
      v[i] = t.x, v[i + 1] = t.y, v[i + 2] = t.z, v[i + 3] = t.w;
    }
  } else if constexpr (E == 2) {
    const float2 t = *reinterpret_cast<const float2*>(p);
    v[0] = t.x, v[1] = t.y;
  } else {
    v[0] = *p;
  }
}

template <int E>
__device__ __forceinline__ void store_f32(float* p, const float (&v)[E]) {
  if constexpr (E % 4 == 0) {
#pragma unroll
    for (int i = 0; i < E; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
  } else if constexpr (E == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
  } else {
    *p = v[0];
  }
}

// E bytes per lane, as one (vector) access: u8, u16, u32, uint2, uint4.
template <int E>
__device__ __forceinline__ void store_u8(uint8_t* p, const uint8_t (&b)[E]) {
  if constexpr (E == 16) {
    uint4 t;
    memcpy(&t, b, 16);
    *reinterpret_cast<uint4*>(p) = t;
  } else if constexpr (E == 8) {
    uint2 t;
    memcpy(&t, b, 8);
    *reinterpret_cast<uint2*>(p) = t;
  } else if constexpr (E == 4) {
    uint32_t t;
    memcpy(&t, b, 4);
    *reinterpret_cast<uint32_t*>(p) = t;
  } else if constexpr (E == 2) {
    uint16_t t;
    memcpy(&t, b, 2);
    *reinterpret_cast<uint16_t*>(p) = t;
  } else {
    *p = b[0];
  }
}

template <int E>
__device__ __forceinline__ void load_u8(const uint8_t* p, uint8_t (&b)[E]) {
  if constexpr (E == 16) {
    const uint4 t = *reinterpret_cast<const uint4*>(p);
    memcpy(b, &t, 16);
  } else if constexpr (E == 8) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    memcpy(b, &t, 8);
  } else if constexpr (E == 4) {
    const uint32_t t = *reinterpret_cast<const uint32_t*>(p);
    memcpy(b, &t, 4);
  } else if constexpr (E == 2) {
    const uint16_t t = *reinterpret_cast<const uint16_t*>(p);
    memcpy(b, &t, 2);
  } else {
    b[0] = *p;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Unnormalised WHT of the warp's G = 32 E values (Sylvester order, element = lane * E + i).
template <int E>
__device__ __forceinline__ void warp_wht(float (&y)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int i = 0; i < E; ++i) {
      if ((i & h) == 0) {
        const float u = y[i], w = y[i + h];
        y[i] = __fadd_rn(u, w);
        y[i + h] = __fsub_rn(u, w);
      }
    }
  }
#pragma unroll
  for (int hl = 1; hl < 32; hl <<= 1) {
    const bool upper = (lane & hl) != 0;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float other = __shfl_xor_sync(kFull, y[i], hl);
      y[i] = upper ? __fsub_rn(other, y[i]) : __fadd_rn(y[i], other);
    }
  }
}

template <int FMT>
__device__ __forceinline__ uint8_t quantize(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, FMT == kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

template <int FMT>
__device__ __forceinline__ float dequantize(uint8_t c) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), FMT == kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

template <int G, int FMT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    encode_kernel(const float* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ s_out,
                  float* __restrict__ a_out, int64_t total, EncodeParams p) {
  constexpr int E = G / 32;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); gi < total; gi += nwarps) {
    float y[E];
    load_f32<E>(x + gi * G + lane * E, y);
    // 1-2. sum of squares, finiteness, adaptive scale a
    float ss = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      ss = __fadd_rn(ss, __fmul_rn(y[i], y[i]));
      finite &= isfinite(y[i]);
    }
    ss = warp_sum(ss);
    finite = __all_sync(kFull, finite);
    const float count = (gi % p.n_groups == p.n_groups - 1) ? p.last_count : static_cast<float>(G);
    const float m = __fdiv_rn(ss, count);
    const float v = nan_max(__fadd_rn(m, p.lam), EPS);
    const float a = nan_min(nan_max(__fdiv_rn(p.fmax, __fsqrt_rn(v)), ADAPTIVE_SCALE_MIN), ADAPTIVE_SCALE_MAX);
    if (lane == 0) a_out[gi] = a;
    uint8_t b[E];
    if (!finite) {
#pragma unroll
      for (int i = 0; i < E; ++i) b[i] = fp8_nan(FMT);
      store_u8<E>(q + gi * G + lane * E, b);
      if (lane == 0) s_out[gi] = __int_as_float(0x7FC00000);
      continue;
    }
    // 3. WHT(a x) in registers and shuffles; absmax
#pragma unroll
    for (int i = 0; i < E; ++i) y[i] = __fmul_rn(a, y[i]);
    warp_wht<E>(y, lane);
    float mx = 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) mx = fmaxf(mx, fabsf(y[i]));
    mx = warp_max(mx);
    // 4. s; 5. codes = fp8(clamp(raw / (sqrt(G) s), -R, R))
    const float ymax = __fdiv_rn(mx, p.sqrt_g);
    const float s = fminf(fmaxf(__fdiv_rn(fmaxf(ymax, EPS), p.range), EPS), SCALE_MAX);
    const float k = static_cast<float>(1.0 / (static_cast<double>(p.sqrt_g) * static_cast<double>(s)));
#pragma unroll
    for (int i = 0; i < E; ++i) b[i] = quantize<FMT>(fminf(fmaxf(__fmul_rn(y[i], k), -p.range), p.range));
    store_u8<E>(q + gi * G + lane * E, b);
    if (lane == 0) s_out[gi] = s;
  }
}

template <int G, int FMT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    decode_kernel(const uint8_t* __restrict__ q, const float* __restrict__ s, const float* __restrict__ a,
                  float sqrt_g, float* __restrict__ out, int64_t total) {
  constexpr int E = G / 32;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); gi < total; gi += nwarps) {
    uint8_t b[E];
    load_u8<E>(q + gi * G + lane * E, b);
    const float sg = s[gi];
    double d = sqrt_g;
    if (a != nullptr) d *= static_cast<double>(nan_max(a[gi], EPS));
    const float k = static_cast<float>(1.0 / d);
    float y[E];
#pragma unroll
    for (int i = 0; i < E; ++i) y[i] = __fmul_rn(dequantize<FMT>(b[i]), sg);
    warp_wht<E>(y, lane);
#pragma unroll
    for (int i = 0; i < E; ++i) y[i] = __fmul_rn(y[i], k);
    store_f32<E>(out + gi * G + lane * E, y);
  }
}

__global__ void cast_to_fp8_kernel(const float* __restrict__ x, uint8_t* __restrict__ q, int64_t n, int fmt, float clamp) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = x[i];
    if (clamp > 0) v = fminf(fmaxf(v, -clamp), clamp);
    q[i] = f32_to_fp8(v, fmt);
  }
}

__global__ void cast_from_fp8_kernel(const uint8_t* __restrict__ q, float* __restrict__ x, int64_t n, int fmt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = fp8_to_f32(q[i], fmt);
  }
}

unsigned Blocks(int64_t warps_needed) {
  const int64_t b = (warps_needed + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

int FmtOf(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return kE4M3;
  if (t == ffi::DataType::F8E5M2) return kE5M2;
  return -1;
}

template <int FMT>
bool LaunchEncode(int g, cudaStream_t st, const float* x, uint8_t* q, float* s, float* a, int64_t total, const EncodeParams& p) {
  const unsigned grid = Blocks(total);
  const unsigned block = kWarpsPerBlock * 32;
  switch (g) {
    case 32: encode_kernel<32, FMT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 64: encode_kernel<64, FMT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 128: encode_kernel<128, FMT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 256: encode_kernel<256, FMT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 512: encode_kernel<512, FMT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    default: return false;
  }
}

template <int FMT>
bool LaunchDecode(int g, cudaStream_t st, const uint8_t* q, const float* s, const float* a, float sqrt_g, float* out,
                  int64_t total) {
  const unsigned grid = Blocks(total);
  const unsigned block = kWarpsPerBlock * 32;
  switch (g) {
    case 32: decode_kernel<32, FMT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 64: decode_kernel<64, FMT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 128: decode_kernel<128, FMT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 256: decode_kernel<256, FMT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 512: decode_kernel<512, FMT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    default: return false;
  }
}

ffi::Error LastError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error EncodeImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> codes,
                      ffi::Result<ffi::Buffer<ffi::F32>> s, ffi::Result<ffi::Buffer<ffi::F32>> a, int32_t fmt, float lam,
                      float fmax, float target_range, int64_t n_groups, int64_t last_count, int32_t /*impl*/) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_encode: x must have rank >= 1");
  const int64_t g = dims.back();
  const int64_t total = static_cast<int64_t>(x.element_count()) / g;
  if (FmtOf(codes->element_type()) != fmt) return ffi::Error::InvalidArgument("taco_encode: codes dtype does not match fmt");
  if (n_groups < 1 || total % n_groups != 0 || last_count < 1 || last_count > g)
    return ffi::Error::InvalidArgument("taco_encode: bad n_groups / last_count");
  EncodeParams p{lam, fmax, target_range, static_cast<float>(std::sqrt(static_cast<double>(g))),
                 static_cast<float>(last_count), n_groups};
  if (total == 0) return ffi::Error::Success();
  uint8_t* qp = static_cast<uint8_t*>(codes->untyped_data());
  const bool ok = fmt == kE4M3 ? LaunchEncode<kE4M3>(static_cast<int>(g), stream, x.typed_data(), qp, s->typed_data(), a->typed_data(), total, p)
                               : LaunchEncode<kE5M2>(static_cast<int>(g), stream, x.typed_data(), qp, s->typed_data(), a->typed_data(), total, p);
  if (!ok) return ffi::Error::InvalidArgument("taco_encode: G must be a power of 2 in [32, 512]");
  return LastError("taco_encode launch");
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::AnyBuffer codes, ffi::Buffer<ffi::F32> s, ffi::RemainingArgs rest,
                      ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t has_a, int32_t /*impl*/) {
  const auto dims = codes.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_decode: codes must have rank >= 1");
  const int64_t g = dims.back();
  const int fmt = FmtOf(codes.element_type());
  if (fmt < 0) return ffi::Error::InvalidArgument("taco_decode: codes must be float8_e4m3fn or float8_e5m2");
  const int64_t total = static_cast<int64_t>(codes.element_count()) / g;
  const float* ap = nullptr;
  if (has_a) {
    auto a = rest.get<ffi::Buffer<ffi::F32>>(0);
    if (a.has_error()) return a.error();
    ap = a->typed_data();
  }
  if (total == 0) return ffi::Error::Success();
  const float sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));
  const uint8_t* qp = static_cast<const uint8_t*>(codes.untyped_data());
  const bool ok = fmt == kE4M3 ? LaunchDecode<kE4M3>(static_cast<int>(g), stream, qp, s.typed_data(), ap, sqrt_g, out->typed_data(), total)
                               : LaunchDecode<kE5M2>(static_cast<int>(g), stream, qp, s.typed_data(), ap, sqrt_g, out->typed_data(), total);
  if (!ok) return ffi::Error::InvalidArgument("taco_decode: G must be a power of 2 in [32, 512]");
  return LastError("taco_decode launch");
}

ffi::Error CastImpl(cudaStream_t stream, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, float clamp, int32_t /*impl*/) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (n == 0) return ffi::Error::Success();
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535));
  if (in.element_type() == ffi::DataType::F32) {
    const int fmt = FmtOf(out->element_type());
    if (fmt < 0) return ffi::Error::InvalidArgument("taco_fp8_cast: output must be an FP8 type");
    cast_to_fp8_kernel<<<grid, 256, 0, stream>>>(static_cast<const float*>(in.untyped_data()),
                                                 static_cast<uint8_t*>(out->untyped_data()), n, fmt, clamp);
  } else {
    const int fmt = FmtOf(in.element_type());
    if (fmt < 0 || out->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("taco_fp8_cast: expects f32 -> fp8 or fp8 -> f32");
    cast_from_fp8_kernel<<<grid, 256, 0, stream>>>(static_cast<const uint8_t*>(in.untyped_data()),
                                                   static_cast<float*>(out->untyped_data()), n, fmt);
  }
  return LastError("taco_fp8_cast launch");
}

}  // namespace
}  // namespace taco

TACO_FFI_DEFINE_HANDLERS(Cuda, ffi::PlatformStream<cudaStream_t>);
