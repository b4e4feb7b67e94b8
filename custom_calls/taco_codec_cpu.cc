// TACO group codec as XLA FFI handlers for the CPU (TACO spec §2; TACO (arXiv 2604.24088)).
//
// One pass over the input: load, sum of squares and in-register Walsh-Hadamard butterflies,
// absmax; adaptive and quantization scales batched over 8 groups; quantize to FP8, store;
// decode likewise (see README.md). Groups are split in dynamic chunks over the calling thread
// and the library's own spinning helper threads (taco_thread_pool.h). On x86-64 an AVX2+FMA+F16C
// kernel (taco_kernel_avx2.cc) is chosen at run time when the CPU has it, and for the encoder and
// decoder an AVX-512 one (taco_kernel_avx512.cc, same lanes, two groups per vector) before it; a
// portable scalar kernel with the *same* operation order (taco_kernel_scalar.cc) is the fallback
// (`impl` caps the level, for tests: 1 scalar, 2 AVX2, 3 AVX-512, 0 the best), so all give
// bit-identical results. This file: the FFI handlers; their bound signatures are in
// taco_ffi_bind.h, shared with the CUDA handlers.
//
// Targets (all take x / codes of shape [..., G] with G in {32, 64, ..., 512}). Messages (x, and
// the decoded output) are float32, bfloat16 or float16, read and written in their own dtype: the
// kernels widen 16-bit inputs in registers (exact) and round decoded values to the output dtype
// as XLA's convert does (decode: clipped to the dtype's finite range first, as
// codec.dispatch.clip_to_dtype; decode-sum: the float32 sum rounded once), so XLA adds no convert.
//   taco_encode(x f32|bf16|f16[..., G]) -> (codes fp8[..., G], s f32[...], a f32[...])
//       attrs: fmt (0 = e4m3, 1 = e5m2), lam, fmax, target_range (f32), n_groups, last_count
//       (i64: groups per message and the real size of each message's last group), impl (i32).
//       Extra (aliased) arguments after x are ignored: they let the caller donate buffers.
//   taco_decode(codes fp8[..., G], s f32[...], [a f32[...]], ...) -> x f32|bf16|f16[..., G]
//       attrs: has_a (i32: 1 dual layout, 0 folded), impl (i32).
//   taco_reduce(P x codes fp8[N, G], P x s f32[N], [P x a f32[N]]) -> (codes fp8[N, G], s f32[N])
//       transform-domain sum and requantization (two-shot all-reduce); attrs fmt, has_a,
//       target_range (f32), impl. CPU only.
//   On the CPU, codes may also be uint8 (the FP8 bytes; fmt from the fmt attribute, for
//   taco_decode from impl >> 8 = fmt + 1), so that XLA moves them without a conversion copy.
//   Packed wire rows (CPU only; the "ffi" wire codec, `taco_jax/kernels/ffi_wire.py`):
//   one uint8 row per message, [codes n_groups*G][s n_groups f32][a n_groups f32] (has_a = 1) or
//   [codes][s/a] (has_a = 0), as `codec.wire.pack_rows` lays out an `Encoded`:
//     taco_encode_packed(x f32|bf16|f16[..., n_groups*G]) -> K x u8[..., row_bytes] (row i -> result i % K)
//         attrs fmt, lam, fmax, target_range, g, n_groups, last_count, has_a, impl, outer (i64:
//         > 1: x is [..., outer, P, inner], inner % G == 0, message row (v, r) = x[v, :, r, :])
//     taco_decode_packed(u8[..., row_bytes]) -> f32|bf16|f16[..., n_groups*G]; attrs fmt, g, has_a, impl,
//         outer (> 1: rows [..., P, row_bytes] -> f32[..., outer, P, inner], row r's element
//         (b, j) at [..., b, r, j]: the all-gather along a non-leading axis, no transpose)
//     taco_decode_sum_packed(ranks) -> f32|bf16|f16[..., n_groups*G]: decode and sum in rank order
//         (f32), the sum rounded to the output dtype once
//     taco_reduce_packed(ranks) -> u8[..., row_bytes]: encode_packed(decode_sum) with the sum's
//         padding past last_count zeroed; encode attrs and round (i32: the message dtype the sum is
//         rounded to before it is encoded again, 0 f32 (none), 1 bf16, 2 f16); a group in which the
//         rounded sum overflowed (+-Inf, no NaN) is written as an overflow group (DecodeRowSegment,
//         which every packed decoder runs, decodes it: +-Inf in those elements only)
//     taco_reduce_hadamard_packed(ranks) -> u8[..., n_groups*(G+4)]: taco_reduce, folded output;
//         attrs fmt, g, has_a, target_range, impl
//   where ranks = one u8[..., P, row_bytes] operand or P operands u8[..., row_bytes].
//   taco_fp8_cast(f32 -> fp8 or fp8 -> f32, elementwise; attrs clamp (f32: > 0 clamps to
//       +-clamp and uses the codec's quantizer), impl): for conformance tests. Also the kernels'
//       dtype conversions: f32 -> bf16 / f16 (the decoder's store; clamp > 0: clipped first) and
//       bf16 / f16 -> f32 (the encoder's load).
//
// Build: see custom_calls/Makefile (`make -C custom_calls`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "taco_cpu_common.h"
#include "taco_ffi_bind.h"
#include "taco_kernel_avx2.h"
#include "taco_kernel_avx512.h"
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

