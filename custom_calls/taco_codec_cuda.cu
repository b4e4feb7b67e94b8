// TACO group codec as XLA FFI handlers for CUDA GPUs (TACO spec §2; TACO (arXiv 2604.24088),
// structure after the COCCL taco plugin's reference CUDA codec).
//
// Every lane holds 16 consecutive elements of one group, so that each lane's global accesses are
// 128-bit: the message as float4 (float32) or uint4 (8 bfloat16 / float16) loads, the 16 codes as
// one uint4 store (decode: one uint4 load, and float4 / uint4 stores). A group of G elements spans
// L = G / 16 lanes (2 at G = 32 .. 32 at G = 512), and a warp holds 512 / G groups (one 512-element
// tile); warps stride over tiles. Walsh-Hadamard butterflies: strides 1..8 inside each lane's
// registers, strides 16..G/2 across the group's lanes with __shfl_xor_sync (xor < L stays inside
// the group); sum of squares, finiteness and absmax are reductions over the same lanes. FP8
// conversion uses the hardware RNE saturating cvt (sm >= 89; emulated by cuda_fp8.h below that).
//
// Messages are float32, bfloat16 or float16, read and written in their own dtype: 16-bit inputs
// are widened in registers (exact), decoded values are clipped to the output dtype's finite range
// (codec.dispatch.clip_to_dtype) and rounded by cvt.rn (__float2bfloat16_rn / __float2half_rn,
// what XLA's convert runs), so XLA adds no convert around the codec.
//
// Targets, attributes and shapes are those of taco_codec_cpu.cc (same Python wrapper, same bound
// signatures: taco_ffi_bind.h): taco_encode, taco_decode, taco_fp8_cast. The `impl` attribute is
// accepted and ignored.
//
// Build (see Makefile): nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr
//   -Xcompiler -fPIC -shared -I$(python -c "import jax; print(jax.ffi.include_dir())")
//   taco_codec_cuda.cu -o ../taco_jax/kernels/_lib/libtaco_codec_cuda.so

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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
constexpr int kPerLane = 16;    // elements per lane: 16 codes = one 128-bit access
constexpr int kTile = 32 * kPerLane;  // elements per warp tile (512 / G groups)

// Message dtypes (the MsgDtype codes of taco_cpu_common.h).
enum MsgDtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct EncodeParams {
  float lam, fmax, range, sqrt_g, last_count;
  int64_t n_groups;
};

__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }

// 16 message values at p (16-byte aligned) -> 16 floats, exact: 4 float4 or 2 uint4 loads.
template <int DT>
__device__ __forceinline__ void load16(const void* p, float (&v)[kPerLane]) {
  if constexpr (DT == kF32) {
    const float4* q = static_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 t = q[i];
      v[4 * i] = t.x, v[4 * i + 1] = t.y, v[4 * i + 2] = t.z, v[4 * i + 3] = t.w;
    }
  } else {
    const uint4* q = static_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 t = q[i];
      const uint32_t w[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (DT == kBF16) {  // bfloat16 -> float32 is a shift
          v[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
          v[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        } else {
          __half2 h;
          memcpy(&h, &w[k], 4);
          const float2 f = __half22float2(h);
          v[8 * i + 2 * k] = f.x, v[8 * i + 2 * k + 1] = f.y;
        }
      }
    }
  }
}

