/* kquants.c — quantize, dequantize and the scalar matmul twins of the issue-15 storage types
 * (kquants.h), and the per-type dispatch matmul.c and ffn.c use.
 *
 * Dequantization is gguf-py's (gguf.quants.dequantize) bit for bit: every value is s * q + m in
 * f32 without FMA contraction (pragma below), see kquants.h. Quantizers:
 *   q5_0, q5_1, mxfp4: gguf.quants.quantize's arithmetic (= ggml's quantize_row_*_ref), same
 *     bytes;
 *   q4_k, q5_k, q6_k: the algorithm of ggml's quantize_row_q{4,5,6}_K_ref (ggml-quants.c:
 *     make_qkx2_quants' weighted min/scale search for Q4_K/Q5_K, make_qx_quants' rmse search for
 *     Q6_K, 6-bit / 8-bit super-block scales, then a re-quantization with the rounded scales);
 *   fp8: per 128x128 tile of the rows given (tiles start at the first row), scale = amax / 448
 *     (DeepSeek-V3's block scaling), e4m3 = round-to-nearest-even of x / scale in f32 (torch's
 *     x.to(float8_e4m3fn) for these in-range values; beyond 448 it saturates).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "kquants.h"
#include "pool.h"
#include "quant.h"

/* numpy's float32 -> uint8 astype on x86-64 (see quant.c). */
static inline int32_t np_f2i(float v) {
    return (v > -2147483648.0f && v < 2147483648.0f) ? (int32_t)v : INT32_MIN;
}

/* ggml's nearest_int: round half to even through the float adder (|v| < 2^22). */
static inline int nearest_int(float v) {
    float t = v + 12582912.f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}

#define MAXI(a, b) ((a) > (b) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))

/* ---- Q5_0 / Q5_1 (gguf.quants.quantize's arithmetic) ---------------------------------- */

static void pack_q5(uint8_t *qh_out, uint8_t *qs, const uint8_t *q) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((q[j] & 15) | (q[j + 16] << 4));
        qh |= (uint32_t)(q[j] >> 4) << j;
        qh |= (uint32_t)(q[j + 16] >> 4) << (j + 16);
    }
    memcpy(qh_out, &qh, 4);
}

static void quantize_q5_0(block_q5_0 *out, const float *x) {
    float max = x[0], amax = fabsf(x[0]);
    for (int j = 1; j < 32; j++)
        if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
    const float d = max / -16, id = d != 0 ? 1.0f / d : 0.0f;
    uint8_t q[32];
    for (int j = 0; j < 32; j++) {
        uint8_t v = (uint8_t)np_f2i(truncf(x[j] * id + 16.5f));
        q[j] = v > 31 ? 31 : v;
    }
    out->d = clb_f32_to_f16(d);
    pack_q5(out->qh, out->qs, q);
}

static void quantize_q5_1(block_q5_1 *out, const float *x) {
    float min = x[0], max = x[0];
    for (int j = 1; j < 32; j++) {
        min = x[j] < min ? x[j] : min;
        max = x[j] > max ? x[j] : max;
    }
    const float d = (max - min) / 31, id = d != 0 ? 1.0f / d : 0.0f;
    uint8_t q[32];
    for (int j = 0; j < 32; j++) {
        uint8_t v = (uint8_t)np_f2i(truncf((x[j] - min) * id + 0.5f));
        q[j] = v > 31 ? 31 : v;
    }
    out->d = clb_f32_to_f16(d);
    out->m = clb_f32_to_f16(min);
    pack_q5(out->qh, out->qs, q);
}

/* MXFP4 (gguf.quants.quantize's arithmetic = ggml's quantize_row_mxfp4_ref): shared exponent
 * e = floor(log2(amax)) - 2 + 127, each weight the nearest of the doubled e2m1 values times
 * 2^(e - 128) (the first on ties). */
static void quantize_mxfp4(block_mxfp4 *out, const float *x) {
    float amax = 0;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const uint8_t e = amax > 0.0f ? (uint8_t)(int)(floorf(log2f(amax)) - 2 + 127) : 0;
    const float d = clb_e8m0_half(e);
    uint8_t q[32];
    for (int j = 0; j < 32; j++) {
        int best = 0;
        float err = fabsf(d * (float)clb_kvalues_mxfp4[0] - x[j]);
        for (int i = 1; i < 16; i++) {
            const float t = fabsf(d * (float)clb_kvalues_mxfp4[i] - x[j]);
            if (t < err) { err = t; best = i; }
        }
        q[j] = (uint8_t)best;
    }
    out->e = e;
    for (int j = 0; j < 16; j++) out->qs[j] = (uint8_t)(q[j] | (q[j + 16] << 4));
}