// The message dtype (MsgDtype) of a buffer, or -1.
int DtOf(ffi::DataType t) {
  if (t == ffi::DataType::F32) return kF32;
  if (t == ffi::DataType::BF16) return kBF16;
  if (t == ffi::DataType::F16) return kF16;
  return -1;
}

// Kernel level of the `impl` attribute: 0 = the best this CPU has, 1 = scalar, 2 = at most AVX2,
// 3 = at most AVX-512; each operation runs its fastest kernel at or below that level (AVX-512:
// the encoder and decoder; everything else AVX2). All levels give bit-identical results.
bool UseAvx2(int32_t impl) { return (impl == 0 || impl == 2 || impl == 3) && HaveAvx2(); }
bool UseAvx512(int32_t impl) { return (impl == 0 || impl == 3) && HaveAvx512(); }

#if TACO_X86
// The vector encoder and decoder for `impl` (UseAvx2(impl) must hold).
EncodeFn VectorEncoder(int32_t impl, int fmt, int g, int dt) {
  return UseAvx512(impl) ? EncodeAvx512(fmt, g, dt) : EncodeAvx(fmt, g, dt);
}
DecodeFn VectorDecoder(int32_t impl, int fmt, int g, int dt, bool acc = false) {
  return UseAvx512(impl) ? DecodeAvx512(fmt, g, dt, acc) : DecodeAvx(fmt, g, dt, acc);
}
#endif

// ------------------------------------------------------------------------------------------
// FFI handlers.
// ------------------------------------------------------------------------------------------

ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs,
                      ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::Buffer<ffi::F32>> s,
                      ffi::Result<ffi::Buffer<ffi::F32>> a, int32_t fmt, float lam, float fmax,
                      float target_range, int64_t n_groups, int64_t last_count, int32_t impl) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_encode: x must have rank >= 1");
  const int64_t g = dims.back();
  if (!ValidGroupSize(g)) return ffi::Error::InvalidArgument("taco_encode: G must be a power of 2 in [32, 512]");
  const int dt = DtOf(x.element_type());
  if (dt < 0) return ffi::Error::InvalidArgument("taco_encode: x must be float32, bfloat16 or float16");
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

  const char* xp = static_cast<const char*>(x.untyped_data());
  const int64_t xb = DtypeBytes(dt);
  uint8_t* qp = static_cast<uint8_t*>(codes->untyped_data());
  float* sp = s->typed_data();
  float* ap = a->typed_data();

#if TACO_X86
  if (UseAvx2(impl)) {
    EncodeFn fn = VectorEncoder(impl, fmt, p.g, dt);
    const bool stream = total * g >= kStreamBytes && Aligned32(qp);
    ParallelFor(pool.num_threads(), total, GroupsPerChunk(p.g), [&](int64_t b, int64_t e) { fn(xp, qp, sp, ap, b, e, p, stream); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(pool.num_threads(), total, GroupsPerChunk(p.g), [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi) {
      const float count = (gi % n_groups == n_groups - 1) ? p.last_count : static_cast<float>(g);
      encode_group_scalar_dt(xp + gi * g * xb, dt, qp + gi * g, sp + gi, ap + gi, count, p);
    }
  });
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer codes, ffi::Buffer<ffi::F32> s, ffi::RemainingArgs rest,
                      ffi::Result<ffi::AnyBuffer> out, int32_t has_a, int32_t impl) {
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
  const int dt = DtOf(out->element_type());
  if (dt < 0) return ffi::Error::InvalidArgument("taco_decode: the output must be float32, bfloat16 or float16");
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
  char* op = static_cast<char*>(out->untyped_data());
  const int64_t ob = DtypeBytes(dt);
  const float sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));