// 16 floats -> 16 message values at p (16-byte aligned): 4 float4 or 2 uint4 stores. 16-bit
// dtypes: clipped to the dtype's finite range (NaN kept), then rounded to nearest even (cvt.rn).
template <int DT>
__device__ __forceinline__ void store16(void* p, const float (&v)[kPerLane]) {
  if constexpr (DT == kF32) {
    float4* q = static_cast<float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  } else {
    constexpr float kBig = DT == kBF16 ? 3.38953139e38f : 65504.0f;
    uint4* q = static_cast<uint4*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float lo = v[8 * i + 2 * k], hi = v[8 * i + 2 * k + 1];
        lo = lo != lo ? lo : fminf(fmaxf(lo, -kBig), kBig);
        hi = hi != hi ? hi : fminf(fmaxf(hi, -kBig), kBig);
        if constexpr (DT == kBF16) {
          const __nv_bfloat162 h = __halves2bfloat162(__float2bfloat16_rn(lo), __float2bfloat16_rn(hi));
          memcpy(&w[k], &h, 4);
        } else {
          const __half2 h = __halves2half2(__float2half_rn(lo), __float2half_rn(hi));
          memcpy(&w[k], &h, 4);
        }
      }
      q[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Reductions over the L lanes of one group (xor offsets < L stay inside the group's lanes).
template <int L>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

template <int L>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

template <int L>
__device__ __forceinline__ bool group_all(bool b) {
  int v = b ? 1 : 0;
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v &= __shfl_xor_sync(kFull, v, o);
  return v != 0;
}

// Unnormalised WHT of one group of G = 16 L values (Sylvester order, element = lane_in_group * 16 + i).
template <int L>
__device__ __forceinline__ void group_wht(float (&y)[kPerLane], int lane_in_group) {
#pragma unroll
  for (int h = 1; h < kPerLane; h <<= 1) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if ((i & h) == 0) {
        const float u = y[i], w = y[i + h];
        y[i] = __fadd_rn(u, w);
        y[i + h] = __fsub_rn(u, w);
      }
    }
  }
#pragma unroll
  for (int hl = 1; hl < L; hl <<= 1) {
    const bool upper = (lane_in_group & hl) != 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
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

// Encodes groups [0, total) of x (dtype DT): codes q, scales s_out, a_out.
template <int G, int FMT, int DT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    encode_kernel(const void* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ s_out,
                  float* __restrict__ a_out, int64_t total, EncodeParams p) {
  constexpr int L = G / kPerLane;  // lanes per group
  constexpr int GPW = 32 / L;      // groups per warp tile
  constexpr int kBytes = DT == kF32 ? 4 : 2;
  const int lane = threadIdx.x & 31, lig = lane % L;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); t * GPW < total; t += nwarps) {
    const int64_t gi = t * GPW + lane / L;  // this lane's group (the whole group's lanes agree)
    const bool active = gi < total;
    const int64_t e0 = gi * G + lig * kPerLane;  // first element of this lane
    float y[kPerLane];
    if (active) {
      load16<DT>(static_cast<const char*>(x) + e0 * kBytes, y);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) y[i] = 0.0f;
    }
    // 1-2. sum of squares, finiteness, adaptive scale a
    float ss = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      ss = __fadd_rn(ss, __fmul_rn(y[i], y[i]));
      finite &= isfinite(y[i]);
    }
    ss = group_sum<L>(ss);
    finite = group_all<L>(finite);
    const float count = (gi % p.n_groups == p.n_groups - 1) ? p.last_count : static_cast<float>(G);
    const float m = __fdiv_rn(ss, count);
    const float v = nan_max(__fadd_rn(m, p.lam), EPS);
    const float a = nan_min(nan_max(__fdiv_rn(p.fmax, __fsqrt_rn(v)), ADAPTIVE_SCALE_MIN), ADAPTIVE_SCALE_MAX);
    // 3. WHT(a x) in registers and shuffles; absmax
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) y[i] = __fmul_rn(a, y[i]);
    group_wht<L>(y, lig);
    float mx = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) mx = fmaxf(mx, fabsf(y[i]));
    mx = group_max<L>(mx);
    // 4. s; 5. codes = fp8(clamp(raw / (sqrt(G) s), -R, R)); a group holding NaN/Inf: s = NaN
    const float ymax = __fdiv_rn(mx, p.sqrt_g);
    const float s = finite ? fminf(fmaxf(__fdiv_rn(fmaxf(ymax, EPS), p.range), EPS), SCALE_MAX) : __int_as_float(0x7FC00000);
    const float k = static_cast<float>(1.0 / (static_cast<double>(p.sqrt_g) * static_cast<double>(s)));
    uint8_t b[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      b[i] = finite ? quantize<FMT>(fminf(fmaxf(__fmul_rn(y[i], k), -p.range), p.range)) : fp8_nan(FMT);
    if (active) {
      uint4 w;
      memcpy(&w, b, 16);
      *reinterpret_cast<uint4*>(q + e0) = w;
      if (lig == 0) {
        s_out[gi] = s;
        a_out[gi] = a;
      }
    }
  }
}

