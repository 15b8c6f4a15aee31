/* kquants.h — the storage types added for issue 15: GGML's Q5_0, Q5_1, Q2_K..Q6_K, MXFP4,
 * IQ4_NL, IQ4_XS blocks (byte for byte, ggml-common.h's layouts) and colibri's FP8 rows; plus the
 * "unpacked row" every kernel of these types works on. Not part of the cffi cdef.
 *
 * Unpacked row (all GGML types here): weight j = s[j / 16] * q[j] + m[j / 16], q int8 with
 * |q| <= 127, s and m f32 per 16 weights. Every block type above is exactly this form (the
 * 32-weight types repeat their scale for both halves), and computing s * q + m in f32 without
 * FMA gives gguf's dequantized values bit for bit (m = 0 for the symmetric types, and for the
 * types with a min m = -(dmin * min) so s * q + m = d * q - dmin * min as ggml rounds it).
 * The kernels: f32 activations dequantize the row into f32 and dot; Q8_0 activations take the
 * exact int8 dot per 16 weights (ggml-cpu's K-quant dots, on Q8_0 activations instead of Q8_K).
 *
 * FP8 row (CLB_QTYPE_FP8, not a GGML type): ceil(cols / 128) f32 scales, then cols e4m3fn bytes;
 * weight j = e4m3(byte j) * scale[j / 128]. A tensor's 128x128 block scales (DeepSeek-V3's
 * weight_scale_inv) are stored once per row: rows 128 b .. 128 b + 127 repeat block row b's
 * scales, so every row is self-contained (row chunks, single-row lookups) at 4 bytes per 128
 * weights; ragged edge blocks just have fewer rows / columns.
 *
 * Element order inside the GGML blocks is ggml's dequantize_row_* order (see the unpackers).
 */
#ifndef CLB_KQUANTS_H
#define CLB_KQUANTS_H

#include <stdint.h>
#include <string.h>

#include "quant.h"

#define QK_K 256
#define CLB_FP8_BLOCK 128

typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;            /* 22 */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1;         /* 24 */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } block_q2_K; /* 84 */
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } block_q3_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_K; /* 144 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } block_q6_K;
typedef struct { uint8_t e; uint8_t qs[16]; } block_mxfp4;                           /* 17 */
typedef struct { uint16_t d; uint8_t qs[16]; } block_iq4_nl;                         /* 18 */
typedef struct { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } block_iq4_xs;

_Static_assert(sizeof(block_q5_0) == 22, "Q5_0");
_Static_assert(sizeof(block_q5_1) == 24, "Q5_1");
_Static_assert(sizeof(block_q2_K) == 84, "Q2_K");
_Static_assert(sizeof(block_q3_K) == 110, "Q3_K");
_Static_assert(sizeof(block_q4_K) == 144, "Q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "Q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "Q6_K");
_Static_assert(sizeof(block_mxfp4) == 17, "MXFP4");
_Static_assert(sizeof(block_iq4_nl) == 18, "IQ4_NL");
_Static_assert(sizeof(block_iq4_xs) == 136, "IQ4_XS");

/* 1 for the types of this file (including FP8), else 0. */
static inline int clb_is_kq(int qtype) {
    switch (qtype) {
    case CLB_QTYPE_Q5_0: case CLB_QTYPE_Q5_1: case CLB_QTYPE_Q2_K: case CLB_QTYPE_Q3_K:
    case CLB_QTYPE_Q4_K: case CLB_QTYPE_Q5_K: case CLB_QTYPE_Q6_K: case CLB_QTYPE_MXFP4:
    case CLB_QTYPE_IQ4_NL: case CLB_QTYPE_IQ4_XS: case CLB_QTYPE_FP8: return 1;
    default: return 0;
    }
}

/* Whether the type's unpacked m is nonzero (a min / offset per sub-block). */
static inline int clb_kq_has_min(int qtype) {
    return qtype == CLB_QTYPE_Q5_1 || qtype == CLB_QTYPE_Q2_K || qtype == CLB_QTYPE_Q4_K ||
           qtype == CLB_QTYPE_Q5_K;
}