/* ---- K-quant helpers (the algorithms of ggml-quants.c) ---------------------------------- */

/* Asymmetric n-weight group on levels 0..nmax: weighted least squares over a grid of
 * nstep + 1 trial scales (rmin + rdelta * is + nmax) / (max - min), keeping the best fit with
 * min <= 0. Returns the scale, *the_min = -min, L the levels. (make_qkx2_quants) */
static float fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L,
                           float *the_min, float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)MAXI(0, MINI(nmax, l));
        const float diff = scale * L[i] + min - x[i];
        best += w[i] * (diff * diff);
    }
    uint8_t La[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; i++) {
            const int l = MAXI(0, MINI(nmax, nearest_int(iscale * (x[i] - min))));
            La[i] = (uint8_t)l;
            sl += w[i] * l;
            sl2 += w[i] * l * l;
            sxl += w[i] * l * x[i];
        }
        const float D = sum_w * sl2 - sl * sl;
        if (D > 0) {
            float this_scale = (sum_w * sxl - sum_x * sl) / D;
            float this_min = (sl2 * sum_x - sl * sxl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sxl / sl2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                const float diff = this_scale * La[i] + this_min - x[i];
                err += w[i] * (diff * diff);
            }
            if (err < best) {
                memcpy(L, La, n);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* Symmetric group on levels -nmax..nmax-1 (stored + nmax), weights x^2, trial scales
 * -(nmax + 0.1 is) / max for is in -9..9. Returns the scale. (make_qx_quants, rmse_type 1) */
static float fit_scale_sym(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < 1e-15f) {
        memset(L, 0, n);
        return 0.f;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = MAXI(-nmax, MINI(nmax - 1, nearest_int(iscale * x[i])));
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = MAXI(-nmax, MINI(nmax - 1, nearest_int(iscale * x[i])));
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + MAXI(-nmax, MINI(nmax - 1, nearest_int(iscale * x[i]))));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q4_K (nmax 15) and Q5_K (nmax 31): 8 groups of 32 with a fitted scale and min each, the 16
 * of them quantized to 6 bits against the super-block's d, dmin (f16), then the weights
 * re-quantized with the rounded scales. L: the 256 levels. */
static void quantize_k45(int nmax, const float *x, uint8_t *hdr /* d, dmin, scales[12] */,
                         uint8_t *L) {
    float w[32], mins[8], scales[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sx2 = 0;
        for (int l = 0; l < 32; l++) sx2 += x[32 * j + l] * x[32 * j + l];
        const float av = sqrtf(sx2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av + fabsf(x[32 * j + l]);
        scales[j] = nmax == 15
                        ? fit_scale_min(32, 15, x + 32 * j, w, L + 32 * j, &mins[j], -1.f, 0.1f, 20)
                        : fit_scale_min(32, 31, x + 32 * j, w, L + 32 * j, &mins[j], -0.5f, 0.1f, 15);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t *sc = hdr + 4;
    memset(sc, 0, 12);
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = MINI(63, ls);
        lm = MINI(63, lm);
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j - 0] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t d16 = clb_f32_to_f16(max_scale / 63.f), m16 = clb_f32_to_f16(max_min / 63.f);
    memcpy(hdr, &d16, 2);
    memcpy(hdr + 2, &m16, 2);
    const float d = clb_f16_to_f32(d16), dmin = clb_f16_to_f32(m16);
    for (int j = 0; j < 8; j++) {
        uint8_t a, mn;
        clb_k4_scale_min(j, sc, &a, &mn);
        const float dj = d * a;
        if (!dj) continue;
        const float dm = dmin * mn;
        for (int i = 0; i < 32; i++)
            L[32 * j + i] = (uint8_t)MAXI(0, MINI(nmax, nearest_int((x[32 * j + i] + dm) / dj)));
    }
}

static void quantize_q4_K(block_q4_K *y, const float *x) {
    uint8_t L[QK_K];
    quantize_k45(15, x, (uint8_t *)y, L);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++)
            y->qs[32 * j + l] = (uint8_t)(L[64 * j + l] | (L[64 * j + 32 + l] << 4));
}

static void quantize_q5_K(block_q5_K *y, const float *x) {
    uint8_t L[QK_K];
    quantize_k45(31, x, (uint8_t *)y, L);
    memset(y->qh, 0, 32);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            int l1 = L[64 * j + l], l2 = L[64 * j + 32 + l];
            if (l1 > 15) { l1 -= 16; y->qh[l] |= (uint8_t)(1 << (2 * j)); }
            if (l2 > 15) { l2 -= 16; y->qh[l] |= (uint8_t)(2 << (2 * j)); }
            y->qs[32 * j + l] = (uint8_t)(l1 | (l2 << 4));
        }
}

/* Q6_K: 16 groups of 16 with a symmetric fitted scale each, scales to int8 against d (f16). */
static void quantize_q6_K(block_q6_K *y, const float *x) {
    int8_t L[QK_K];
    float scales[16], max_scale = 0, max_abs = 0;
    for (int ib = 0; ib < 16; ib++) {
        scales[ib] = fit_scale_sym(16, 32, x + 16 * ib, L + 16 * ib);
        if (fabsf(scales[ib]) > max_abs) { max_abs = fabsf(scales[ib]); max_scale = scales[ib]; }
    }
    memset(y, 0, sizeof *y);
    if (max_abs < 1e-15f) return; /* d = +0, all levels 0 */
    const float iscale = -128.f / max_scale;
    y->d = clb_f32_to_f16(1 / iscale);
    for (int ib = 0; ib < 16; ib++) y->scales[ib] = (int8_t)MINI(127, nearest_int(iscale * scales[ib]));
    const float d = clb_f16_to_f32(y->d);
    for (int j = 0; j < 16; j++) {
        const float dj = d * y->scales[j];
        if (!dj) continue;
        for (int i = 0; i < 16; i++)
            L[16 * j + i] = (int8_t)(MAXI(-32, MINI(31, nearest_int(x[16 * j + i] / dj))) + 32);
    }
    for (int n = 0; n < 2; n++) {
        uint8_t *ql = y->ql + 64 * n, *qh = y->qh + 32 * n;
        const int8_t *Ln = L + 128 * n;
        for (int l = 0; l < 32; l++) {
            const uint8_t q1 = Ln[l] & 0xF, q2 = Ln[l + 32] & 0xF, q3 = Ln[l + 64] & 0xF,
                          q4 = Ln[l + 96] & 0xF;
            ql[l] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((Ln[l] >> 4) | ((Ln[l + 32] >> 4) << 2) | ((Ln[l + 64] >> 4) << 4) |
                              ((Ln[l + 96] >> 4) << 6));
        }
    }
}

/* ---- FP8 ---------------------------------------------------------------------------------- */

/* f32 -> e4m3fn, round to nearest even, |v| above 448 saturates to 448, NaN -> NaN. */
static uint8_t f32_to_e4m3(float v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    float a = fabsf(v);
    if (isnan(a)) return 0x7f | sign;
    if (a >= 448.f) return 0x7e | sign;
    if (a < 0x1p-6f) { /* subnormal range: multiples of 2^-9 */
        const int m = (int)nearbyintf(a * 512.f); /* 0..8; 8 is the smallest normal */
        return (uint8_t)(sign | m);
    }
    int e;
    const float fr = frexpf(a, &e);       /* a = fr * 2^e, fr in [0.5, 1) */
    int m = (int)nearbyintf(fr * 16.f);   /* 8..16: 1.mmm with 3 bits */
    int ex = e - 1 + 7;
    if (m == 16) { m = 8; ex++; }
    if (ex > 15 || (ex == 15 && m - 8 > 6)) return 0x7e | sign;
    return (uint8_t)(sign | (ex << 3) | (m - 8));
}

static void quantize_fp8(uint8_t *out, const float *x, int64_t nrows, int64_t ncols) {
    const int64_t ns = clb_fp8_nscales(ncols), rb = 4 * ns + ncols;
    for (int64_t r0 = 0; r0 < nrows; r0 += CLB_FP8_BLOCK) {
        const int64_t r1 = r0 + CLB_FP8_BLOCK < nrows ? r0 + CLB_FP8_BLOCK : nrows;
        for (int64_t b = 0; b < ns; b++) {
            const int64_t c0 = b * CLB_FP8_BLOCK, c1 = c0 + CLB_FP8_BLOCK < ncols ? c0 + CLB_FP8_BLOCK : ncols;
            float amax = 0;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) amax = fmaxf(amax, fabsf(x[r * ncols + c]));
            const float sc = amax / 448.f;
            for (int64_t r = r0; r < r1; r++) {
                uint8_t *row = out + r * rb;
                memcpy(row + 4 * b, &sc, 4);
                for (int64_t c = c0; c < c1; c++) row[4 * ns + c] = f32_to_e4m3(sc != 0 ? x[r * ncols + c] / sc : 0.0f);
            }
        }
    }
}