#if TACO_X86
  if (UseAvx2(impl)) {
    DecodeFn fn = VectorDecoder(impl, fmt, static_cast<int>(g), dt);
    const bool stream = total * g * ob >= kStreamBytes && Aligned32(op);
    ParallelFor(pool.num_threads(), total, GroupsPerChunk(static_cast<int>(g)),
                [&](int64_t b, int64_t e) { fn(qp, sp, ap, sqrt_g, op, b, e, stream); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(pool.num_threads(), total, GroupsPerChunk(static_cast<int>(g)), [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi) {
      decode_group_scalar_dt(qp + gi * g, sp[gi], decode_factor(sqrt_g, ap, gi), static_cast<int>(g), fmt,
                             op + gi * g * ob, dt, false);
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
  // [..., N, G]: leading (e.g. vmap batch) axes are flattened into the groups, as every operand's.
  if (dims.size() < 2) return ffi::Error::InvalidArgument("taco_reduce: output codes must be [..., N, G]");
  const int64_t g = dims.back(), n = static_cast<int64_t>(codes_out->element_count()) / std::max<int64_t>(g, 1);
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
  if (UseAvx2(impl)) {
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

// ------------------------------------------------------------------------------------------
// Packed wire rows: the fused path of the compressed collectives reads and writes the one uint8
// buffer they move. A row holds one message of n_groups groups of G:
//   [codes: n_groups * G bytes][s: n_groups f32][a: n_groups f32]   (has_a = 1, dual layout)
//   [codes: n_groups * G bytes][s/a: n_groups f32]                  (has_a = 0, folded layout)
// (what `codec.wire.pack_rows` builds from an `Encoded`). The per-group kernels run on row-relative
// pointers; rows are only 4-byte aligned in general (s/a are read and written one float at a time).
// ------------------------------------------------------------------------------------------

// Largest work item in groups (GroupsPerChunk(MIN_GROUP_SIZE)): bound of per-chunk scratch arrays.
constexpr int64_t kMaxChunkGroups = kChunkBytes / (4 * MIN_GROUP_SIZE);

struct Layout {
  int64_t ng, g, has_a;
  int64_t row_bytes() const { return ng * (g + 4 * (1 + has_a)); }
  uint8_t* codes(uint8_t* row) const { return row; }
  const uint8_t* codes(const uint8_t* row) const { return row; }
  float* s(uint8_t* row) const { return reinterpret_cast<float*>(row + ng * g); }
  const float* s(const uint8_t* row) const { return reinterpret_cast<const float*>(row + ng * g); }
  float* a(uint8_t* row) const { return has_a ? reinterpret_cast<float*>(row + ng * g) + ng : nullptr; }
  const float* a(const uint8_t* row) const {
    return has_a ? reinterpret_cast<const float*>(row + ng * g) + ng : nullptr;
  }
};

// Work items of `grain` groups that never straddle a row: ParallelFor over rows x ceil(ng / grain).
template <typename F>
void ParallelRowChunks(int64_t threads, int64_t rows, int64_t ng, int64_t grain, const F& fn) {
  const int64_t per_row = (ng + grain - 1) / grain;
  ParallelFor(threads, rows * per_row, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t row = c / per_row, lb = (c % per_row) * grain;
      fn(row, lb, std::min(ng, lb + grain));
    }
  });
}

// Encodes groups [lb, le) of one message into its packed row; xs: the segment's (le - lb) * G
// values of dtype dt. `a_tmp` (>= le - lb floats) receives a for the folded layout, whose row holds s/a.
void EncodeRowSegment(const void* xs, int dt, uint8_t* row, const Layout& L, int64_t lb, int64_t le,
                      const EncodeParams& p, int32_t impl, bool stream, float* a_tmp) {
  const int64_t n = le - lb, g = L.g;
  uint8_t* qs = L.codes(row) + lb * g;
  float* ss = L.s(row) + lb;
  float* as = L.has_a ? L.a(row) + lb : a_tmp;
#if TACO_X86
  if (UseAvx2(impl)) {
    EncodeParams q = p;
    q.n_groups = L.ng - lb;  // local group 0 is group lb, so the row's last group is local q.n_groups - 1
    VectorEncoder(impl, p.fmt, p.g, dt)(xs, qs, ss, as, 0, n, q, stream);
  } else
#endif
  {
    for (int64_t i = 0; i < n; ++i) {
      const float count = (lb + i == L.ng - 1) ? p.last_count : static_cast<float>(g);
      encode_group_scalar_dt(static_cast<const char*>(xs) + i * g * DtypeBytes(dt), dt, qs + i * g, ss + i, as + i,
                             count, p);
    }
  }
  if (!L.has_a)
    for (int64_t i = 0; i < n; ++i) ss[i] = ss[i] / as[i];  // the folded scale, as `s / a` in float32
}

// Overflow groups (`codec.dispatch.overflow_groups`): the two-shot all-reduce's partial sum, rounded
// to the message dtype, overflowed in some element(s) of the group (+-Inf there, no NaN). Such a
// group is sent with no transform: scale -s (the sign marks it; other scales are > 0 or NaN),
// s = max(max|x| over the finite elements, EPS) * (1 / R), codes fp8(clamp(x * (1 / s), -R, R)) (each
// reciprocal rounded to float32, as the jnp version's XLA program computes them) and, for +-Inf,
// the code no finite value takes (E4M3FN 0x7F, E5M2 0x7C; | 0x80 for -Inf). Encodes x (G float32
// values) into q and returns s.
float EncodeOverflowGroup(const float* x, int64_t g, int fmt, float range, uint8_t* q) {
  float amax = 0.0f;
  for (int64_t j = 0; j < g; ++j)
    if (!std::isinf(x[j])) amax = std::max(amax, std::fabs(x[j]));
  const float s = std::max(amax, EPS) * (1.0f / range), k = 1.0f / s;
  const uint8_t inf_code = fmt == kE4M3 ? 0x7Fu : 0x7Cu;
  for (int64_t j = 0; j < g; ++j)
    q[j] = std::isinf(x[j]) ? static_cast<uint8_t>(inf_code | (x[j] < 0.0f ? 0x80u : 0u))
                            : f32_to_fp8(std::min(std::max(x[j] * k, -range), range), fmt);
  return s;
}

// Decodes overflow group q with scale `scale` (< 0) into out (G values of dtype dt: fp8(q) * -scale
// clipped to dt's finite range, +-Inf for the Inf code); acc (dt float32): adds them to out.
void DecodeOverflowGroup(const uint8_t* q, float scale, int64_t g, int fmt, void* out, int dt, bool acc) {
  for (int64_t j = 0; j < g; ++j) {
    const float v = fp8_to_f32(q[j], fmt);
    const bool finite = std::isfinite(v);
    const float x = finite ? v * -scale : ((q[j] & 0x80u) ? -INFINITY : INFINITY);
    if (dt == kF32) {
      float* o = static_cast<float*>(out) + j;
      *o = acc ? *o + x : x;
    } else {
      static_cast<uint16_t*>(out)[j] = f32_to_narrow(x, dt, finite);
    }
  }
}

// Decodes groups [lb, le) of a packed row into out_seg ((le - lb) * G values of dtype dt); acc
// (dt float32): adds them to out_seg. Overflow groups (s < 0; rare) are decoded apart, the runs of
// groups between them by the kernels.
void DecodeRowSegment(const uint8_t* row, const Layout& L, int64_t lb, int64_t le, int fmt, int32_t impl, bool stream,
                      void* out_seg, int dt = kF32, bool acc = false) {
  const int64_t g = L.g, n = le - lb;
  const float sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));
  const uint8_t* qp = L.codes(row) + lb * g;
  const float* sp = L.s(row) + lb;
  const float* ap = L.has_a ? L.a(row) + lb : nullptr;
  char* op = static_cast<char*>(out_seg);
  const int64_t gb = g * DtypeBytes(dt);
  auto run = [&](int64_t b, int64_t e) {  // groups [b, e), none an overflow group
    if (e <= b) return;
#if TACO_X86
    if (UseAvx2(impl)) {
      VectorDecoder(impl, fmt, static_cast<int>(g), dt, acc)(qp, sp, ap, sqrt_g, out_seg, b, e, stream && !acc);
      return;
    }
#endif
    for (int64_t i = b; i < e; ++i)
      decode_group_scalar_dt(qp + i * g, sp[i], decode_factor(sqrt_g, ap, i), static_cast<int>(g), fmt, op + i * gb,
                             dt, acc);
  };
  int64_t b = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!(sp[i] < 0.0f)) continue;
    run(b, i);
    DecodeOverflowGroup(qp + i * g, sp[i], g, fmt, op + i * gb, dt, acc);
    b = i + 1;
  }
  run(b, n);
}

