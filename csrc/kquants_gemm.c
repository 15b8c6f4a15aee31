/* kquants_gemm.c — Q4_K / Q5_K / Q6_K matmul on Q8_K activations (see kquants_gemm.h for the
 * formats and the one computation): ggml's Q8_K quantizer, the scalar twin, ISA dispatch and
 * threading over chunks of weight rows. The SIMD GEMM is arch/kquants_gemm.inc.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "kquants_gemm.h"
#include "pool.h"
#include "quant.h"

int64_t clb_q8k_row_nbytes(int64_t ncols) {
    if (ncols < 0) return CLB_EINVAL;
    if (ncols % QK_K) return CLB_EBLOCK;
    return ncols / QK_K * KQG_XB;
}

int clb_q8k_supported(int qtype) { return kqg_supported(qtype); }

/* ggml's quantize_row_q8_K_ref: d = max / -127 of the value of largest magnitude (its sign
 * kept, so that value becomes -127), q = nearest_int(x * -127 / max) capped at 127. */
static void q8k_block(uint8_t *o, const float *x) {
    float max = 0, amax = 0;
    for (int j = 0; j < QK_K; j++) {
        const float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    int8_t q[QK_K];
    int16_t bs[16];
    float d = 0;
    if (amax == 0) {
        memset(q, 0, sizeof q);
    } else {
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) {
            const int v = kqg_nearest_int(iscale * x[j]);
            q[j] = (int8_t)(v < 127 ? v : 127);
        }
        d = 1 / iscale;
    }
    for (int k = 0; k < 16; k++) {
        int s = 0;
        for (int l = 0; l < 16; l++) s += q[16 * k + l];
        bs[k] = (int16_t)s;
    }
    memcpy(o, &d, 4);
    memcpy(o + 4, q, QK_K);
    memcpy(o + 4 + QK_K, bs, sizeof bs);
}

int clb_quantize_q8_k(void *out, const float *x, int64_t nrows, int64_t ncols) {
    const int64_t rb = clb_q8k_row_nbytes(ncols);
    if (rb < 0) return (int)rb;
    if (nrows < 0) return CLB_EINVAL;
    if (nrows == 0 || ncols == 0) return CLB_OK;
    if (!out || !x) return CLB_EINVAL;
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t b = 0; b < ncols / QK_K; b++)
            q8k_block((uint8_t *)out + r * rb + b * KQG_XB, x + r * ncols + b * QK_K);
    return CLB_OK;
}

/* The scalar twin: the one computation of kquants_gemm.h, row by row. */
void clb_kqg_rows_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                      const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0,
                      int64_t r1, const float *bias, const float *scale, int accumulate) {
    const int64_t nblk = cols / QK_K, bb = row_nbytes / (nblk ? nblk : 1);
    const int six = qtype == CLB_QTYPE_Q6_K;
    uint8_t lev[QK_K];
    int16_t sc[16], mn[8];
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < n; i++) {
            float acc = 0;
            for (int64_t b = 0; b < nblk; b++) {
                float dw, dmin, dx;
                kqg_unpack(qtype, w + r * row_nbytes + b * bb, lev, sc, mn, &dw, &dmin);
                const uint8_t *xb = xq + i * ldxq + b * KQG_XB;
                int8_t q[QK_K];
                int16_t bs[16];
                memcpy(&dx, xb, 4);
                memcpy(q, xb + 4, QK_K);
                memcpy(bs, xb + 4 + QK_K, sizeof bs);
                int32_t sumi = 0, summ = 0;
                if (six) {
                    for (int k = 0; k < 16; k++) {
                        int32_t t = 0;
                        for (int l = 0; l < 16; l++) t += lev[16 * k + l] * q[16 * k + l];
                        sumi += sc[k] * (t - 32 * bs[k]);
                    }
                } else {
                    for (int j = 0; j < 8; j++) {
                        int32_t t = 0;
                        for (int l = 0; l < 32; l++) t += lev[32 * j + l] * q[32 * j + l];
                        sumi += sc[j] * t;
                        summ += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
                    }
                }
                acc = fmaf((float)sumi, dw * dx, acc);
                if (!six) acc = fmaf(-(float)summ, dmin * dx, acc);
            }
            if (bias) acc += bias[r];
            const float v = scale ? scale[i] * acc : acc;
            y[i * ldy + r] = accumulate ? y[i * ldy + r] + v : v;
        }
}

typedef void (*kqg_rows_fn)(int qtype, float *y, int64_t ldy, const uint8_t *w,
                            int64_t row_nbytes, const uint8_t *xq, int64_t ldxq, int64_t cols,
                            int64_t n, int64_t r0, int64_t r1, const float *bias,
                            const float *scale, int accumulate);