// Decodes groups [0, total) into out (dtype DT).
template <int G, int FMT, int DT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    decode_kernel(const uint8_t* __restrict__ q, const float* __restrict__ s, const float* __restrict__ a,
                  float sqrt_g, void* __restrict__ out, int64_t total) {
  constexpr int L = G / kPerLane;
  constexpr int GPW = 32 / L;
  constexpr int kBytes = DT == kF32 ? 4 : 2;
  const int lane = threadIdx.x & 31, lig = lane % L;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); t * GPW < total; t += nwarps) {
    const int64_t gi = t * GPW + lane / L;
    const bool active = gi < total;
    const int64_t e0 = gi * G + lig * kPerLane;
    uint8_t b[kPerLane] = {};
    float sg = 0.0f, k = 0.0f;
    if (active) {
      const uint4 w = *reinterpret_cast<const uint4*>(q + e0);
      memcpy(b, &w, 16);
      sg = s[gi];
      double d = sqrt_g;
      if (a != nullptr) d *= static_cast<double>(nan_max(a[gi], EPS));
      k = static_cast<float>(1.0 / d);
    }
    float y[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) y[i] = __fmul_rn(dequantize<FMT>(b[i]), sg);
    group_wht<L>(y, lig);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) y[i] = __fmul_rn(y[i], k);
    if (active) store16<DT>(static_cast<char*>(out) + e0 * kBytes, y);
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