// Elementwise float32 -> dt without clipping (the decode-sum's one rounding), both kernels alike.
void ConvertFromF32(const float* x, void* out, int64_t n, int dt, int32_t impl) {
#if TACO_X86
  if (UseAvx2(impl)) return convert_from_f32_avx(x, out, n, dt, false);
#endif
  convert_from_f32_scalar(x, out, n, dt);
}

// Decodes groups [lb, le) of P packed rows (rows[r]: rank r's) and sums them in float32 in rank
// order (acc = d_0; acc = acc + d_r, each rank decoded straight into the sum) into out_seg
// ((le - lb) * G values of dtype dt: the float32 sum rounded once).
void DecodeSumRowSegment(const uint8_t* const* rows, int64_t P, const Layout& L, int64_t lb, int64_t le, int fmt,
                         int32_t impl, void* out_seg, int dt = kF32) {
  thread_local std::vector<float> scratch;
  const int64_t n = (le - lb) * L.g;
  float* acc = static_cast<float*>(out_seg);
  if (dt != kF32) {
    if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
    acc = scratch.data();
  }
  DecodeRowSegment(rows[0], L, lb, le, fmt, impl, false, acc);
  for (int64_t r = 1; r < P; ++r) DecodeRowSegment(rows[r], L, lb, le, fmt, impl, false, acc, kF32, true);
  if (dt != kF32) ConvertFromF32(acc, out_seg, n, dt, impl);
}

bool ValidFmt(int32_t fmt) { return fmt == kE4M3 || fmt == kE5M2; }

// P ranks' packed rows, `outer` rows each: given as one operand [..., P, row_bytes] or as P
// operands [..., row_bytes] (one per rank: the slices of an all-to-all's result, which XLA passes
// without the concatenation copy one [P, ...] operand would take).
struct RankRows {
  int64_t P = 0, outer = 0;
  std::vector<const uint8_t*> base;
  std::vector<int64_t> stride;
  const uint8_t* at(int64_t o, int64_t r) const { return base[r] + o * stride[r]; }
};

ffi::Error Invalid(const char* name, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
}

ffi::Error GetRankRows(const char* name, const ffi::RemainingArgs& args, const Layout& L, RankRows* rr) {
  const int64_t rb = L.row_bytes(), n_args = static_cast<int64_t>(args.size());
  const std::string width = "the packed rows' last axis must be n_groups * (G + " + std::to_string(4 * (1 + L.has_a)) +
                            ") = " + std::to_string(rb) + " bytes";
  if (n_args < 1 || n_args > 1024) return Invalid(name, "expects 1 to 1024 packed operands");
  for (int64_t r = 0; r < n_args; ++r) {
    auto in = args.get<ffi::Buffer<ffi::U8>>(r);
    if (in.has_error()) return Invalid(name, "packed rows must be uint8");
    const auto dims = in->dimensions();
    if (dims.size() < (n_args == 1 ? 2u : 1u)) return Invalid(name, "packed rows must be [..., P, row_bytes] or P x [..., row_bytes]");
    if (dims.back() != rb) return Invalid(name, width);
    const uint8_t* data = in->typed_data();
    const int64_t count = static_cast<int64_t>(in->element_count());
    if (n_args == 1) {
      rr->P = dims[dims.size() - 2];
      if (rr->P < 1 || rr->P > 1024) return Invalid(name, "expects 1 <= P <= 1024");
      rr->outer = count / (rr->P * rb);
      for (int64_t q = 0; q < rr->P; ++q) {
        rr->base.push_back(data + q * rb);
        rr->stride.push_back(rr->P * rb);
      }
    } else {
      if (r == 0) rr->outer = count / rb;
      if (count != rr->outer * rb) return Invalid(name, "every rank's packed rows must have the same shape");
      rr->P = n_args;
      rr->base.push_back(data);
      rr->stride.push_back(rb);
    }
  }
  return ffi::Error::Success();
}