/* ---- quantize / dequantize entry points ------------------------------------------------- */

struct kq_job {
    int qtype;
    void *out;
    const void *in;
    int64_t cols, rb, nrows;
};

#define KQ_ROWS_PER_CHUNK 16

static void kq_quant_chunk(void *ctx, int64_t c) {
    const struct kq_job *j = ctx;
    const int64_t r0 = c * KQ_ROWS_PER_CHUNK;
    const int64_t r1 = r0 + KQ_ROWS_PER_CHUNK < j->nrows ? r0 + KQ_ROWS_PER_CHUNK : j->nrows;
    int64_t e = 32, bb = 1;
    clb_kq_block(j->qtype, &e, &bb);
    for (int64_t r = r0; r < r1; r++) {
        const float *x = (const float *)j->in + r * j->cols;
        uint8_t *o = (uint8_t *)j->out + r * j->rb;
        for (int64_t b = 0; b < j->cols / e; b++) {
            void *blk = o + b * bb;
            const float *xb = x + b * e;
            switch (j->qtype) {
            case CLB_QTYPE_Q5_0: quantize_q5_0(blk, xb); break;
            case CLB_QTYPE_Q5_1: quantize_q5_1(blk, xb); break;
            case CLB_QTYPE_MXFP4: quantize_mxfp4(blk, xb); break;
            case CLB_QTYPE_Q4_K: quantize_q4_K(blk, xb); break;
            case CLB_QTYPE_Q5_K: quantize_q5_K(blk, xb); break;
            case CLB_QTYPE_Q6_K: quantize_q6_K(blk, xb); break;
            default: break;
            }
        }
    }
}

