// The XLA FFI signatures of the codec's three targets, shared by the CPU handlers (taco_codec_cpu.cc)
// and the CUDA ones (taco_codec_cuda.cu). Each defines taco::EncodeImpl, taco::DecodeImpl and
// taco::CastImpl taking the platform context CTX first (ffi::ThreadPool on CPU,
// ffi::PlatformStream<cudaStream_t> on CUDA), then the arguments and attributes bound here, which
// are what taco_jax/kernels/ffi_codec.py passes:
//   taco_encode(x f32|bf16|f16[..., G], ...ignored) -> (codes fp8[..., G], s f32[...], a f32[...])
//       attrs fmt (i32: 0 e4m3, 1 e5m2), lam, fmax, target_range (f32), n_groups, last_count (i64), impl (i32)
//   taco_decode(codes fp8[..., G], s f32[...], [a f32[...]]) -> x f32|bf16|f16[..., G]; attrs has_a, impl (i32)
//   taco_fp8_cast(f32 -> fp8 or fp8 -> f32) ; attrs clamp (f32), impl (i32)
// Messages are read and written in their own dtype (no convert in XLA); the library exports
// taco_ffi_abi() == TACO_FFI_ABI, which the Python wrapper checks, so a library built from older
// sources (float32 only) is named and rebuilt rather than failing inside a call.
#pragma once

#include "xla/ffi/api/ffi.h"

#define TACO_FFI_ABI 2

// Defines the exported handler symbols TacoEncode<SUFFIX>, TacoDecode<SUFFIX>, TacoFp8Cast<SUFFIX>.
#define TACO_FFI_DEFINE_HANDLERS(SUFFIX, CTX)                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoEncode##SUFFIX, taco::EncodeImpl,                 \
                                xla::ffi::Ffi::Bind()                                 \
                                    .Ctx<CTX>()                                       \
                                    .Arg<xla::ffi::AnyBuffer>()                       \
                                    .RemainingArgs()                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                       \
                                    .Ret<xla::ffi::Buffer<xla::ffi::F32>>()           \
                                    .Ret<xla::ffi::Buffer<xla::ffi::F32>>()           \
                                    .Attr<int32_t>("fmt")                             \
                                    .Attr<float>("lam")                               \
                                    .Attr<float>("fmax")                              \
                                    .Attr<float>("target_range")                      \
                                    .Attr<int64_t>("n_groups")                        \
                                    .Attr<int64_t>("last_count")                      \
                                    .Attr<int32_t>("impl"));                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoDecode##SUFFIX, taco::DecodeImpl,                 \
                                xla::ffi::Ffi::Bind()                                 \
                                    .Ctx<CTX>()                                       \
                                    .Arg<xla::ffi::AnyBuffer>()                       \
                                    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()           \
                                    .RemainingArgs()                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                       \
                                    .Attr<int32_t>("has_a")                           \
                                    .Attr<int32_t>("impl"));                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoFp8Cast##SUFFIX, taco::CastImpl,                  \
                                xla::ffi::Ffi::Bind()                                 \
                                    .Ctx<CTX>()                                       \
                                    .Arg<xla::ffi::AnyBuffer>()                       \
                                    .Ret<xla::ffi::AnyBuffer>()                       \
                                    .Attr<float>("clamp")                             \
                                    .Attr<int32_t>("impl"))