EncodeParams MakeEncodeParams(int32_t fmt, float lam, float fmax, float target_range, int64_t g, int64_t n_groups,
                              int64_t last_count) {
  EncodeParams p;
  p.fmt = fmt;
  p.g = static_cast<int>(g);
  p.lam = lam;
  p.fmax = fmax;
  p.range = target_range;
  p.n_groups = n_groups;
  p.last_count = static_cast<float>(last_count);
  p.sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));
  return p;
}

ffi::Error CheckEncodeAttrs(const char* name, int32_t fmt, int64_t g, int64_t n_groups, int64_t last_count,
                            int32_t has_a) {
  if (!ValidFmt(fmt)) return Invalid(name, "fmt must be 0 (e4m3) or 1 (e5m2)");
  if (!ValidGroupSize(g)) return Invalid(name, "G must be a power of 2 in [32, 512]");
  if (n_groups < 1 || last_count < 1 || last_count > g) return Invalid(name, "needs n_groups >= 1, 1 <= last_count <= G");
  if (has_a != 0 && has_a != 1) return Invalid(name, "has_a must be 0 or 1");
  return ffi::Error::Success();
}

ffi::Error CheckDecodeAttrs(const char* name, int32_t fmt, int64_t g, int32_t has_a) {
  return CheckEncodeAttrs(name, fmt, g, 1, 1, has_a);
}

// taco_encode_packed(x f32[..., n_groups * G]) -> K results u8[..., row_bytes]: message row i of x
// (row-major over its leading axes) goes to result i % K, row i / K (K = 1: one [..., row_bytes]
// result; K = P: one result per destination rank, stacked for the all-to-all without a copy).
ffi::Error EncodePackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingRets outs, int32_t fmt,
                            float lam, float fmax, float target_range, int64_t g, int64_t n_groups, int64_t last_count,
                            int32_t has_a, int32_t impl, int64_t outer) {
  const char* name = "taco_encode_packed";
  if (auto err = CheckEncodeAttrs(name, fmt, g, n_groups, last_count, has_a); err.failure()) return err;
  const Layout L{n_groups, g, has_a};
  const int64_t rb = L.row_bytes();
  const auto dims = x.dimensions();
  const int dt = DtOf(x.element_type());
  if (dt < 0) return Invalid(name, "x must be float32, bfloat16 or float16");
  // outer > 1: x is [..., outer, P, inner] and message (v, r) is x[v, :, r, :] (row-major).
  int64_t P = 1, inner = n_groups * g;
  if (outer < 1) return Invalid(name, "outer must be >= 1");
  if (outer > 1) {
    if (dims.size() < 3 || dims[dims.size() - 3] != outer || dims.back() % g != 0 || dims.back() * outer != n_groups * g)
      return Invalid(name, "with outer > 1, x must be [..., outer, P, inner] with inner % G == 0 and outer * inner == n_groups * G");
    P = dims[dims.size() - 2];
    inner = dims.back();
  } else if (dims.size() < 1 || dims.back() != n_groups * g) {
    return Invalid(name, "x's last axis must be n_groups * G");
  }
  const int64_t rows = static_cast<int64_t>(x.element_count()) / (n_groups * g);
  const int64_t K = static_cast<int64_t>(outs.size());
  if (K < 1 || rows % K != 0) return Invalid(name, "needs K >= 1 results dividing the rows of x");
  std::vector<uint8_t*> base(K);
  bool aligned = rb % 32 == 0;
  for (int64_t j = 0; j < K; ++j) {
    auto o = outs.get<ffi::Buffer<ffi::U8>>(j);
    if (o.has_error()) return Invalid(name, "results must be uint8");
    if (static_cast<int64_t>((*o)->element_count()) != rows / K * rb || (*o)->dimensions().back() != rb)
      return Invalid(name, "each result must be [..., n_groups * (G + 4 * (1 + has_a))] holding rows / K rows");
    base[j] = (*o)->typed_data();
    aligned = aligned && Aligned32(base[j]);
  }
  const EncodeParams p = MakeEncodeParams(fmt, lam, fmax, target_range, g, n_groups, last_count);
  const char* xp = static_cast<const char*>(x.untyped_data());
  const int64_t xb = DtypeBytes(dt);
  const bool stream = rows * n_groups * g >= kStreamBytes && aligned;  // streaming code stores: 32-byte aligned rows
  const int64_t m = n_groups * g, run = inner / g;  // run: groups of a message contiguous in x
  ParallelRowChunks(pool.num_threads(), rows, n_groups, GroupsPerChunk(p.g), [&](int64_t row, int64_t lb, int64_t le) {
    alignas(32) float a_tmp[kMaxChunkGroups];
    uint8_t* dst = base[row % K] + (row / K) * rb;
    if (outer == 1)
      return EncodeRowSegment(xp + (row * n_groups + lb) * g * xb, dt, dst, L, lb, le, p, impl, stream, a_tmp);
    const char* xv = xp + ((row / P) * P * m + (row % P) * inner) * xb;  // message (v, r): block b at xv + b * P * inner
    for (int64_t gi = lb; gi < le;) {
      const int64_t b = gi / run, end = std::min(le, (b + 1) * run);
      EncodeRowSegment(xv + (b * P * inner + (gi - b * run) * g) * xb, dt, dst, L, gi, end, p, impl, stream, a_tmp);
      gi = end;
    }
  });
  return ffi::Error::Success();
}

