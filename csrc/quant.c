/* quant.c — GGML block formats: row sizes, quantize, dequantize (scalar; not a hot path).
 *
 * Bit-exact with gguf-py's gguf.quants (the oracle in tests): every step is done in float32
 * in the same order, with no FMA contraction (pragma below), the f16 scale rounded to nearest
 * even, and float->int conversions that behave like numpy's astype on x86-64.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "pool.h"
#include "quant.h"
#include "kquants.h"

/* Below this many elements quantize/dequantize stay on the calling thread; above, threads
 * take chunks of QUANT_CHUNK elements (fixed, so the bytes never depend on the thread count). */
#define QUANT_PAR_MIN (1 << 20)
#define QUANT_CHUNK (1 << 18)

/* One quantize or dequantize call: units are blocks, or elements for F16/BF16. */
struct quant_job {
    int qtype;
    void *out;
    const void *in;
    int64_t nunits, per_chunk, block_nbytes;
};

/* Threads for n elements: the default above QUANT_PAR_MIN, else 1. Chunks: see QUANT_CHUNK. */
static void quant_run(struct quant_job *j, int64_t n, clb_chunk_fn fn) {
    const int per_elem = j->qtype == CLB_QTYPE_F16 || j->qtype == CLB_QTYPE_BF16;
    j->per_chunk = per_elem ? QUANT_CHUNK : QUANT_CHUNK / QK;
    clb_parallel_for((j->nunits + j->per_chunk - 1) / j->per_chunk, fn, j,
                     n >= QUANT_PAR_MIN ? 0 : 1);
}

int clb_qtype_block(int qtype, int64_t *block_elems, int64_t *block_bytes) {
    int64_t e = QK, b;
    switch (qtype) {
    case CLB_QTYPE_F32: e = 1; b = 4; break;
    case CLB_QTYPE_F16: case CLB_QTYPE_BF16: e = 1; b = 2; break;
    case CLB_QTYPE_Q4_0: b = sizeof(block_q4_0); break;
    case CLB_QTYPE_Q4_1: b = sizeof(block_q4_1); break;
    case CLB_QTYPE_Q8_0: b = sizeof(block_q8_0); break;
    default: return CLB_EQTYPE;
    }
    *block_elems = e;
    *block_bytes = b;
    return CLB_OK;
}

int64_t clb_row_nbytes(int qtype, int64_t ncols) {
    if (clb_is_kq(qtype)) return clb_kq_row_nbytes(qtype, ncols); /* kquants.c */
    int64_t e, b;
    int rc = clb_qtype_block(qtype, &e, &b);
    if (rc) return rc;
    if (ncols < 0) return CLB_EINVAL;
    if (ncols % e) return CLB_EBLOCK;
    return ncols / e * b;
}

/* numpy's float32 -> uint8/int8 astype on x86-64: via int32 (cvttss2si), out of range or NaN
 * gives INT32_MIN, then the low byte. Only reached for inf/NaN intermediates. */
static inline int32_t np_f2i(float v) {
    return (v > -2147483648.0f && v < 2147483648.0f) ? (int32_t)v : INT32_MIN;
}


static void quantize_q4_0(block_q4_0 *out, const float *x) {
    float max = x[0], amax = fabsf(x[0]);
    for (int j = 1; j < QK; j++)  /* first element of largest magnitude, keeping its sign */
        if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
    float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        uint8_t v = (uint8_t)np_f2i(truncf(x[j] * id + 8.5f));
        q[j] = v > 15 ? 15 : v;
    }
    out->d = clb_f32_to_f16(d);
    for (int j = 0; j < QK / 2; j++) out->qs[j] = (uint8_t)(q[j] | (q[j + QK / 2] << 4));
}

static void quantize_q4_1(block_q4_1 *out, const float *x) {
    float min = x[0], max = x[0];
    for (int j = 1; j < QK; j++) {
        min = x[j] < min ? x[j] : min;
        max = x[j] > max ? x[j] : max;
    }
    float d = (max - min) / 15, id = d != 0 ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        uint8_t v = (uint8_t)np_f2i(truncf((x[j] - min) * id + 0.5f));
        q[j] = v > 15 ? 15 : v;
    }
    out->d = clb_f32_to_f16(d);
    out->m = clb_f32_to_f16(min);
    for (int j = 0; j < QK / 2; j++) out->qs[j] = (uint8_t)(q[j] | (q[j + QK / 2] << 4));
}

/* gguf's np_roundf rounds half away from zero, as C's roundf (the same for inf/NaN after the
 * integer conversion). */
static void quantize_q8_0(block_q8_0 *out, const float *x) {
    float amax = 0;
    for (int j = 0; j < QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < QK; j++) out->qs[j] = (int8_t)np_f2i(roundf(x[j] * id));
    out->d = clb_f32_to_f16(d);
}