static kqg_rows_fn kqg_rows_for_isa(void) {
    static int vnni = -1;
    if (vnni < 0) {
        __builtin_cpu_init();
        vnni = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    }
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return vnni ? clb_kqg_rows_avx512vnni : clb_kqg_rows_avx512;
    case CLB_ISA_AVX2: return clb_kqg_rows_avx2;
    default: return clb_kqg_rows_ref;
    }
}

struct kqg_job {
    kqg_rows_fn fn;
    int qtype;
    float *y;
    const void *w, *xq;
    int64_t rows, cols, n, rb, xrb, ch;
};

static void kqg_chunk(void *ctx, int64_t c) {
    const struct kqg_job *j = ctx;
    const int64_t r0 = c * j->ch, r1 = r0 + j->ch < j->rows ? r0 + j->ch : j->rows;
    j->fn(j->qtype, j->y, j->rows, j->w, j->rb, j->xq, j->xrb, j->cols, j->n, r0, r1, NULL,
          NULL, 0);
}

int clb_matmul_q8k(int qtype, float *y, const void *w, const void *xq, int64_t rows,
                   int64_t cols, int64_t n, int nthreads) {
    if (!kqg_supported(qtype)) return CLB_EQTYPE;
    const int64_t rb = clb_kq_row_nbytes(qtype, cols), xrb = clb_q8k_row_nbytes(cols);
    if (rb < 0) return (int)rb;
    if (xrb < 0) return (int)xrb;
    if (rows < 0 || n < 0) return CLB_EINVAL;
    if (rows == 0 || n == 0) return CLB_OK;
    if (!y || !w || !xq) return CLB_EINVAL;
    const kqg_rows_fn fn = kqg_rows_for_isa();
    /* every x row is a pass over the weights' integer work: count batches as matmul.c does */
    const int nt = clb_threads_for(nthreads, rows * rb * ((n + 3) / 4), rows);
    if (nt == 1) {
        fn(qtype, y, rows, w, rb, xq, xrb, cols, n, 0, rows, NULL, NULL, 0);
        return CLB_OK;
    }
    struct kqg_job j = {fn, qtype, y, w, xq, rows, cols, n, rb, xrb, clb_chunk_rows(rows, nt)};
    clb_parallel_for((rows + j.ch - 1) / j.ch, kqg_chunk, &j, nt);
    return CLB_OK;
}

/* ---- the fused expert FFN on Q8_K activations ---------------------------------------------
 * clb_expert_ffn's two parallel loops (ffn.c) with the GEMM above: x quantized to Q8_K once;
 * chunks of d_ff rows (whole 256-column blocks) compute gate and up for every token, the
 * activation, and quantize their columns of h to Q8_K; then chunks of d_model rows of down,
 * whose epilogue adds the bias, scales by the routing weight and accumulates into y. */

/* h = act(g, u), ffn.c's formulas (colibri.h). */
static void kqg_act(float *g, const float *u, int64_t ld, int64_t n, int64_t c0, int64_t c1,
                    int act, float alpha, float limit) {
    for (int64_t i = 0; i < n; i++) {
        float *gi = g + i * ld;
        const float *ui = u + i * ld;
        for (int64_t c = c0; c < c1; c++) {
            float a = gi[c], b = ui[c];
            if (act == CLB_ACT_SILU) {
                a = a / (1.0f + expf(-a));
            } else if (act == CLB_ACT_GELU) {
                a = 0.5f * a * (1.0f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a)));
            } else {
                a = a < limit ? a : limit;
                b = b < -limit ? -limit : b > limit ? limit : b;
                a = (b + 1.0f) * (a / (1.0f + expf(-alpha * a)));
                b = 1.0f;
            }
            gi[c] = a * b;
        }
    }
}

struct kqg_ffn {
    kqg_rows_fn fn;
    int qt_g, qt_u, qt_d, act, accumulate;
    float alpha, limit;
    uint8_t *xq, *hq;
    float *y, *g, *u;
    const float *gate_bias, *up_bias, *down_bias, *row_weight;
    const uint8_t *gate, *up, *down;
    int64_t n, d_model, d_ff, rb_g, rb_u, rb_d, xrb_model, xrb_ff, ch_ff, ch_model;
};