// taco_decode_packed(rows u8[..., row_bytes]) -> x f32|bf16|f16[..., n_groups * G].
ffi::Error DecodePackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> in, ffi::Result<ffi::AnyBuffer> out,
                            int32_t fmt, int64_t g, int32_t has_a, int32_t impl, int64_t outer) {
  const char* name = "taco_decode_packed";
  if (auto err = CheckDecodeAttrs(name, fmt, g, has_a); err.failure()) return err;
  if (outer < 1) return Invalid(name, "outer must be >= 1");
  const auto od = out->dimensions();
  const auto id = in.dimensions();
  // outer > 1: rows [..., P, row_bytes] -> out [..., outer, P, inner]: element (b, j) of row r's
  // message at [..., b, r, j] (inner = n_groups * G / outer, a multiple of G).
  int64_t P = 1, inner = 0, ng = 0;
  if (outer > 1) {
    if (od.size() < 3 || od[od.size() - 3] != outer || od.back() % g != 0 || od.back() == 0 || id.size() < 2 ||
        od[od.size() - 2] != id[id.size() - 2])
      return Invalid(name, "with outer > 1, rows must be [..., P, row_bytes] and the output [..., outer, P, inner], inner % G == 0");
    P = id[id.size() - 2];
    inner = od.back();
    ng = outer * inner / g;
  } else {
    if (od.size() < 1 || od.back() % g != 0 || od.back() == 0)
      return Invalid(name, "the output's last axis must be n_groups * G");
    ng = od.back() / g;
    inner = ng * g;
  }
  const Layout L{ng, g, has_a};
  if (id.size() < 1 || id.back() != L.row_bytes())
    return Invalid(name, "the packed rows' last axis must be n_groups * (G + 4 * (1 + has_a))");
  const int64_t rows = static_cast<int64_t>(in.element_count()) / L.row_bytes();
  if (static_cast<int64_t>(out->element_count()) != rows * L.ng * g)
    return Invalid(name, "output rows do not match the input's");
  const int dt = DtOf(out->element_type());
  if (dt < 0) return Invalid(name, "the output must be float32, bfloat16 or float16");
  const uint8_t* ip = in.typed_data();
  char* op = static_cast<char*>(out->untyped_data());
  const int64_t ob = DtypeBytes(dt);
  const bool stream = rows * L.ng * g * ob >= kStreamBytes && Aligned32(op);
  const int64_t m = L.ng * g, run = inner / g;  // run: groups of a message contiguous in the output
  ParallelRowChunks(pool.num_threads(), rows, L.ng, GroupsPerChunk(static_cast<int>(g)),
                    [&](int64_t row, int64_t lb, int64_t le) {
                      const uint8_t* src = ip + row * L.row_bytes();
                      if (outer == 1)
                        return DecodeRowSegment(src, L, lb, le, fmt, impl, stream, op + (row * L.ng + lb) * g * ob, dt);
                      char* ov = op + ((row / P) * P * m + (row % P) * inner) * ob;  // block b at ov + b * P * inner
                      for (int64_t gi = lb; gi < le;) {
                        const int64_t b = gi / run, end = std::min(le, (b + 1) * run);
                        DecodeRowSegment(src, L, gi, end, fmt, impl, stream, ov + (b * P * inner + (gi - b * run) * g) * ob,
                                         dt);
                        gi = end;
                      }
                    });
  return ffi::Error::Success();
}

// taco_decode_sum_packed(P ranks' rows) -> f32|bf16|f16[..., n_groups * G]: the rank-order float32
// sum of the P decoded rows, rounded to the output dtype once.
ffi::Error DecodeSumPackedImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out,
                               int32_t fmt, int64_t g, int32_t has_a, int32_t impl) {
  const char* name = "taco_decode_sum_packed";
  if (auto err = CheckDecodeAttrs(name, fmt, g, has_a); err.failure()) return err;
  const auto od = out->dimensions();
  if (od.size() < 1 || od.back() % g != 0 || od.back() == 0)
    return Invalid(name, "the output's last axis must be n_groups * G");
  const Layout L{od.back() / g, g, has_a};
  RankRows rr;
  if (auto err = GetRankRows(name, args, L, &rr); err.failure()) return err;
  if (static_cast<int64_t>(out->element_count()) != rr.outer * L.ng * g)
    return Invalid(name, "output does not match the packed rows' leading axes");
  const int dt = DtOf(out->element_type());
  if (dt < 0) return Invalid(name, "the output must be float32, bfloat16 or float16");
  char* op = static_cast<char*>(out->untyped_data());
  const int64_t ob = DtypeBytes(dt);
  ParallelRowChunks(pool.num_threads(), rr.outer, L.ng, std::max<int64_t>(1, GroupsPerChunk(static_cast<int>(g)) / rr.P),
                    [&](int64_t o, int64_t lb, int64_t le) {
                      std::vector<const uint8_t*> rows(rr.P);
                      for (int64_t r = 0; r < rr.P; ++r) rows[r] = rr.at(o, r);
                      DecodeSumRowSegment(rows.data(), rr.P, L, lb, le, fmt, impl, op + (o * L.ng + lb) * g * ob, dt);
                    });
  return ffi::Error::Success();
}

