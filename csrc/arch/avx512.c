/* avx512.c — AVX-512 (F, BW, VL) matmul (16 lanes; a 32-weight block is 2 vectors).
 * Compiled on every x86-64 build, run only when clb_isa_detect() reports AVX-512. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "quant.h"
#include "kquants.h"

#define VEC __m512
#define VPB 2
#define MM_FN clb_mm_rows_avx512
#define vzero() _mm512_setzero_ps()
#define vset1(f) _mm512_set1_ps(f)
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define h2f(h) _cvtsh_ss(h)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vhsum(v) _mm512_reduce_add_ps(v)

/* Q4_0: q - 8, Q8_0: q, as floats (exact small integers); w[0] elements 0-15, w[1] 16-31. */
static inline __attribute__((always_inline)) void dec_raw(int fmt, const uint8_t *blk, __m512 w[2]) {
    if (fmt == CLB_QTYPE_Q4_0) {
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(qs, m4), eight);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), eight);
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    } else {
        for (int k = 0; k < 2; k++)
            w[k] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * k))));
    }
}

/* 32 weights of one block -> w[0] (elements 0-15), w[1] (16-31). */
static inline __attribute__((always_inline)) void
dec_block(int fmt, const uint8_t *blk, __m512 d, __m512 m, __m512 w[2]) {
    switch (fmt) {
    case CLB_QTYPE_Q4_0:
    case CLB_QTYPE_Q4_1: {
        /* qs[j]: low nibble = element j, high nibble = element j + 16 */
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (fmt == CLB_QTYPE_Q4_0 ? 2 : 4)));
        const __m128i m4 = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
        w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
        w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
        break;
    }
    case CLB_QTYPE_Q8_0:
        for (int k = 0; k < 2; k++)
            w[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                     _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * k)))), d);
        break;
    case CLB_QTYPE_F32:
        for (int k = 0; k < 2; k++) w[k] = _mm512_loadu_ps((const float *)(const void *)blk + 16 * k);
        break;
    case CLB_QTYPE_F16:
        for (int k = 0; k < 2; k++)
            w[k] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32 * k)));
        break;
    case CLB_QTYPE_BF16:
        for (int k = 0; k < 2; k++)
            w[k] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32 * k))), 16));
        break;
    default: break;
    }
}

/* F32 weights, cols a multiple of 32: a register tile of RX x rows by RW weight rows (at most
 * 4 x 3: 24 accumulators, the 6 weight vectors of a block held in registers, each x vector
 * loaded once for RW FMAs) instead of one weight row at a time, and the tile's dot products
 * reduced together (mm_f32_reduce16) instead of one horizontal sum each. Every (x row, weight
 * row) pair runs exactly the operations of mm_dot's F32 path (two accumulators over the
 * blocks' halves, their sum, then _mm512_reduce_add_ps's tree of pairs (i, i+8), (i, i+4),
 * (i, i+2), (i, i+1)), so the result is bit-identical to it, and a row's result depends on
 * no other row (batch invariance) whatever the tile shape. */
#define MM_F32_TILED 1
#define MM_F32_RX 4
#define MM_F32_RW 3

/* 16 vectors -> one: lane MM_F32_LANE[k] = _mm512_reduce_add_ps(v[k]), bit for bit (the
 * same tree of adds, four levels of shuffles shared by all 16). */
static const int MM_F32_LANE[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

static inline __attribute__((always_inline)) __m512 mm_f32_reduce16(const __m512 v[16]) {
    __m512 u[8], w[4], z[2];
    for (int k = 0; k < 8; k++) /* (i, i + 8): 256-bit halves */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; k++) /* (i, i + 4): 128-bit quarters */
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; k++) /* (i, i + 2) */
        z[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)), /* (i, i + 1) */
                         _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* sums[i RW + j] = dot(x row i, weight row j) for i < RX, j < RW, as mm_dot's F32 path. */