int clb_kq_quantize(int qtype, void *out, const float *x, int64_t nrows, int64_t ncols) {
    const int64_t rb = clb_kq_row_nbytes(qtype, ncols);
    if (rb < 0) return (int)rb;
    if (nrows == 0 || ncols == 0) return CLB_OK;
    if (qtype == CLB_QTYPE_FP8) { /* tiles span rows: one thread */
        quantize_fp8(out, x, nrows, ncols);
        return CLB_OK;
    }
    if (qtype != CLB_QTYPE_Q5_0 && qtype != CLB_QTYPE_Q5_1 && qtype != CLB_QTYPE_MXFP4 &&
        qtype != CLB_QTYPE_Q4_K &&
        qtype != CLB_QTYPE_Q5_K && qtype != CLB_QTYPE_Q6_K)
        return CLB_EQTYPE; /* import-only types (no quantizer) */
    struct kq_job j = {qtype, out, x, ncols, rb, nrows};
    const int64_t nch = (nrows + KQ_ROWS_PER_CHUNK - 1) / KQ_ROWS_PER_CHUNK;
    clb_parallel_for(nch, kq_quant_chunk, &j, nrows * ncols >= (1 << 18) ? 0 : 1);
    return CLB_OK;
}

/* A GGML-type row -> f32 exactly as gguf (signed zeros too): s * q (+ m), no FMA. */
static void kq_dequant_row(int qtype, float *out, const uint8_t *row, int64_t cols, int8_t *q,
                           float *s, float *m) {
    if (qtype == CLB_QTYPE_FP8) {
        clb_fp8_row_f32(row, cols, out);
        return;
    }
    clb_kq_unpack_row(qtype, row, cols, q, s, m);
    if (clb_kq_has_min(qtype))
        for (int64_t c = 0; c < cols; c++) out[c] = s[c / 16] * (float)q[c] + m[c / 16];
    else /* no + 0: keeps gguf's -0.0 */
        for (int64_t c = 0; c < cols; c++) out[c] = s[c / 16] * (float)q[c];
}