int DtOf(ffi::DataType t) {
  if (t == ffi::DataType::F32) return kF32;
  if (t == ffi::DataType::BF16) return kBF16;
  if (t == ffi::DataType::F16) return kF16;
  return -1;
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <int FMT, int DT>
bool LaunchEncode(int g, cudaStream_t st, const void* x, uint8_t* q, float* s, float* a, int64_t total, const EncodeParams& p) {
  const unsigned grid = Blocks((total * g + kTile - 1) / kTile);
  const unsigned block = kWarpsPerBlock * 32;
  switch (g) {
    case 32: encode_kernel<32, FMT, DT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 64: encode_kernel<64, FMT, DT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 128: encode_kernel<128, FMT, DT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 256: encode_kernel<256, FMT, DT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    case 512: encode_kernel<512, FMT, DT><<<grid, block, 0, st>>>(x, q, s, a, total, p); return true;
    default: return false;
  }
}

template <int FMT, int DT>
bool LaunchDecode(int g, cudaStream_t st, const uint8_t* q, const float* s, const float* a, float sqrt_g, void* out,
                  int64_t total) {
  const unsigned grid = Blocks((total * g + kTile - 1) / kTile);
  const unsigned block = kWarpsPerBlock * 32;
  switch (g) {
    case 32: decode_kernel<32, FMT, DT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 64: decode_kernel<64, FMT, DT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 128: decode_kernel<128, FMT, DT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 256: decode_kernel<256, FMT, DT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    case 512: decode_kernel<512, FMT, DT><<<grid, block, 0, st>>>(q, s, a, sqrt_g, out, total); return true;
    default: return false;
  }
}

template <int FMT>
bool LaunchEncodeDt(int dt, int g, cudaStream_t st, const void* x, uint8_t* q, float* s, float* a, int64_t total,
                    const EncodeParams& p) {
  if (dt == kF32) return LaunchEncode<FMT, kF32>(g, st, x, q, s, a, total, p);
  if (dt == kBF16) return LaunchEncode<FMT, kBF16>(g, st, x, q, s, a, total, p);
  return LaunchEncode<FMT, kF16>(g, st, x, q, s, a, total, p);
}

template <int FMT>
bool LaunchDecodeDt(int dt, int g, cudaStream_t st, const uint8_t* q, const float* s, const float* a, float sqrt_g,
                    void* out, int64_t total) {
  if (dt == kF32) return LaunchDecode<FMT, kF32>(g, st, q, s, a, sqrt_g, out, total);
  if (dt == kBF16) return LaunchDecode<FMT, kBF16>(g, st, q, s, a, sqrt_g, out, total);
  return LaunchDecode<FMT, kF16>(g, st, q, s, a, sqrt_g, out, total);
}

ffi::Error LastError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> codes,
                      ffi::Result<ffi::Buffer<ffi::F32>> s, ffi::Result<ffi::Buffer<ffi::F32>> a, int32_t fmt, float lam,
                      float fmax, float target_range, int64_t n_groups, int64_t last_count, int32_t /*impl*/) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_encode: x must have rank >= 1");
  const int64_t g = dims.back();
  if (g < MIN_GROUP_SIZE || g > MAX_GROUP_SIZE || (g & (g - 1)) != 0)
    return ffi::Error::InvalidArgument("taco_encode: G must be a power of 2 in [32, 512]");
  const int dt = DtOf(x.element_type());
  if (dt < 0) return ffi::Error::InvalidArgument("taco_encode: x must be float32, bfloat16 or float16");
  const int64_t total = static_cast<int64_t>(x.element_count()) / g;
  if (FmtOf(codes->element_type()) != fmt) return ffi::Error::InvalidArgument("taco_encode: codes dtype does not match fmt");
  if (static_cast<int64_t>(codes->element_count()) != total * g || static_cast<int64_t>(s->element_count()) != total ||
      static_cast<int64_t>(a->element_count()) != total)
    return ffi::Error::InvalidArgument("taco_encode: output shapes do not match x");
  if (n_groups < 1 || total % n_groups != 0 || last_count < 1 || last_count > g)
    return ffi::Error::InvalidArgument("taco_encode: bad n_groups / last_count");
  EncodeParams p{lam, fmax, target_range, static_cast<float>(std::sqrt(static_cast<double>(g))),
                 static_cast<float>(last_count), n_groups};
  if (total == 0) return ffi::Error::Success();
  uint8_t* qp = static_cast<uint8_t*>(codes->untyped_data());
  if (!Aligned16(x.untyped_data()) || !Aligned16(qp))
    return ffi::Error::InvalidArgument("taco_encode: x and codes must be 16-byte aligned");
  const bool ok = fmt == kE4M3
                      ? LaunchEncodeDt<kE4M3>(dt, static_cast<int>(g), stream, x.untyped_data(), qp, s->typed_data(), a->typed_data(), total, p)
                      : LaunchEncodeDt<kE5M2>(dt, static_cast<int>(g), stream, x.untyped_data(), qp, s->typed_data(), a->typed_data(), total, p);
  if (!ok) return ffi::Error::InvalidArgument("taco_encode: G must be a power of 2 in [32, 512]");
  return LastError("taco_encode launch");
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::AnyBuffer codes, ffi::Buffer<ffi::F32> s, ffi::RemainingArgs rest,
                      ffi::Result<ffi::AnyBuffer> out, int32_t has_a, int32_t /*impl*/) {
  const auto dims = codes.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_decode: codes must have rank >= 1");
  const int64_t g = dims.back();
  if (g < MIN_GROUP_SIZE || g > MAX_GROUP_SIZE || (g & (g - 1)) != 0)
    return ffi::Error::InvalidArgument("taco_decode: G must be a power of 2 in [32, 512]");
  const int fmt = FmtOf(codes.element_type());
  if (fmt < 0) return ffi::Error::InvalidArgument("taco_decode: codes must be float8_e4m3fn or float8_e5m2");
  const int dt = DtOf(out->element_type());
  if (dt < 0) return ffi::Error::InvalidArgument("taco_decode: the output must be float32, bfloat16 or float16");
  const int64_t total = static_cast<int64_t>(codes.element_count()) / g;
  if (static_cast<int64_t>(s.element_count()) != total || static_cast<int64_t>(out->element_count()) != total * g)
    return ffi::Error::InvalidArgument("taco_decode: shapes of s / output do not match codes");
  const float* ap = nullptr;
  if (has_a) {
    auto a = rest.get<ffi::Buffer<ffi::F32>>(0);
    if (a.has_error()) return a.error();
    if (static_cast<int64_t>(a->element_count()) != total)
      return ffi::Error::InvalidArgument("taco_decode: shape of a does not match codes");
    ap = a->typed_data();
  }
  if (total == 0) return ffi::Error::Success();
  const float sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));
  const uint8_t* qp = static_cast<const uint8_t*>(codes.untyped_data());
  if (!Aligned16(qp) || !Aligned16(out->untyped_data()))
    return ffi::Error::InvalidArgument("taco_decode: codes and the output must be 16-byte aligned");
  const bool ok = fmt == kE4M3
                      ? LaunchDecodeDt<kE4M3>(dt, static_cast<int>(g), stream, qp, s.typed_data(), ap, sqrt_g, out->untyped_data(), total)
                      : LaunchDecodeDt<kE5M2>(dt, static_cast<int>(g), stream, qp, s.typed_data(), ap, sqrt_g, out->untyped_data(), total);
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

// Interface version, checked by taco_jax/kernels/ffi_codec.py (taco_ffi_bind.h).
extern "C" int taco_ffi_abi() { return TACO_FFI_ABI; }
