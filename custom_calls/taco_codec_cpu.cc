// TACO group codec as XLA FFI handlers for the CPU (TACO spec §2; TACO (arXiv 2604.24088)).
//
// One pass over the input: load, sum of squares and in-register Walsh-Hadamard butterflies,
// absmax; adaptive and quantization scales batched over 8 groups; quantize to FP8, store;
// decode likewise (see README.md). Groups are split in dynamic chunks over the calling thread
// and the library's own spinning helper threads (taco_thread_pool.h). On x86-64 an AVX2+FMA+F16C
// kernel (taco_kernel_avx2.cc) is chosen at run time when the CPU has it; a portable scalar kernel
// with the *same* operation order (taco_kernel_scalar.cc) is the fallback (and `impl=1` forces it,
// for tests), so the two give bit-identical results. This file: the FFI handlers; their bound
// signatures are in taco_ffi_bind.h, shared with the CUDA handlers.
//
// Targets (all take x / codes of shape [..., G] with G in {32, 64, ..., 512}):
//   taco_encode(x f32[..., G]) -> (codes fp8[..., G], s f32[...], a f32[...])
//       attrs: fmt (0 = e4m3, 1 = e5m2), lam, fmax, target_range (f32), n_groups, last_count
//       (i64: groups per message and the real size of each message's last group), impl (i32).
//       Extra (aliased) arguments after x are ignored: they let the caller donate buffers.
//   taco_decode(codes fp8[..., G], s f32[...], [a f32[...]], ...) -> x f32[..., G]
//       attrs: has_a (i32: 1 dual layout, 0 folded), impl (i32).
//   taco_reduce(P x codes fp8[N, G], P x s f32[N], [P x a f32[N]]) -> (codes fp8[N, G], s f32[N])
//       transform-domain sum and requantization (two-shot all-reduce); attrs fmt, has_a,
//       target_range (f32), impl. CPU only.
//   On the CPU, codes may also be uint8 (the FP8 bytes; fmt from the fmt attribute, for
//   taco_decode from impl >> 8 = fmt + 1), so that XLA moves them without a conversion copy.
//   taco_fp8_cast(f32 -> fp8 or fp8 -> f32, elementwise; attrs clamp (f32: > 0 clamps to
//       +-clamp and uses the codec's quantizer), impl): for conformance tests.
//
// Build: see custom_calls/Makefile (`make -C custom_calls`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "taco_cpu_common.h"
#include "taco_ffi_bind.h"
#include "taco_kernel_avx2.h"
#include "taco_kernel_scalar.h"
#include "taco_thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace taco {
namespace {

constexpr int64_t kChunkBytes = 64 * 1024;  // f32 input bytes per parallel work item
constexpr int64_t kStreamBytes = 8 << 20;   // outputs at least this big use streaming stores

int64_t GroupsPerChunk(int g) { return std::max<int64_t>(1, kChunkBytes / (4 * g)); }

bool ValidGroupSize(int64_t g) { return g >= MIN_GROUP_SIZE && g <= MAX_GROUP_SIZE && (g & (g - 1)) == 0; }

int FmtOf(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return kE4M3;
  if (t == ffi::DataType::F8E5M2) return kE5M2;
  return -1;
}

bool Aligned32(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 31u) == 0; }

// ------------------------------------------------------------------------------------------
// FFI handlers.
// ------------------------------------------------------------------------------------------

ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs,
                      ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::Buffer<ffi::F32>> s,
                      ffi::Result<ffi::Buffer<ffi::F32>> a, int32_t fmt, float lam, float fmax,
                      float target_range, int64_t n_groups, int64_t last_count, int32_t impl) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_encode: x must have rank >= 1");
  const int64_t g = dims.back();
  if (!ValidGroupSize(g)) return ffi::Error::InvalidArgument("taco_encode: G must be a power of 2 in [32, 512]");
  if (codes->element_type() != ffi::DataType::U8 && FmtOf(codes->element_type()) != fmt)
    return ffi::Error::InvalidArgument("taco_encode: codes dtype does not match fmt (nor is it uint8)");
  const int64_t total = static_cast<int64_t>(x.element_count()) / g;
  if (static_cast<int64_t>(codes->element_count()) != total * g || static_cast<int64_t>(s->element_count()) != total ||
      static_cast<int64_t>(a->element_count()) != total)
    return ffi::Error::InvalidArgument("taco_encode: output shapes do not match x");
  if (n_groups < 1 || total % n_groups != 0 || last_count < 1 || last_count > g)
    return ffi::Error::InvalidArgument("taco_encode: bad n_groups / last_count");

  EncodeParams p;
  p.fmt = fmt;
  p.g = static_cast<int>(g);
  p.lam = lam;
  p.fmax = fmax;
  p.range = target_range;
  p.n_groups = n_groups;
  p.last_count = static_cast<float>(last_count);
  p.sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));

  const float* xp = x.typed_data();
  uint8_t* qp = static_cast<uint8_t*>(codes->untyped_data());
  float* sp = s->typed_data();
  float* ap = a->typed_data();