// taco_reduce_packed(P ranks' rows) -> u8[..., row_bytes]: encode_packed of the decode-sum (signal
// domain), rounded to the message dtype `round` (MsgDtype; the unfused path's cast of the sum), the
// elements past last_count of the last group zeroed first (as the unfused path slices the sum to
// the message and re-pads it with zeros).
ffi::Error ReducePackedImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::U8>> out,
                            int32_t fmt, float lam, float fmax, float target_range, int64_t g, int64_t n_groups,
                            int64_t last_count, int32_t has_a, int32_t impl, int32_t round) {
  const char* name = "taco_reduce_packed";
  if (auto err = CheckEncodeAttrs(name, fmt, g, n_groups, last_count, has_a); err.failure()) return err;
  if (round != kF32 && round != kBF16 && round != kF16) return Invalid(name, "round must be 0 (f32), 1 (bf16) or 2 (f16)");
  const Layout L{n_groups, g, has_a};
  RankRows rr;
  if (auto err = GetRankRows(name, args, L, &rr); err.failure()) return err;
  if (static_cast<int64_t>(out->element_count()) != rr.outer * L.row_bytes() || out->dimensions().back() != L.row_bytes())
    return Invalid(name, "output must be [..., row_bytes] with the packed rows' leading axes");
  const EncodeParams p = MakeEncodeParams(fmt, lam, fmax, target_range, g, n_groups, last_count);
  uint8_t* op = out->typed_data();
  ParallelRowChunks(pool.num_threads(), rr.outer, n_groups, std::max<int64_t>(1, GroupsPerChunk(p.g) / rr.P),
                    [&](int64_t o, int64_t lb, int64_t le) {
                      thread_local std::vector<float> sum;
                      const int64_t n = (le - lb) * g;
                      if (static_cast<int64_t>(sum.size()) < n) sum.resize(n);
                      std::vector<const uint8_t*> rows(rr.P);
                      for (int64_t r = 0; r < rr.P; ++r) rows[r] = rr.at(o, r);
                      float* x = sum.data();  // groups [lb, le) of the sum
                      DecodeSumRowSegment(rows.data(), rr.P, L, lb, le, fmt, impl, x);
                      if (round != kF32) {
#if TACO_X86
                        if (UseAvx2(impl)) {
                          round_through_avx(x, n, round);
                        } else
#endif
                        {
                          round_through_scalar(x, n, round);
                        }
                      }
                      if (le == n_groups && last_count < g) std::fill(x + n - g + last_count, x + n, 0.0f);
                      alignas(32) float a_tmp[kMaxChunkGroups];
                      uint8_t* row = op + o * L.row_bytes();
                      EncodeRowSegment(x, kF32, row, L, lb, le, p, impl, false, a_tmp);
                      for (int64_t gi = lb; gi < le; ++gi) {  // a NaN scale: the group is not finite
                        const float* xg = x + (gi - lb) * g;
                        if (!std::isnan(L.s(row)[gi]) || std::any_of(xg, xg + g, [](float v) { return v != v; }))
                          continue;  // finite, or NaN in it (a NaN group)
                        L.s(row)[gi] = -EncodeOverflowGroup(xg, g, fmt, target_range, L.codes(row) + gi * g);
                        if (L.has_a) L.a(row)[gi] = 1.0f;  // overflow: +-Inf and no NaN
                      }
                    });
  return ffi::Error::Success();
}

// taco_reduce_hadamard_packed(P ranks' rows) -> u8[..., n_groups * (G + 4)]: the transform-domain
// reduction (taco_reduce) of P packed rows, output in the folded layout.
ffi::Error ReduceHadamardPackedImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::U8>> out,
                                    int32_t fmt, int64_t g, int32_t has_a, float target_range, int32_t impl) {
  const char* name = "taco_reduce_hadamard_packed";
  if (auto err = CheckDecodeAttrs(name, fmt, g, has_a); err.failure()) return err;
  const auto od = out->dimensions();
  if (od.size() < 1 || od.back() % (g + 4) != 0 || od.back() == 0)
    return Invalid(name, "the output's last axis must be n_groups * (G + 4)");
  const Layout L{od.back() / (g + 4), g, has_a}, LO{od.back() / (g + 4), g, 0};
  RankRows rr;
  if (auto err = GetRankRows(name, args, L, &rr); err.failure()) return err;
  if (static_cast<int64_t>(out->element_count()) != rr.outer * LO.row_bytes())
    return Invalid(name, "output does not match the packed rows' leading axes");
  const int64_t P = rr.P;
  uint8_t* op = out->typed_data();
  std::vector<const uint8_t*> qs(rr.outer * P);
  std::vector<const float*> ss(rr.outer * P), as(rr.outer * P);
  for (int64_t o = 0; o < rr.outer; ++o) {
    for (int64_t r = 0; r < P; ++r) {
      const uint8_t* row = rr.at(o, r);
      qs[o * P + r] = L.codes(row);
      ss[o * P + r] = L.s(row);
      as[o * P + r] = L.a(row);
    }
  }
#if TACO_X86
  ReduceFn avx = UseAvx2(impl) ? ReduceAvx(fmt, static_cast<int>(g)) : nullptr;
#endif
  ParallelRowChunks(pool.num_threads(), rr.outer, L.ng, std::max<int64_t>(1, GroupsPerChunk(static_cast<int>(g)) / P),
                    [&](int64_t o, int64_t lb, int64_t le) {
                      const uint8_t* const* qp = qs.data() + o * P;
                      const float* const* sp = ss.data() + o * P;
                      const float* const* ap = has_a ? as.data() + o * P : nullptr;
                      uint8_t* row = op + o * LO.row_bytes();
#if TACO_X86
                      if (avx != nullptr) return avx(qp, sp, ap, P, target_range, LO.codes(row), LO.s(row), lb, le);
#endif
                      for (int64_t gi = lb; gi < le; ++gi)
                        reduce_group_scalar(qp, sp, ap, P, gi, static_cast<int>(g), fmt, target_range, LO.codes(row),
                                            LO.s(row));
                    });
  return ffi::Error::Success();
}