static void kqg_ffn_up(void *ctx, int64_t c) {
    const struct kqg_ffn *j = ctx;
    const int64_t f0 = c * j->ch_ff, f1 = f0 + j->ch_ff < j->d_ff ? f0 + j->ch_ff : j->d_ff;
    j->fn(j->qt_g, j->g, j->d_ff, j->gate, j->rb_g, j->xq, j->xrb_model, j->d_model, j->n, f0,
          f1, j->gate_bias, NULL, 0);
    j->fn(j->qt_u, j->u, j->d_ff, j->up, j->rb_u, j->xq, j->xrb_model, j->d_model, j->n, f0, f1,
          j->up_bias, NULL, 0);
    kqg_act(j->g, j->u, j->d_ff, j->n, f0, f1, j->act, j->alpha, j->limit);
    for (int64_t i = 0; i < j->n; i++) /* f0, f1 are whole 256-column blocks */
        for (int64_t b = f0 / QK_K; b < f1 / QK_K; b++)
            q8k_block(j->hq + i * j->xrb_ff + b * KQG_XB, j->g + i * j->d_ff + b * QK_K);
}

static void kqg_ffn_down(void *ctx, int64_t c) {
    const struct kqg_ffn *j = ctx;
    const int64_t m0 = c * j->ch_model;
    const int64_t m1 = m0 + j->ch_model < j->d_model ? m0 + j->ch_model : j->d_model;
    j->fn(j->qt_d, j->y, j->d_model, j->down, j->rb_d, j->hq, j->xrb_ff, j->d_ff, j->n, m0, m1,
          j->down_bias, j->row_weight, j->accumulate);
}

int clb_expert_ffn_q8k(int qt_g, int qt_u, int qt_d, float *y, float *scratch, const float *x,
                       const void *gate, const void *up, const void *down,
                       const float *gate_bias, const float *up_bias, const float *down_bias,
                       const float *row_weight, int64_t n, int64_t d_model, int64_t d_ff,
                       int act, float alpha, float limit, int accumulate, int nthreads) {
    if (!kqg_supported(qt_g) || !kqg_supported(qt_u) || !kqg_supported(qt_d)) return CLB_EQTYPE;
    const int64_t rb_g = clb_kq_row_nbytes(qt_g, d_model), rb_u = clb_kq_row_nbytes(qt_u, d_model);
    const int64_t rb_d = clb_kq_row_nbytes(qt_d, d_ff);
    if (rb_g < 0) return (int)rb_g;
    if (rb_u < 0) return (int)rb_u;
    if (rb_d < 0) return (int)rb_d;
    if (n < 0 || d_model <= 0 || d_ff <= 0 || act < CLB_ACT_SILU || act > CLB_ACT_SWIGLU_OAI)
        return CLB_EINVAL;
    if (n == 0) return CLB_OK;
    if (!y || !scratch || !x || !gate || !up || !down) return CLB_EINVAL;
    const int64_t xrb_model = clb_q8k_row_nbytes(d_model), xrb_ff = clb_q8k_row_nbytes(d_ff);
    uint8_t *xq = malloc((size_t)(n * (xrb_model + xrb_ff)));
    if (!xq) { /* never stale outputs: NaN where y would be written */
        for (int64_t i = 0; i < n * d_model; i++) y[i] = NAN;
        return CLB_OK;
    }
    clb_quantize_q8_k(xq, x, n, d_model);
    const int nt = clb_threads_for(
        nthreads, (d_ff * (rb_g + rb_u) + d_model * rb_d) * ((n + 3) / 4), d_ff);
    const struct kqg_ffn j = {
        .fn = kqg_rows_for_isa(), .qt_g = qt_g, .qt_u = qt_u, .qt_d = qt_d, .act = act,
        .accumulate = accumulate, .alpha = alpha, .limit = limit, .xq = xq,
        .hq = xq + n * xrb_model, .y = y, .g = scratch, .u = scratch + n * d_ff,
        .gate_bias = gate_bias, .up_bias = up_bias, .down_bias = down_bias,
        .row_weight = row_weight, .gate = gate, .up = up, .down = down, .n = n,
        .d_model = d_model, .d_ff = d_ff, .rb_g = rb_g, .rb_u = rb_u, .rb_d = rb_d,
        .xrb_model = xrb_model, .xrb_ff = xrb_ff,
        .ch_ff = (clb_chunk_rows(d_ff, nt) + QK_K - 1) / QK_K * QK_K,
        .ch_model = clb_chunk_rows(d_model, nt),
    };
    clb_parallel_for((d_ff + j.ch_ff - 1) / j.ch_ff, kqg_ffn_up, (void *)&j, nt);
    clb_parallel_for((d_model + j.ch_model - 1) / j.ch_model, kqg_ffn_down, (void *)&j, nt);
    free(xq);
    return CLB_OK;
}