#if TACO_X86
  if (impl == 0 && HaveAvx2()) {
    EncodeFn fn = EncodeAvx(fmt, p.g);
    const bool stream = total * g >= kStreamBytes && Aligned32(qp);
    ParallelFor(pool.num_threads(), total, GroupsPerChunk(p.g), [&](int64_t b, int64_t e) { fn(xp, qp, sp, ap, b, e, p, stream); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(pool.num_threads(), total, GroupsPerChunk(p.g), [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi) {
      const float count = (gi % n_groups == n_groups - 1) ? p.last_count : static_cast<float>(g);
      encode_group_scalar(xp + gi * g, qp + gi * g, sp + gi, ap + gi, count, p);
    }
  });
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer codes, ffi::Buffer<ffi::F32> s, ffi::RemainingArgs rest,
                      ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t has_a, int32_t impl) {
  const auto dims = codes.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_decode: codes must have rank >= 1");
  const int64_t g = dims.back();
  if (!ValidGroupSize(g)) return ffi::Error::InvalidArgument("taco_decode: G must be a power of 2 in [32, 512]");
  // uint8 codes carry their format in impl's bits 8.. (fmt + 1); impl's low byte is the kernel choice.
  const int fmt = codes.element_type() == ffi::DataType::U8 ? (impl >> 8) - 1 : FmtOf(codes.element_type());
  impl &= 0xFF;
  if (fmt != kE4M3 && fmt != kE5M2)
    return ffi::Error::InvalidArgument("taco_decode: codes must be float8_e4m3fn, float8_e5m2 or uint8 with a format");
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
  const uint8_t* qp = static_cast<const uint8_t*>(codes.untyped_data());
  const float* sp = s.typed_data();
  float* op = out->typed_data();
  const float sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));