// clamp > 0: fp8(clamp(x, -clamp, clamp)) through the codec's quantizer (x must not be NaN).
ffi::Error CastImpl(ffi::ThreadPool /*pool*/, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, float clamp, int32_t impl) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (static_cast<int64_t>(out->element_count()) != n) return ffi::Error::InvalidArgument("taco_fp8_cast: size mismatch");
  const bool avx = UseAvx2(impl);
  const int in_dt = DtOf(in.element_type()), out_dt = DtOf(out->element_type());
  if (in_dt == kF32 && (out_dt == kBF16 || out_dt == kF16)) {  // the decoder's store
    const float* x = static_cast<const float*>(in.untyped_data());
#if TACO_X86
    if (avx) return convert_from_f32_avx(x, out->untyped_data(), n, out_dt, clamp > 0), ffi::Error::Success();
#endif
    uint16_t* h = static_cast<uint16_t*>(out->untyped_data());
    for (int64_t i = 0; i < n; ++i) h[i] = f32_to_narrow(x[i], out_dt, clamp > 0);
    return ffi::Error::Success();
  }
  if ((in_dt == kBF16 || in_dt == kF16) && out_dt == kF32) {  // the encoder's load
    float* x = static_cast<float*>(out->untyped_data());
#if TACO_X86
    if (avx) return convert_to_f32_avx(in.untyped_data(), x, n, in_dt), ffi::Error::Success();
#endif
    const uint16_t* h = static_cast<const uint16_t*>(in.untyped_data());
    for (int64_t i = 0; i < n; ++i) x[i] = narrow_to_f32(h[i], in_dt);
    return ffi::Error::Success();
  }
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
    return ffi::Error::InvalidArgument("taco_fp8_cast: expects f32 -> fp8 / bf16 / f16 or fp8 / bf16 / f16 -> f32");
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

// Packed wire rows (the compressed collectives' fused path; CPU only).
#define TACO_ENCODE_PACKED_ATTRS(B)                                                                  \
  B.Attr<int32_t>("fmt").Attr<float>("lam").Attr<float>("fmax").Attr<float>("target_range")         \
      .Attr<int64_t>("g").Attr<int64_t>("n_groups").Attr<int64_t>("last_count").Attr<int32_t>("has_a") \
      .Attr<int32_t>("impl")
XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoEncodePackedCpu, taco::EncodePackedImpl,
                              TACO_ENCODE_PACKED_ATTRS(ffi::Ffi::Bind()
                                                           .Ctx<ffi::ThreadPool>()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .RemainingRets())
                                  .Attr<int64_t>("outer"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoReducePackedCpu, taco::ReducePackedImpl,
                              TACO_ENCODE_PACKED_ATTRS(ffi::Ffi::Bind()
                                                           .Ctx<ffi::ThreadPool>()
                                                           .RemainingArgs()
                                                           .Ret<ffi::Buffer<ffi::U8>>())
                                  .Attr<int32_t>("round"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoDecodePackedCpu, taco::DecodePackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("g")
                                  .Attr<int32_t>("has_a")
                                  .Attr<int32_t>("impl")
                                  .Attr<int64_t>("outer"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoDecodeSumPackedCpu, taco::DecodeSumPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("g")
                                  .Attr<int32_t>("has_a")
                                  .Attr<int32_t>("impl"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoReduceHadamardPackedCpu, taco::ReduceHadamardPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("g")
                                  .Attr<int32_t>("has_a")
                                  .Attr<float>("target_range")
                                  .Attr<int32_t>("impl"));

// Plain C entry points (ctypes) for quick checks without JAX.
extern "C" {
int taco_cpu_has_avx2() { return taco::HaveAvx2() ? 1 : 0; }
// The highest kernel level (`impl`) this CPU runs: 1 scalar, 2 AVX2, 3 AVX-512.
int taco_cpu_kernel_level() { return taco::HaveAvx512() ? 3 : taco::HaveAvx2() ? 2 : 1; }
int taco_ffi_abi() { return TACO_FFI_ABI; }
}
