/* avx2.c — AVX2 + FMA + F16C matmul (8 lanes; a 32-weight block is 4 vectors). */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "quant.h"

#define VEC __m256
#define VPB 4
#define MM_FN clb_mm_rows_avx2
#define vzero() _mm256_setzero_ps()
#define vset1(f) _mm256_set1_ps(f)
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define h2f(h) _cvtsh_ss(h)
#define vadd(a, b) _mm256_add_ps(a, b)

static inline float vhsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 weights of one block -> w[0..3] (elements 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void
dec_block(int fmt, const uint8_t *blk, __m256 d, __m256 m, __m256 w[4]) {
    switch (fmt) {
    case CLB_QTYPE_Q4_0:
    case CLB_QTYPE_Q4_1: {
        /* qs[j]: low nibble = element j, high nibble = element j + 16 */
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (fmt == CLB_QTYPE_Q4_0 ? 2 : 4)));
        const __m128i m4 = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
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