static inline __attribute__((always_inline)) void
mm_f32_tile(const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t nblk, int RX, int RW,
            __m512 sums[16]) {
    __m512 a0[MM_F32_RX][MM_F32_RW], a1[MM_F32_RX][MM_F32_RW];
    for (int i = 0; i < RX; i++)
        for (int j = 0; j < RW; j++) a0[i][j] = a1[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        __m512 w0[MM_F32_RW], w1[MM_F32_RW];
        for (int j = 0; j < RW; j++) {
            w0[j] = _mm512_loadu_ps(w + j * ldw + b * QK);
            w1[j] = _mm512_loadu_ps(w + j * ldw + b * QK + 16);
        }
        for (int i = 0; i < RX; i++) {
            const __m512 x0 = _mm512_loadu_ps(x + i * ldx + b * QK);
            for (int j = 0; j < RW; j++) a0[i][j] = _mm512_fmadd_ps(w0[j], x0, a0[i][j]);
            const __m512 x1 = _mm512_loadu_ps(x + i * ldx + b * QK + 16);
            for (int j = 0; j < RW; j++) a1[i][j] = _mm512_fmadd_ps(w1[j], x1, a1[i][j]);
        }
    }
    for (int i = 0; i < RX; i++)
        for (int j = 0; j < RW; j++) sums[i * RW + j] = _mm512_add_ps(a0[i][j], a1[i][j]);
}

static void mm_f32_tiled(float *y, int64_t ldy, const uint8_t *wb, int64_t row_nbytes,
                         const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0,
                         int64_t r1, const float *bias, const float *scale, int accumulate) {
    const float *w = (const float *)(const void *)wb;
    const int64_t ldw = row_nbytes / 4, nblk = cols / QK;
    /* weight rows per tile: ~48 KiB, a multiple of MM_F32_RW; every group of x rows passes
     * over the tile while it is in L1/L2 */
    int64_t tr = (48 << 10) / (cols * 4) / MM_F32_RW * MM_F32_RW;
    if (tr < MM_F32_RW) tr = MM_F32_RW;
    /* x rows per pass: ~256 KiB, a multiple of MM_F32_RX, so the rows the tiles pass over
     * stay in L2 (the weights are read once per pass) */
    int64_t xb = (256 << 10) / (cols * 4) / MM_F32_RX * MM_F32_RX;
    if (xb < MM_F32_RX) xb = MM_F32_RX;
    for (int64_t i0 = 0; i0 < n; i0 += xb) {
        const int64_t i1 = i0 + xb < n ? i0 + xb : n;
        for (int64_t t0 = r0; t0 < r1; t0 += tr) {
            const int64_t t1 = t0 + tr < r1 ? t0 + tr : r1;
            for (int64_t i = i0; i < i1; i += MM_F32_RX) {
                const int RX = i1 - i < MM_F32_RX ? (int)(i1 - i) : MM_F32_RX;
                for (int64_t r = t0; r < t1; r += MM_F32_RW) {
                    const int RW = t1 - r < MM_F32_RW ? (int)(t1 - r) : MM_F32_RW;
                    __m512 v[16];
                    for (int k = 0; k < 16; k++) v[k] = _mm512_setzero_ps();
                    const float *wr = w + r * ldw, *xi = x + i * ldx;
#define MM_F32_CASE(A, B) \
    case (A) * 4 + (B): mm_f32_tile(wr, ldw, xi, ldx, nblk, A, B, v); break;
                    switch (RX * 4 + RW) {
                    MM_F32_CASE(4, 3) MM_F32_CASE(4, 2) MM_F32_CASE(4, 1)
                    MM_F32_CASE(3, 3) MM_F32_CASE(3, 2) MM_F32_CASE(3, 1)
                    MM_F32_CASE(2, 3) MM_F32_CASE(2, 2) MM_F32_CASE(2, 1)
                    MM_F32_CASE(1, 3) MM_F32_CASE(1, 2) MM_F32_CASE(1, 1)
                    default: break;
                    }
#undef MM_F32_CASE
                    float s[16];
                    _mm512_storeu_ps(s, mm_f32_reduce16(v));
                    for (int a = 0; a < RX; a++)
                        for (int b = 0; b < RW; b++) {
                            const int64_t row = r + b;
                            float t = s[MM_F32_LANE[a * RW + b]];
                            t = t + (bias ? bias[row] : 0.0f);
                            if (scale) t *= scale[i + a];
                            float *yp = y + (i + a) * ldy + row;
                            *yp = accumulate ? *yp + t : t;
                        }
                }
            }
        }
    }
}

#include "matmul_simd.inc"

#define MMQ_FN clb_mmq_rows_avx512
#define MMQ_QUANT_FN clb_quantize_q8_0_avx512
#include "matmul_q8.inc"
#define MMQ_MX_FN clb_mxfp4_rows_avx512
#include "matmul_mxfp4.inc"

#define MLA_XW_FN clb_mla_xw_avx512
#define vstore(p, v) _mm512_storeu_ps(p, v)
#include "mla_simd.inc"