void clb_quantize_q8_0_ref(void *out, const float *x, int64_t nblk) {
    for (int64_t b = 0; b < nblk; b++) quantize_q8_0((block_q8_0 *)out + b, x + b * QK);
}

void clb_quantize_q8_0_blocks(void *out, const float *x, int64_t nblk) {
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: clb_quantize_q8_0_avx512(out, x, nblk); break;
    case CLB_ISA_AVX2: clb_quantize_q8_0_avx2(out, x, nblk); break;
    default: clb_quantize_q8_0_ref(out, x, nblk); break;
    }
}

/* Units [c per_chunk, ...) of a quantize job. */
static void quantize_chunk(void *ctx, int64_t c) {
    const struct quant_job *j = ctx;
    const float *x = j->in;
    uint8_t *o = j->out;
    const int64_t b0 = c * j->per_chunk;
    const int64_t b1 = b0 + j->per_chunk < j->nunits ? b0 + j->per_chunk : j->nunits;
    if (j->qtype == CLB_QTYPE_Q8_0) { /* the SIMD twins give the same bytes */
        clb_quantize_q8_0_blocks(o + b0 * sizeof(block_q8_0), x + b0 * QK, b1 - b0);
        return;
    }
    for (int64_t b = b0; b < b1; b++) {
        uint16_t h;
        switch (j->qtype) {
        case CLB_QTYPE_F16: h = clb_f32_to_f16(x[b]); memcpy(o + 2 * b, &h, 2); break;
        case CLB_QTYPE_BF16: h = clb_f32_to_bf16(x[b]); memcpy(o + 2 * b, &h, 2); break;
        case CLB_QTYPE_Q4_0: quantize_q4_0((block_q4_0 *)o + b, x + b * QK); break;
        case CLB_QTYPE_Q4_1: quantize_q4_1((block_q4_1 *)o + b, x + b * QK); break;
        case CLB_QTYPE_Q8_0: quantize_q8_0((block_q8_0 *)o + b, x + b * QK); break;
        }
    }
}

int clb_quantize(int qtype, void *out, const float *x, int64_t nrows, int64_t ncols) {
    int64_t rb = clb_row_nbytes(qtype, ncols);
    if (rb < 0) return (int)rb;
    if (nrows < 0 || (nrows > 0 && ncols > 0 && (!out || !x))) return CLB_EINVAL;
    if (clb_is_kq(qtype)) return clb_kq_quantize(qtype, out, x, nrows, ncols);
    const int64_t n = nrows * ncols;
    uint8_t *o = out;
    if (qtype == CLB_QTYPE_F32) {
        memcpy(o, x, (size_t)n * 4);
        return CLB_OK;
    }
    /* blocks (or elements) are independent: threads over them, same bytes for any count */
    const int per_elem = qtype == CLB_QTYPE_F16 || qtype == CLB_QTYPE_BF16;
    struct quant_job j = {.qtype = qtype, .out = out, .in = x, .nunits = per_elem ? n : n / QK};
    quant_run(&j, n, quantize_chunk);
    return CLB_OK;
}

/* One block (or float element run) of row data -> 32 floats. Exactly gguf's arithmetic:
 * Q4_0 d * (q - 8), Q4_1 (d * q) + m (two roundings), Q8_0 q * d. */
static inline void dequantize_block(int qtype, float *y, const uint8_t *blk) {
    switch (qtype) {
    case CLB_QTYPE_Q4_0: {
        const block_q4_0 *b = (const void *)blk;
        float d = clb_f16_to_f32(clb_load_u16(&b->d));
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)((b->qs[j] & 15) - 8);
            y[j + QK / 2] = d * (float)((b->qs[j] >> 4) - 8);
        }
        break;
    }
    case CLB_QTYPE_Q4_1: {
        const block_q4_1 *b = (const void *)blk;
        float d = clb_f16_to_f32(clb_load_u16(&b->d)), m = clb_f16_to_f32(clb_load_u16(&b->m));
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)(b->qs[j] & 15) + m;
            y[j + QK / 2] = d * (float)(b->qs[j] >> 4) + m;
        }
        break;
    }
    case CLB_QTYPE_Q8_0: {
        const block_q8_0 *b = (const void *)blk;
        float d = clb_f16_to_f32(clb_load_u16(&b->d));
        for (int j = 0; j < QK; j++) y[j] = (float)b->qs[j] * d;
        break;
    }
    }
}

/* Units [c per_chunk, ...) of a dequantize job. */
static void dequantize_chunk(void *ctx, int64_t c) {
    const struct quant_job *j = ctx;
    const uint8_t *p = j->in;
    float *out = j->out;
    const int64_t b0 = c * j->per_chunk;
    const int64_t b1 = b0 + j->per_chunk < j->nunits ? b0 + j->per_chunk : j->nunits;
    for (int64_t b = b0; b < b1; b++) {
        if (j->qtype == CLB_QTYPE_F16) out[b] = clb_f16_to_f32(clb_load_u16(p + 2 * b));
        else if (j->qtype == CLB_QTYPE_BF16) out[b] = clb_bf16_to_f32(clb_load_u16(p + 2 * b));
        else dequantize_block(j->qtype, out + b * QK, p + b * j->block_nbytes);
    }
}