/* (weights, bytes) of one block; FP8 reports (1, 1) (rows have a scale prefix, see
 * clb_kq_row_nbytes). CLB_EQTYPE for other types. */
static inline int clb_kq_block(int qtype, int64_t *e, int64_t *b) {
    switch (qtype) {
    case CLB_QTYPE_Q5_0: *e = 32; *b = 22; break;
    case CLB_QTYPE_Q5_1: *e = 32; *b = 24; break;
    case CLB_QTYPE_Q2_K: *e = QK_K; *b = 84; break;
    case CLB_QTYPE_Q3_K: *e = QK_K; *b = 110; break;
    case CLB_QTYPE_Q4_K: *e = QK_K; *b = 144; break;
    case CLB_QTYPE_Q5_K: *e = QK_K; *b = 176; break;
    case CLB_QTYPE_Q6_K: *e = QK_K; *b = 210; break;
    case CLB_QTYPE_MXFP4: *e = 32; *b = 17; break;
    case CLB_QTYPE_IQ4_NL: *e = 32; *b = 18; break;
    case CLB_QTYPE_IQ4_XS: *e = QK_K; *b = 136; break;
    case CLB_QTYPE_FP8: *e = 1; *b = 1; break;
    default: return CLB_EQTYPE;
    }
    return CLB_OK;
}

static inline int64_t clb_fp8_nscales(int64_t cols) { return (cols + CLB_FP8_BLOCK - 1) / CLB_FP8_BLOCK; }

/* Bytes of a row of `cols` weights; CLB_EBLOCK if cols is not a multiple of the block. */
static inline int64_t clb_kq_row_nbytes(int qtype, int64_t cols) {
    int64_t e, b;
    if (clb_kq_block(qtype, &e, &b)) return CLB_EQTYPE;
    if (cols < 0) return CLB_EINVAL;
    if (qtype == CLB_QTYPE_FP8) return 4 * clb_fp8_nscales(cols) + cols;
    if (cols % e) return CLB_EBLOCK;
    return cols / e * b;
}