static void kq_dequant_chunk(void *ctx, int64_t c) {
    const struct kq_job *j = ctx;
    const int64_t r0 = c * KQ_ROWS_PER_CHUNK;
    const int64_t r1 = r0 + KQ_ROWS_PER_CHUNK < j->nrows ? r0 + KQ_ROWS_PER_CHUNK : j->nrows;
    int8_t *q = malloc(j->cols + 8 * (j->cols / 16 + 1) + 16);
    if (!q) { /* NaN rather than stale values */
        clb_kq_fail_rows((float *)j->out + r0 * j->cols, j->cols, r1 - r0, 0, j->cols);
        return;
    }
    float *s = (float *)(void *)(q + (j->cols + 3) / 4 * 4), *m = s + j->cols / 16 + 1;
    for (int64_t r = r0; r < r1; r++)
        kq_dequant_row(j->qtype, (float *)j->out + r * j->cols, (const uint8_t *)j->in + r * j->rb,
                       j->cols, q, s, m);
    free(q);
}

int clb_kq_dequantize(int qtype, float *out, const void *data, int64_t nrows, int64_t ncols) {
    const int64_t rb = clb_kq_row_nbytes(qtype, ncols);
    if (rb < 0) return (int)rb;
    if (nrows == 0 || ncols == 0) return CLB_OK;
    struct kq_job j = {qtype, out, data, ncols, rb, nrows};
    const int64_t nch = (nrows + KQ_ROWS_PER_CHUNK - 1) / KQ_ROWS_PER_CHUNK;
    clb_parallel_for(nch, kq_dequant_chunk, &j, nrows * ncols >= (1 << 20) ? 0 : 1);
    return CLB_OK;
}

/* ---- scalar matmul twins ------------------------------------------------------------------
 * f32 activations: each weight row dequantized (exactly) into f32, then a sequential f32 dot
 * per x row. Q8_0 activations: per 16 weights the exact integer dot isum = sum q_w q_x and
 * xsum = sum q_x, then per 32-block s += d_x * (s_w isum + m_w xsum) over its two halves (FP8:
 * d_x * sum w q_x in f32). ggml-cpu's vec_dot_q*_K_q8_K in scalar form, on Q8_0 blocks. */

static void kq_epilogue(float *y, int64_t ldy, int64_t i, int64_t r, float s, const float *bias,
                        const float *scale, int accumulate) {
    if (bias) s += bias[r];
    const float v = scale ? scale[i] * s : s;
    y[i * ldy + r] = accumulate ? y[i * ldy + r] + v : v;
}

void clb_kq_mm_rows_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                        const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0,
                        int64_t r1, const float *bias, const float *scale, int accumulate) {
    float *wf = malloc(cols * 4 + cols + 8 * (cols / 16 + 1) + 16);
    if (!wf) {
        clb_kq_fail_rows(y, ldy, n, r0, r1);
        return;
    }
    int8_t *q = (int8_t *)(void *)(wf + cols);
    float *s = (float *)(void *)(q + (cols + 3) / 4 * 4), *m = s + cols / 16 + 1;
    for (int64_t r = r0; r < r1; r++) {
        kq_dequant_row(qtype, wf, w + r * row_nbytes, cols, q, s, m);
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * ldx;
            float acc = 0;
            for (int64_t c = 0; c < cols; c++) acc += wf[c] * xi[c];
            kq_epilogue(y, ldy, i, r, acc, bias, scale, accumulate);
        }
    }
    free(wf);
}

/* FP8 on Q8_0: the SIMD kernels' one computation (kquants_simd.inc, kq_x_scaled / kq_fp8_dot_xs)
 * lane by lane: xs = d_x * q_x; per 128-column block 16 lanes t_l chained by fma over the block's
 * columns 16 k + l, acc_l = fma(t_l, scale, acc_l); then acc_l + acc_{l+8} reduced as
 * (l + l+4) pairs, (0 + 2) + (1 + 3). */