int clb_dequantize(int qtype, float *out, const void *data, int64_t nrows, int64_t ncols) {
    int64_t rb = clb_row_nbytes(qtype, ncols);
    if (rb < 0) return (int)rb;
    if (nrows < 0 || (nrows > 0 && ncols > 0 && (!out || !data))) return CLB_EINVAL;
    if (clb_is_kq(qtype)) return clb_kq_dequantize(qtype, out, data, nrows, ncols);
    const int64_t n = nrows * ncols;
    const uint8_t *p = data;
    int64_t e = 1, bb = 1;
    clb_qtype_block(qtype, &e, &bb);
    if (qtype == CLB_QTYPE_F32) {
        memcpy(out, p, (size_t)n * 4);
        return CLB_OK;
    }
    const int per_elem = qtype == CLB_QTYPE_F16 || qtype == CLB_QTYPE_BF16;
    struct quant_job j = {.qtype = qtype, .out = out, .in = data, .block_nbytes = bb,
                          .nunits = per_elem ? n : n / QK};
    quant_run(&j, n, dequantize_chunk);
    return CLB_OK;
}

/* ---- scalar matmul twin ------------------------------------------------------------------
 * Dequantizes one block of a weight row at a time and accumulates in float (one accumulator
 * per x row, element order); the SIMD variants in arch/ must match it within tolerance. */
void clb_mm_rows_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                     const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0, int64_t r1,
                     const float *bias, const float *scale, int accumulate) {
    int64_t e = 1, bb = 1;
    clb_qtype_block(qtype, &e, &bb);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_nbytes;
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * ldx;
            float s = 0, wb[QK];
            if (e == QK) {
                for (int64_t b = 0; b < cols / QK; b++) {
                    dequantize_block(qtype, wb, row + b * bb);
                    for (int j = 0; j < QK; j++) s += wb[j] * xi[b * QK + j];
                }
            } else {
                for (int64_t c = 0; c < cols; c++) {
                    float wv = qtype == CLB_QTYPE_F32    ? ((const float *)(const void *)row)[c]
                             : qtype == CLB_QTYPE_F16    ? clb_f16_to_f32(clb_load_u16(row + 2 * c))
                                                         : clb_bf16_to_f32(clb_load_u16(row + 2 * c));
                    s += wv * xi[c];
                }
            }
            if (bias) s += bias[r];
            float v = scale ? scale[i] * s : s;
            y[i * ldy + r] = accumulate ? y[i * ldy + r] + v : v;
        }
    }
}

/* ---- scalar twin of the Q8_0-activation matmul (clb_matmul_q8) -----------------------------
 * Per block the exact integer sum of w_q * x_q (Q4_0: w_q = nibble - 8), then in f32
 * s = fma(isum, d_w * d_x, s), block order; ggml_vec_dot_q4_0_q8_0 / _q8_0_q8_0 in scalar form.
 * Every SIMD variant and batch size gives these bits (arch/matmul_q8.inc). */
void clb_mmq_rows_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                      const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0,
                      int64_t r1, const float *bias, const float *scale, int accumulate) {
    const int64_t bb = qtype == CLB_QTYPE_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const int64_t xb = sizeof(block_q8_0), nblk = cols / QK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_nbytes;
        for (int64_t i = 0; i < n; i++) {
            float s = 0;
            for (int64_t b = 0; b < nblk; b++) {
                const uint8_t *wb = row + b * bb;
                const block_q8_0 *xb8 = (const void *)(xq + i * ldxq + b * xb);
                int32_t isum = 0;
                if (qtype == CLB_QTYPE_Q4_0) {
                    for (int j = 0; j < QK / 2; j++) {
                        isum += ((wb[2 + j] & 15) - 8) * xb8->qs[j];
                        isum += ((wb[2 + j] >> 4) - 8) * xb8->qs[j + QK / 2];
                    }
                } else {
                    for (int j = 0; j < QK; j++) isum += (int8_t)wb[2 + j] * xb8->qs[j];
                }
                const float d = clb_f16_to_f32(clb_load_u16(wb)) *
                                clb_f16_to_f32(clb_load_u16(&xb8->d));
                s = fmaf((float)isum, d, s); /* one rounding: the SIMD kernels' FMA, bit for bit */
            }
            if (bias) s += bias[r];
            float v = scale ? scale[i] * s : s;
            y[i * ldy + r] = accumulate ? y[i * ldy + r] + v : v;
        }
    }
}