#if TACO_X86
  if (impl == 0 && HaveAvx2()) {
    DecodeFn fn = DecodeAvx(fmt, static_cast<int>(g));
    const bool stream = total * g * 4 >= kStreamBytes && Aligned32(op);
    ParallelFor(pool.num_threads(), total, GroupsPerChunk(static_cast<int>(g)),
                [&](int64_t b, int64_t e) { fn(qp, sp, ap, sqrt_g, op, b, e, stream); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(pool.num_threads(), total, GroupsPerChunk(static_cast<int>(g)), [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi) {
      decode_group_scalar(qp + gi * g, sp[gi], decode_factor(sqrt_g, ap, gi), static_cast<int>(g), fmt, op + gi * g);
    }
  });
  return ffi::Error::Success();
}

// Transform-domain reduction (two-shot all-reduce): P ranks' codes [N, G] then their P scales s
// [N] (then P scales a [N] if has_a), all as separate operands (no concatenation copy) ->
// codes' [N, G], s' [N] (taco_jax.codec.reference.reduce_groups).
ffi::Error ReduceImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> codes_out,
                      ffi::Result<ffi::Buffer<ffi::F32>> s_out, int32_t fmt, int32_t has_a, float target_range,
                      int32_t impl) {
  const int64_t per_rank = has_a ? 3 : 2;
  const int64_t P = static_cast<int64_t>(args.size()) / per_rank;
  if (P < 1 || P > 1024 || P * per_rank != static_cast<int64_t>(args.size()))
    return ffi::Error::InvalidArgument("taco_reduce: expects P codes, P s (and P a) operands, 1 <= P <= 1024");
  const auto dims = codes_out->dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("taco_reduce: output codes must be [N, G]");
  const int64_t n = dims[0], g = dims[1];
  if (!ValidGroupSize(g)) return ffi::Error::InvalidArgument("taco_reduce: G must be a power of 2 in [32, 512]");
  const bool u8 = codes_out->element_type() == ffi::DataType::U8;
  if (!(u8 ? fmt == kE4M3 || fmt == kE5M2 : FmtOf(codes_out->element_type()) == fmt))
    return ffi::Error::InvalidArgument("taco_reduce: codes must be the FP8 type of fmt, or uint8");
  if (static_cast<int64_t>(s_out->element_count()) != n)
    return ffi::Error::InvalidArgument("taco_reduce: output s must be [N]");
  std::vector<const uint8_t*> qs(P);
  std::vector<const float*> ss(P), as(has_a ? P : 0);
  for (int64_t r = 0; r < P; ++r) {
    auto c = args.get<ffi::AnyBuffer>(r);
    auto s = args.get<ffi::Buffer<ffi::F32>>(P + r);
    if (c.has_error()) return c.error();
    if (s.has_error()) return s.error();
    if (c->element_type() != codes_out->element_type() || static_cast<int64_t>(c->element_count()) != n * g ||
        static_cast<int64_t>(s->element_count()) != n)
      return ffi::Error::InvalidArgument("taco_reduce: every rank's codes must be [N, G] of the output's type, s [N]");
    qs[r] = static_cast<const uint8_t*>(c->untyped_data());
    ss[r] = s->typed_data();
    if (has_a) {
      auto a = args.get<ffi::Buffer<ffi::F32>>(2 * P + r);
      if (a.has_error()) return a.error();
      if (static_cast<int64_t>(a->element_count()) != n)
        return ffi::Error::InvalidArgument("taco_reduce: every rank's a must be [N]");
      as[r] = a->typed_data();
    }
  }
  const uint8_t* const* qp = qs.data();
  const float* const* sp = ss.data();
  const float* const* ap = has_a ? as.data() : nullptr;
  uint8_t* qo = static_cast<uint8_t*>(codes_out->untyped_data());
  float* so = s_out->typed_data();
  const int64_t per_chunk = std::max<int64_t>(1, GroupsPerChunk(static_cast<int>(g)) / P);
#if TACO_X86
  if (impl == 0 && HaveAvx2()) {
    ReduceFn fn = ReduceAvx(fmt, static_cast<int>(g));
    ParallelFor(pool.num_threads(), n, per_chunk,
                [&](int64_t b, int64_t e) { fn(qp, sp, ap, P, target_range, qo, so, b, e); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(pool.num_threads(), n, per_chunk, [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi)
      reduce_group_scalar(qp, sp, ap, P, gi, static_cast<int>(g), fmt, target_range, qo, so);
  });
  return ffi::Error::Success();
}

// clamp > 0: fp8(clamp(x, -clamp, clamp)) through the codec's quantizer (x must not be NaN).
ffi::Error CastImpl(ffi::ThreadPool /*pool*/, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, float clamp, int32_t impl) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (static_cast<int64_t>(out->element_count()) != n) return ffi::Error::InvalidArgument("taco_fp8_cast: size mismatch");
  const bool avx = impl == 0 && HaveAvx2();
  if (in.element_type() == ffi::DataType::F32) {
    const int fmt = FmtOf(out->element_type());
    if (fmt < 0) return ffi::Error::InvalidArgument("taco_fp8_cast: output must be an FP8 type");
    const float* x = static_cast<const float*>(in.untyped_data());
    uint8_t* q = static_cast<uint8_t*>(out->untyped_data());
#if TACO_X86
    if (avx) return cast_to_fp8_avx(x, q, n, fmt, clamp), ffi::Error::Success();
#endif
    for (int64_t i = 0; i < n; ++i) q[i] = f32_to_fp8(clamp > 0 ? std::min(std::max(x[i], -clamp), clamp) : x[i], fmt);
    return ffi::Error::Success();
  }
  const int fmt = FmtOf(in.element_type());
  if (fmt < 0 || out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("taco_fp8_cast: expects f32 -> fp8 or fp8 -> f32");
  const uint8_t* q = static_cast<const uint8_t*>(in.untyped_data());
  float* x = static_cast<float*>(out->untyped_data());
#if TACO_X86
  if (avx) return cast_from_fp8_avx(q, x, n, fmt), ffi::Error::Success();
#endif
  for (int64_t i = 0; i < n; ++i) x[i] = fp8_to_f32(q[i], fmt);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace taco

TACO_FFI_DEFINE_HANDLERS(Cpu, ffi::ThreadPool);

// CPU only (GPU runs the jnp reference of the reduction, which XLA fuses).
XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoReduceCpu, taco::ReduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int32_t>("has_a")
                                  .Attr<float>("target_range")
                                  .Attr<int32_t>("impl"));

// Plain C entry points (ctypes) for quick checks without JAX.
extern "C" {
int taco_cpu_has_avx2() { return taco::HaveAvx2() ? 1 : 0; }
}
