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

#include "matmul_simd.inc"

#define MMQ_FN clb_mmq_rows_avx512
#define MMQ_QUANT_FN clb_quantize_q8_0_avx512
#include "matmul_q8.inc"
#define MMQ_MX_FN clb_mxfp4_rows_avx512
#include "matmul_mxfp4.inc"

#define MLA_XW_FN clb_mla_xw_avx512
#define vstore(p, v) _mm512_storeu_ps(p, v)
#include "mla_simd.inc"