static const int8_t clb_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};
static const int8_t clb_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml_e8m0_to_fp32_half: 2^(e - 128) as f32 (e < 2: a subnormal). */
static inline float clb_e8m0_half(uint8_t e) {
    return clb_bits_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* float8_e4m3fn -> f32, exact: bias 7, no infinities, S.1111.111 = NaN. */
static inline float clb_e4m3_to_f32(uint8_t v) {
    const uint32_t sign = (uint32_t)(v & 0x80) << 24, exp = (v >> 3) & 15, man = v & 7;
    if (exp == 15 && man == 7) return clb_bits_f32(sign | 0x7fc00000u);
    if (exp == 0) {
        float f = (float)man * 0x1p-9f;
        return sign ? -f : f;
    }
    return clb_bits_f32(sign | ((exp + 120) << 23) | (man << 20));
}

/* Q4_K / Q5_K: 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void clb_k4_scale_min(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* One block -> q [block weights], s, m [block weights / 16]. Scalar C written so that the
 * SIMD files (which include this header under their target pragma) auto-vectorize it. */
static inline __attribute__((always_inline)) void
clb_kq_unpack_block(int qtype, const uint8_t *blk, int8_t *restrict q, float *restrict s,
                    float *restrict m) {
    switch (qtype) {
    case CLB_QTYPE_Q5_0:
    case CLB_QTYPE_Q5_1: {
        const int off = qtype == CLB_QTYPE_Q5_0 ? 2 : 4, bias = qtype == CLB_QTYPE_Q5_0 ? 16 : 0;
        uint32_t qh;
        memcpy(&qh, blk + off, 4);
        const uint8_t *qs = blk + off + 4;
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
            q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
        }
        s[0] = s[1] = clb_f16_to_f32(clb_load_u16(blk));
        m[0] = m[1] = qtype == CLB_QTYPE_Q5_1 ? clb_f16_to_f32(clb_load_u16(blk + 2)) : 0.0f;
        break;
    }
    case CLB_QTYPE_IQ4_NL:
    case CLB_QTYPE_MXFP4: {
        const int8_t *kv = qtype == CLB_QTYPE_IQ4_NL ? clb_kvalues_iq4nl : clb_kvalues_mxfp4;
        const uint8_t *qs = blk + (qtype == CLB_QTYPE_IQ4_NL ? 2 : 1);
        for (int j = 0; j < 16; j++) {
            q[j] = kv[qs[j] & 15];
            q[j + 16] = kv[qs[j] >> 4];
        }
        s[0] = s[1] = qtype == CLB_QTYPE_IQ4_NL ? clb_f16_to_f32(clb_load_u16(blk))
                                                : clb_e8m0_half(blk[0]);
        m[0] = m[1] = 0.0f;
        break;
    }
    case CLB_QTYPE_Q2_K: {
        const block_q2_K *b = (const void *)blk;
        const float d = clb_f16_to_f32(clb_load_u16(&b->d));
        const float dmin = clb_f16_to_f32(clb_load_u16(&b->dmin));
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    q[128 * n + 32 * j + l] = (int8_t)((b->qs[32 * n + l] >> (2 * j)) & 3);
        for (int k = 0; k < 16; k++) {
            s[k] = d * (float)(b->scales[k] & 15);
            m[k] = -(dmin * (float)(b->scales[k] >> 4));
        }
        break;
    }
    case CLB_QTYPE_Q3_K: {
        const block_q3_K *b = (const void *)blk;
        const float d = clb_f16_to_f32(clb_load_u16(&b->d));
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    q[128 * n + 32 * j + l] =
                        (int8_t)(((b->qs[32 * n + l] >> (2 * j)) & 3) -
                                 (((b->hmask[l] >> (4 * n + j)) & 1) ? 0 : 4));
        for (int k = 0; k < 16; k++) {
            const int lo = k < 8 ? b->scales[k] & 15 : b->scales[k - 8] >> 4;
            const int hi = (b->scales[8 + k % 4] >> (2 * (k / 4))) & 3;
            s[k] = d * (float)((lo | (hi << 4)) - 32);
            m[k] = 0.0f;
        }
        break;
    }
    case CLB_QTYPE_Q4_K:
    case CLB_QTYPE_Q5_K: {
        const block_q4_K *b4 = (const void *)blk;
        const block_q5_K *b5 = (const void *)blk;
        const int five = qtype == CLB_QTYPE_Q5_K;
        const float d = clb_f16_to_f32(clb_load_u16(blk)), dmin = clb_f16_to_f32(clb_load_u16(blk + 2));
        const uint8_t *qs = five ? b5->qs : b4->qs;
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
                if (five) {
                    lo |= ((b5->qh[l] >> (2 * j)) & 1) << 4;
                    hi |= ((b5->qh[l] >> (2 * j + 1)) & 1) << 4;
                }
                q[64 * j + l] = (int8_t)lo;
                q[64 * j + 32 + l] = (int8_t)hi;
            }
        const uint8_t *sc = blk + 4;
        for (int j = 0; j < 8; j++) {
            uint8_t a, mn;
            clb_k4_scale_min(j, sc, &a, &mn);
            s[2 * j] = s[2 * j + 1] = d * (float)a;
            m[2 * j] = m[2 * j + 1] = -(dmin * (float)mn);
        }
        break;
    }
    case CLB_QTYPE_Q6_K: {
        const block_q6_K *b = (const void *)blk;
        const float d = clb_f16_to_f32(clb_load_u16(&b->d));
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b->ql + 64 * n, *qh = b->qh + 32 * n;
            int8_t *o = q + 128 * n;
            for (int l = 0; l < 32; l++) {
                o[l] = (int8_t)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                o[l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int k = 0; k < 16; k++) {
            s[k] = d * (float)b->scales[k];
            m[k] = 0.0f;
        }
        break;
    }
    case CLB_QTYPE_IQ4_XS: {
        const block_iq4_xs *b = (const void *)blk;
        const float d = clb_f16_to_f32(clb_load_u16(&b->d));
        const uint16_t sh = clb_load_u16(&b->scales_h);
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((b->scales_l[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
            s[2 * ib] = s[2 * ib + 1] = d * (float)(ls - 32);
            m[2 * ib] = m[2 * ib + 1] = 0.0f;
            for (int j = 0; j < 16; j++) {
                q[32 * ib + j] = clb_kvalues_iq4nl[b->qs[16 * ib + j] & 15];
                q[32 * ib + 16 + j] = clb_kvalues_iq4nl[b->qs[16 * ib + j] >> 4];
            }
        }
        break;
    }
    default: break;
    }
}

/* A whole GGML-type row of `cols` weights -> q [cols], s, m [cols / 16]. */
static inline __attribute__((always_inline)) void
clb_kq_unpack_row(int qtype, const uint8_t *row, int64_t cols, int8_t *q, float *s, float *m) {
    int64_t e = 32, bb = 1;
    clb_kq_block(qtype, &e, &bb);
    for (int64_t b = 0; b < cols / e; b++)
        clb_kq_unpack_block(qtype, row + b * bb, q + b * e, s + b * (e / 16), m + b * (e / 16));
}

/* An FP8 row -> f32 weights (e4m3 value times its block scale). */
static inline void clb_fp8_row_f32(const uint8_t *row, int64_t cols, float *out) {
    const int64_t ns = clb_fp8_nscales(cols);
    const uint8_t *v = row + 4 * ns;
    for (int64_t b = 0; b < ns; b++) {
        float sc;
        memcpy(&sc, row + 4 * b, 4);
        const int64_t c1 = (b + 1) * CLB_FP8_BLOCK < cols ? (b + 1) * CLB_FP8_BLOCK : cols;
        for (int64_t c = b * CLB_FP8_BLOCK; c < c1; c++) out[c] = clb_e4m3_to_f32(v[c]) * sc;
    }
}

/* On a scratch allocation failure the rows kernels write NaN to their outputs (never leave
 * stale values that look like results). */
static inline void clb_kq_fail_rows(float *y, int64_t ldy, int64_t n, int64_t r0, int64_t r1) {
    const float nan = __builtin_nanf("");
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = r0; r < r1; r++) y[i * ldy + r] = nan;
}

/* Rows kernels of these types (kquants.c scalar twins, arch/kquants_*.c); the signatures of
 * clb_mm_rows_fn / clb_mmq_rows_fn (quant.h), row_nbytes = the type's row size. */
void clb_kq_mm_rows_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                        const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0,
                        int64_t r1, const float *bias, const float *scale, int accumulate);
