"""The @triton.jit kernels of `taco_jax.kernels.triton_codec` (imported on first use: needs triton).

Kept in their own module so that Triton's interpreter (`TRITON_INTERPRET=1`), which resolves a
kernel's helpers in its module's globals, runs them as the GPU does."""

import triton
import triton.language as tl


@triton.jit
def _wht(x, B: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr):
    """Unnormalised Sylvester-order WHT of each row of x [B, G] f32: stage j pairs the indices
    differing in bit j (lo: bit clear, hi: bit set) and writes lo + hi, lo - hi in place."""
    for j in tl.static_range(LOG_G):
        x4 = tl.permute(tl.reshape(x, (B, G // (2 << j), 2, 1 << j)), (0, 1, 3, 2))
        lo, hi = tl.split(x4)
        x = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2)), (B, G))
    return x


@triton.jit
def _decode_rows(codes_ptr, s_ptr, a_ptr, rows, cols, rmask, B: tl.constexpr, G: tl.constexpr,
                 LOG_G: tl.constexpr, HAS_A: tl.constexpr, SQRT_G: tl.constexpr, EPS: tl.constexpr):
    """x' = WHT(fp8(q) s) / sqrt(G) / max(a, EPS) of rows [B] (f32 [B, G]), as WHT(q k) with one
    factor k = s / sqrt(G) / max(a, EPS) per group (the transform is linear)."""
    offs = rows.to(tl.int64)[:, None] * G + cols[None, :]
    q = tl.load(codes_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows, mask=rmask, other=1.0)
    k = tl.div_rn(s, tl.full((B,), SQRT_G, tl.float32))  # s / sqrt(G) / max(a, EPS), once per group
    if HAS_A:
        den = tl.maximum(tl.load(a_ptr + rows, mask=rmask, other=1.0), EPS, propagate_nan=tl.PropagateNan.ALL)
        k = tl.div_rn(k, den)
    x = _wht(q * k[:, None], B, G, LOG_G)
    return x


@triton.jit
def _store_out(out_ptr, x, rows, cols, rmask, G: tl.constexpr, CLIP: tl.constexpr):
    """x f32 [B, G] clipped to +-CLIP (0: no clip; NaN stays NaN) and stored in out's dtype (RNE)."""
    if CLIP > 0:
        x = tl.minimum(tl.maximum(x, -CLIP, propagate_nan=tl.PropagateNan.ALL), CLIP, propagate_nan=tl.PropagateNan.ALL)
    offs = rows.to(tl.int64)[:, None] * G + cols[None, :]
    if out_ptr.dtype.element_ty == tl.float32:
        tl.store(out_ptr + offs, x, mask=rmask[:, None])
    else:
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rmask[:, None])


@triton.jit
def encode_kernel(
    x_ptr, codes_ptr, s_ptr, a_ptr,
    N: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr, BLOCK: tl.constexpr, N_GROUPS: tl.constexpr,
    LAST_COUNT: tl.constexpr, LAM: tl.constexpr, FMAX: tl.constexpr, R: tl.constexpr, SQRT_G: tl.constexpr,
    E4M3: tl.constexpr, CLAMP: tl.constexpr, EPS: tl.constexpr, A_MIN: tl.constexpr, A_MAX: tl.constexpr,
    S_MAX: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < N
    cols = tl.arange(0, G)
    offs = rows.to(tl.int64)[:, None] * G + cols[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    # 1-2. mean square over the real elements, adaptive scale (NaN in -> NaN a)
    count = tl.where(rows % N_GROUPS == N_GROUPS - 1, LAST_COUNT, G).to(tl.float32)
    m = tl.div_rn(tl.sum(x * x, axis=1), count)
    v = tl.maximum(m + LAM, EPS, propagate_nan=tl.PropagateNan.ALL)
    a = tl.div_rn(tl.full((BLOCK,), FMAX, tl.float32), tl.sqrt_rn(v))
    a = tl.minimum(tl.maximum(a, A_MIN, propagate_nan=tl.PropagateNan.ALL), A_MAX, propagate_nan=tl.PropagateNan.ALL)
    # 3. t = WHT(a x), once, in registers; y = t / sqrt(G) is never formed: max|y| = max|t| / sqrt(G)
    t = _wht(x * a[:, None], BLOCK, G, LOG_G)
    amax_t = tl.max(tl.abs(t), axis=1)
    amax = tl.div_rn(amax_t, tl.full((BLOCK,), SQRT_G, tl.float32))
    # 4. quantization scale; a group holding NaN/Inf gets s = NaN: its sum of squares is NaN or its t is
    # not finite (a finite group's |a x| <= max(A_MIN * FLT_MAX, FMAX * sqrt(G)): t is finite for G <= 512)
    s = tl.div_rn(tl.maximum(amax, EPS), tl.full((BLOCK,), R, tl.float32))
    s = tl.minimum(tl.maximum(s, EPS), S_MAX)
    s = tl.where((m == m) & (amax_t < float("inf")), s, float("nan"))
    # 5. codes q = y / s = t * (1 / (sqrt(G) s)) (one factor per group), RNE; clamped to +-R, which
    # the conversion's saturation to the format's largest finite value does when R is that value
    k = tl.div_rn(tl.full((BLOCK,), 1.0, tl.float32), s * SQRT_G)
    q = t * k[:, None]
    if CLAMP:
        q = tl.minimum(tl.maximum(q, -R, propagate_nan=tl.PropagateNan.ALL), R, propagate_nan=tl.PropagateNan.ALL)
    if E4M3:
        qc = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        qc = q.to(tl.float8e5, fp_downcast_rounding="rtne")
    tl.store(codes_ptr + offs, qc, mask=rmask[:, None])
    tl.store(s_ptr + rows, s, mask=rmask)
    tl.store(a_ptr + rows, a, mask=rmask)


@triton.jit
def decode_kernel(
    codes_ptr, s_ptr, a_ptr, out_ptr,
    N: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr, BLOCK: tl.constexpr, HAS_A: tl.constexpr,
    SQRT_G: tl.constexpr, EPS: tl.constexpr, CLIP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < N
    cols = tl.arange(0, G)
    x = _decode_rows(codes_ptr, s_ptr, a_ptr, rows, cols, rmask, BLOCK, G, LOG_G, HAS_A, SQRT_G, EPS)
    _store_out(out_ptr, x, rows, cols, rmask, G, CLIP)


@triton.jit
def decode_sum_kernel(
    codes_ptr, s_ptr, a_ptr, out_ptr,
    N: tl.constexpr, P: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr, BLOCK: tl.constexpr,
    HAS_A: tl.constexpr, SQRT_G: tl.constexpr, EPS: tl.constexpr, CLIP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < N
    cols = tl.arange(0, G)
    acc = _decode_rows(codes_ptr, s_ptr, a_ptr, rows, cols, rmask, BLOCK, G, LOG_G, HAS_A, SQRT_G, EPS)
    for p in range(1, P):  # rank order, f32
        acc += _decode_rows(codes_ptr + tl.cast(p, tl.int64) * (N * G), s_ptr + p * N, a_ptr + p * N, rows, cols,
                            rmask, BLOCK, G, LOG_G, HAS_A, SQRT_G, EPS)
    _store_out(out_ptr, acc, rows, cols, rmask, G, CLIP)
