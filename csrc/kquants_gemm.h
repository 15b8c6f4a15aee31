/* kquants_gemm.h — the K-quant GEMM on Q8_K activations (kquants_gemm.c, arch/kquants_gemm.inc):
 * ggml's block_q8_K, its quantizer, the integer form of a Q4_K / Q5_K / Q6_K block and the one
 * computation every path follows. Internal; the API is in colibri.h.
 *
 * Q8_K (ggml-common.h block_q8_K): per 256 values f32 d, int8 qs[256] (|q| <= 127), int16
 * bsums[16] (sums of qs per 16); value = d * q. Quantized as ggml's quantize_row_q8_K_ref.
 *
 * Weights in integer form (ggml's vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K):
 *   Q4_K / Q5_K: lev[256] unsigned (0..15 / 0..31), sc[8], mn[8] 6-bit per 32 weights, f16 d,
 *     dmin: w = d sc lev - dmin mn. Per block b of x row i:
 *       sumi = sum_j sc_j sum_{l<32} lev[32 j + l] q[32 j + l]       (exact int32)
 *       summ = sum_j mn_j (bsums[2 j] + bsums[2 j + 1])             (exact int32)
 *   Q6_K: lev[256] unsigned 0..63 (the weight level is lev - 32), int8 sc[16] per 16, f16 d:
 *       sumi = sum_k sc_k (sum_{l<16} lev[16 k + l] q[16 k + l] - 32 bsums[k]),  summ = 0.
 * The one computation (every ISA, tile and batch size; so a row's result never depends on how
 * many x rows share the call: batch invariance):
 *       acc = 0; for each block b in order:
 *           acc = fma((float)sumi, d_w * d_x, acc);  acc = fma(-(float)summ, dmin_w * d_x, acc)
 *       then + bias[r], * scale[i], + y (if accumulate), each rounded on its own.
 */
#ifndef CLB_KQUANTS_GEMM_H
#define CLB_KQUANTS_GEMM_H
#include <stdint.h>
#include <string.h>

#include "kquants.h"

#define KQG_XB 292 /* bytes of a Q8_K block: f32 d, 256 int8, 16 int16 */

static inline int kqg_supported(int qtype) {
    return qtype == CLB_QTYPE_Q4_K || qtype == CLB_QTYPE_Q5_K || qtype == CLB_QTYPE_Q6_K;
}

/* One Q4_K / Q5_K / Q6_K block -> levels (unsigned), sub-block scales (8 or 16) and mins (8,
 * Q4_K / Q5_K), d and dmin (0 for Q6_K). Scalar C that the SIMD files auto-vectorize. */
static inline __attribute__((always_inline)) void
kqg_unpack(int qtype, const uint8_t *blk, uint8_t *restrict lev, int16_t *restrict sc,
           int16_t *restrict mn, float *d, float *dmin) {
    if (qtype == CLB_QTYPE_Q6_K) {
        const block_q6_K *b = (const void *)blk;
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b->ql + 64 * n, *qh = b->qh + 32 * n;
            uint8_t *o = lev + 128 * n;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        for (int k = 0; k < 16; k++) sc[k] = b->scales[k];
        *d = clb_f16_to_f32(clb_load_u16(&b->d));
        *dmin = 0.0f;
        return;
    }
    const int five = qtype == CLB_QTYPE_Q5_K;
    const block_q4_K *b4 = (const void *)blk;
    const block_q5_K *b5 = (const void *)blk;
    const uint8_t *qs = five ? b5->qs : b4->qs;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
            if (five) {
                lo |= ((b5->qh[l] >> (2 * j)) & 1) << 4;
                hi |= ((b5->qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            lev[64 * j + l] = (uint8_t)lo;
            lev[64 * j + 32 + l] = (uint8_t)hi;
        }
    for (int j = 0; j < 8; j++) {
        uint8_t a, m;
        clb_k4_scale_min(j, blk + 4, &a, &m);
        sc[j] = a;
        mn[j] = m;
    }
    *d = clb_f16_to_f32(clb_load_u16(blk));
    *dmin = clb_f16_to_f32(clb_load_u16(blk + 2));
}

/* ggml's nearest_int: round half to even for |v| < 2^22 (the float unit rounds). */
static inline int kqg_nearest_int(float v) {
    const float f = v + 12582912.f;
    int32_t i;
    memcpy(&i, &f, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* Row-range GEMM kernels: y[i ldy + r] for x rows i < n (Q8_K rows at xq + i ldxq), weight rows
 * [r0, r1) (row r at w + r row_nbytes), with bias / scale / accumulate as clb_mm_rows_fn. */
#define KQG_DECLARE(name)                                                                       \
    void name(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,           \
              const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0, int64_t r1, \
              const float *bias, const float *scale, int accumulate);
KQG_DECLARE(clb_kqg_rows_ref)
KQG_DECLARE(clb_kqg_rows_avx2)
KQG_DECLARE(clb_kqg_rows_avx512)
KQG_DECLARE(clb_kqg_rows_avx512vnni) /* 16-row vpdpbusd tiles for batches */

#endif