static float kq_fp8_dot_q8_ref(const uint8_t *row, const uint8_t *xr, int64_t cols) {
    const int64_t ns = clb_fp8_nscales(cols);
    const uint8_t *v = row + 4 * ns;
    float acc[16] = {0};
    for (int64_t b = 0; b < ns; b++) {
        float sc, t[16] = {0};
        memcpy(&sc, row + 4 * b, 4);
        const int64_t c0 = b * CLB_FP8_BLOCK, c1 = c0 + CLB_FP8_BLOCK < cols ? c0 + CLB_FP8_BLOCK : cols;
        for (int64_t c = c0; c < c1; c += 16)
            for (int l = 0; l < 16; l++) {
                const uint8_t *xb = xr + (c + l) / QK * sizeof(block_q8_0);
                const float xs = clb_f16_to_f32(clb_load_u16(xb)) * (float)((const int8_t *)xb)[2 + (c + l) % QK];
                t[l] = fmaf(clb_e4m3_to_f32(v[c + l]), xs, t[l]);
            }
        for (int l = 0; l < 16; l++) acc[l] = fmaf(t[l], sc, acc[l]);
    }
    float v8[8], t4[4];
    for (int l = 0; l < 8; l++) v8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = v8[l] + v8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

/* MXFP4 on Q8_0 (ggml's vec_dot_mxfp4_q8_0, scalar form): per block the exact int32 dot of the
 * E2M1 levels (clb_kvalues_mxfp4) with x's int8, then s = fma(isum, e8m0_half(e) * d_x, s) in
 * block order; the SIMD kernels' one computation at every batch size (arch/matmul_mxfp4.inc). */
static float kq_mxfp4_dot_q8_ref(const uint8_t *row, const uint8_t *xr, int64_t nblk) {
    float s = 0;
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *wb = row + 17 * b, *xb = xr + 34 * b;
        const int8_t *xs = (const int8_t *)(xb + 2);
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            isum += clb_kvalues_mxfp4[wb[1 + j] & 15] * xs[j];
            isum += clb_kvalues_mxfp4[wb[1 + j] >> 4] * xs[j + 16];
        }
        s = fmaf((float)isum, clb_e8m0_half(wb[0]) * clb_f16_to_f32(clb_load_u16(xb)), s);
    }
    return s;
}

void clb_kq_mmq_rows_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                         const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0,
                         int64_t r1, const float *bias, const float *scale, int accumulate) {
    const int64_t nblk = cols / QK;
    if (qtype == CLB_QTYPE_MXFP4) {
        for (int64_t r = r0; r < r1; r++)
            for (int64_t i = 0; i < n; i++)
                kq_epilogue(y, ldy, i, r, kq_mxfp4_dot_q8_ref(w + r * row_nbytes, xq + i * ldxq, nblk),
                            bias, scale, accumulate);
        return;
    }
    if (qtype == CLB_QTYPE_FP8) {
        for (int64_t r = r0; r < r1; r++)
            for (int64_t i = 0; i < n; i++)
                kq_epilogue(y, ldy, i, r, kq_fp8_dot_q8_ref(w + r * row_nbytes, xq + i * ldxq, cols),
                            bias, scale, accumulate);
        return;
    }
    float *wf = malloc(cols * 4 + cols + 8 * (cols / 16 + 1) + 16);
    if (!wf) {
        clb_kq_fail_rows(y, ldy, n, r0, r1);
        return;
    }
    int8_t *q = (int8_t *)(void *)(wf + cols);
    float *s = (float *)(void *)(q + (cols + 3) / 4 * 4), *m = s + cols / 16 + 1;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_nbytes;
        if (qtype == CLB_QTYPE_FP8) clb_fp8_row_f32(row, cols, wf);
        else clb_kq_unpack_row(qtype, row, cols, q, s, m);
        for (int64_t i = 0; i < n; i++) {
            float acc = 0;
            for (int64_t b = 0; b < nblk; b++) {
                const block_q8_0 *xb = (const void *)(xq + i * ldxq + b * sizeof(block_q8_0));
                const float dx = clb_f16_to_f32(clb_load_u16(&xb->d));
                if (qtype == CLB_QTYPE_FP8) {
                    float t = 0;
                    for (int j = 0; j < QK; j++) t += wf[b * QK + j] * (float)xb->qs[j];
                    acc += dx * t;
                    continue;
                }
                float t = 0;
                for (int h = 0; h < 2; h++) {
                    int32_t isum = 0, xsum = 0;
                    for (int j = 16 * h; j < 16 * h + 16; j++) {
                        isum += q[b * QK + j] * xb->qs[j];
                        xsum += xb->qs[j];
                    }
                    t += s[2 * b + h] * (float)isum + m[2 * b + h] * (float)xsum;
                }
                acc += dx * t;
            }
            kq_epilogue(y, ldy, i, r, acc, bias, scale, accumulate);
        }
    }
    free(wf);
}
