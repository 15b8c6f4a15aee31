/* kquants_gemm.c — Q4_K / Q5_K / Q6_K matmul on Q8_K activations (see kquants_gemm.h for the
 * formats and the one computation): ggml's Q8_K quantizer, the scalar twin, ISA dispatch and
 * threading over chunks of weight rows. The SIMD GEMM is arch/kquants_gemm.inc.
 */
#include <math.h>
#include <stdint.h>
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
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return clb_kqg_rows_avx512;
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
