/* avx2.c — AVX2 + FMA + F16C matmul (8 lanes; a 32-weight block is 4 vectors). */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "quant.h"
#include "kquants.h"

#define VEC __m256
#define VPB 4
#define MM_FN clb_mm_rows_avx2
#define vzero() _mm256_setzero_ps()
#define vset1(f) _mm256_set1_ps(f)
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define h2f(h) _cvtsh_ss(h)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)

static inline float vhsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Q4 nibbles -> int32 v[0..3] = elements 0-7, 8-15, 16-23, 24-31. qs[j] holds element j (low
 * nibble) and j + 16 (high); one vpshufb spreads 8 bytes to dword lanes, for both nibbles. */
static inline __attribute__((always_inline)) void q4_ints(const uint8_t *qs, __m256i v[4]) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i s0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                        4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i s1 = _mm256_add_epi32(s0, _mm256_set1_epi32(8));
    const __m256i m4 = _mm256_set1_epi32(15);
    const __m256i lo = _mm256_shuffle_epi8(b, s0), hi = _mm256_shuffle_epi8(b, s1);
    v[0] = _mm256_and_si256(lo, m4);
    v[1] = _mm256_and_si256(hi, m4);
    v[2] = _mm256_srli_epi32(lo, 4);
    v[3] = _mm256_srli_epi32(hi, 4);
}

/* Q4_0: q - 8, Q8_0: q, as floats (exact small integers). */
static inline __attribute__((always_inline)) void dec_raw(int fmt, const uint8_t *blk, __m256 w[4]) {
    if (fmt == CLB_QTYPE_Q4_0) {
        __m256i v[4];
        q4_ints(blk + 2, v);
        for (int k = 0; k < 4; k++)
            w[k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(v[k], _mm256_set1_epi32(8)));
    } else {
        for (int k = 0; k < 4; k++)
            w[k] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k))));
    }
}

/* 32 weights of one block -> w[0..3] (elements 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void
dec_block(int fmt, const uint8_t *blk, __m256 d, __m256 m, __m256 w[4]) {
    switch (fmt) {
    case CLB_QTYPE_Q4_0:
    case CLB_QTYPE_Q4_1: {
        __m256i v[4];
        q4_ints(blk + (fmt == CLB_QTYPE_Q4_0 ? 2 : 4), v);
        for (int k = 0; k < 4; k++) w[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[k]), d, m);
        break;
    }
    case CLB_QTYPE_Q8_0:
        for (int k = 0; k < 4; k++)
            w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                     _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k)))), d);
        break;
    case CLB_QTYPE_F32:
        for (int k = 0; k < 4; k++) w[k] = _mm256_loadu_ps((const float *)(const void *)blk + 8 * k);
        break;
    case CLB_QTYPE_F16:
        for (int k = 0; k < 4; k++)
            w[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * k)));
        break;
    case CLB_QTYPE_BF16:
        for (int k = 0; k < 4; k++)
            w[k] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * k))), 16));
        break;
    default: break;
    }
}

#include "matmul_simd.inc"

#define MMQ_AVX2_GEMM 1 /* the AVX2 batch GEMM (mmq_gemm2); the AVX-512 levels keep theirs */
#define MMQ_FN clb_mmq_rows_avx2
#define MMQ_QUANT_FN clb_quantize_q8_0_avx2
#include "matmul_q8.inc"
#define MMQ_MX_FN clb_mxfp4_rows_avx2
#include "matmul_mxfp4.inc"

#define MLA_XW_FN clb_mla_xw_avx2
#define vstore(p, v) _mm256_storeu_ps(p, v)
#include "mla_simd.inc"