void clb_kq_mm_rows_avx2(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                         const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0,
                         int64_t r1, const float *bias, const float *scale, int accumulate);
void clb_kq_mm_rows_avx512(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                           const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0,
                           int64_t r1, const float *bias, const float *scale, int accumulate);
CLB_DECLARE_MMQ(clb_kq_mmq_rows_ref)
CLB_DECLARE_MMQ(clb_kq_mmq_rows_avx2)
CLB_DECLARE_MMQ(clb_kq_mmq_rows_avx512)
/* MXFP4 on Q8_0 (arch/matmul_mxfp4.inc): tiled GEMM for batches, 8 rows in the lanes for one x
 * row; the bits of clb_kq_mmq_rows_ref's MXFP4 at every batch size and ISA level. */
CLB_DECLARE_MMQ(clb_mxfp4_rows_avx2)
CLB_DECLARE_MMQ(clb_mxfp4_rows_avx512)
CLB_DECLARE_MMQ(clb_mxfp4_rows_avx512vnni)
clb_mmq_rows_fn clb_mxfp4_rows_for_isa(void);

/* The rows kernels for `qtype` at the current ISA level: these types' (above) or quant.h's. */
clb_mm_rows_fn clb_mm_rows_for(int qtype);
clb_mmq_rows_fn clb_mmq_rows_for(int qtype);

/* kquants.c: quantize / dequantize `nrows` rows of these types (validated arguments). */
int clb_kq_quantize(int qtype, void *out, const float *x, int64_t nrows, int64_t ncols);
int clb_kq_dequantize(int qtype, float *out, const void *data, int64_t nrows, int64_t ncols);

#endif
