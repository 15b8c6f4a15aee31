/* mla.c — multi-head latent attention's kv_b_proj read in its storage type (no f32 copy).
 *
 * DeepSeek-V2 (arXiv:2405.04434, section 2.1.2) absorbs kv_b_proj into the query and the output:
 * with W = kv_b_proj [n_heads * (nope + dv), rank], head h's rows being W_UK_h [nope, rank] then
 * W_UV_h [dv, rank], the absorbed query is q_abs_h = W_UK_h^T q_nope_h and the head's output is
 * W_UV_h o_h for the attention output o_h over latents. clb_mla_absorb_q and clb_mla_values
 * (colibri.h) compute both for every head and token in one call, threads over heads.
 * Inner loops: the transposed row loop clb_mla_xw_* (scalar twin here, arch/mla_simd.inc for
 * AVX2 / AVX-512) and, for the values, the matmul row loops (clb_mm_rows_* / clb_mmq_rows_*).
 */
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "mla.h"
#include "pool.h"
#include "quant.h"

/* One 32-weight block (or 32 float elements) -> f32, gguf's arithmetic (as quant.c). */
static void mla_decode_block(int qtype, float *y, const uint8_t *blk) {
    switch (qtype) {
    case CLB_QTYPE_Q4_0: {
        const float d = clb_f16_to_f32(clb_load_u16(blk));
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)((blk[2 + j] & 15) - 8);
            y[j + QK / 2] = d * (float)((blk[2 + j] >> 4) - 8);
        }
        break;
    }
    case CLB_QTYPE_Q4_1: {
        const float d = clb_f16_to_f32(clb_load_u16(blk)), m = clb_f16_to_f32(clb_load_u16(blk + 2));
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)(blk[4 + j] & 15) + m;
            y[j + QK / 2] = d * (float)(blk[4 + j] >> 4) + m;
        }
        break;
    }
    case CLB_QTYPE_Q8_0: {
        const float d = clb_f16_to_f32(clb_load_u16(blk));
        for (int j = 0; j < QK; j++) y[j] = (float)(int8_t)blk[2 + j] * d;
        break;
    }
    case CLB_QTYPE_F32: memcpy(y, blk, QK * 4); break;
    case CLB_QTYPE_F16:
        for (int j = 0; j < QK; j++) y[j] = clb_f16_to_f32(clb_load_u16(blk + 2 * j));
        break;
    case CLB_QTYPE_BF16:
        for (int j = 0; j < QK; j++) y[j] = clb_bf16_to_f32(clb_load_u16(blk + 2 * j));
        break;
    default: break;
    }
}

static float mla_elem(int qtype, const uint8_t *row, int64_t c) {
    if (qtype == CLB_QTYPE_F32) { float v; memcpy(&v, row + 4 * c, 4); return v; }
    if (qtype == CLB_QTYPE_F16) return clb_f16_to_f32(clb_load_u16(row + 2 * c));
    return clb_bf16_to_f32(clb_load_u16(row + 2 * c));
}

/* Scalar twin: y = 0, then per weight row j and block, y += x[j] * w (j order). */
void clb_mla_xw_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                    const float *x, int64_t ldx, int64_t nrows, int64_t cols, int64_t n) {
    int64_t e = 1, bb = 1;
    clb_qtype_block(qtype, &e, &bb);
    bb *= QK / e; /* bytes per 32 weights */
    const int64_t nblk = cols / QK, tail = cols % QK;
    for (int64_t i = 0; i < n; i++) memset(y + i * ldy, 0, (size_t)cols * sizeof(float));
    float wb[QK];
    for (int64_t j = 0; j < nrows; j++) {
        const uint8_t *row = w + j * row_nbytes;
        for (int64_t b = 0; b < nblk; b++) {
            mla_decode_block(qtype, wb, row + b * bb);
            for (int64_t i = 0; i < n; i++) {
                const float s = x[i * ldx + j];
                float *yi = y + i * ldy + b * QK;
                for (int k = 0; k < QK; k++) yi[k] += s * wb[k];
            }
        }
        for (int64_t c = nblk * QK; c < nblk * QK + tail; c++) {
            const float wv = mla_elem(qtype, row, c);
            for (int64_t i = 0; i < n; i++) y[i * ldy + c] += x[i * ldx + j] * wv;
        }
    }
}

static clb_mla_xw_fn mla_xw_for_isa(void) {
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return clb_mla_xw_avx512;
    case CLB_ISA_AVX2: return clb_mla_xw_avx2;
    default: return clb_mla_xw_ref;
    }
}

enum { MLA_ABSORB, MLA_VALUES, MLA_VALUES_Q8 };

struct mla_job {
    int kind, qtype;
    float *y;
    const uint8_t *w, *xq;
    const float *x;
    int64_t n, heads, nope, dv, rank, dx, dy, rb, xrb;
    clb_mla_xw_fn xw;
    clb_mm_rows_fn mm;
    clb_mmq_rows_fn mmq;
};

/* Chunk h = head h. */
static void mla_head(void *ctx, int64_t h) {
    const struct mla_job *j = ctx;
    const int64_t H = j->heads, per = j->nope + j->dv;
    const uint8_t *wk = j->w + h * per * j->rb, *wv = wk + j->nope * j->rb;
    switch (j->kind) {
    case MLA_ABSORB:
        j->xw(j->qtype, j->y + h * j->dy, H * j->dy, wk, j->rb, j->x + h * j->dx, H * j->dx,
              j->nope, j->rank, j->n);
        break;
    case MLA_VALUES:
        j->mm(j->qtype, j->y + h * j->dv, H * j->dv, wv, j->rb, j->x + h * j->dx, H * j->dx,
              j->rank, j->n, 0, j->dv, NULL, NULL, 0);
        break;
    default:
        j->mmq(j->qtype, j->y + h * j->dv, H * j->dv, wv, j->rb, j->xq + h * j->xrb,
               H * j->xrb, j->rank, j->n, 0, j->dv, NULL, NULL, 0);
        break;
    }
}

static int mla_run(struct mla_job *j, int nthreads) {
    if (j->n < 0 || j->heads < 0 || j->nope < 0 || j->dv < 0 || j->rank < 0) return CLB_EINVAL;
    const int64_t rb = clb_row_nbytes(j->qtype, j->rank);
    if (rb < 0) return (int)rb;
    j->rb = rb;
    if (j->n == 0 || j->heads == 0 || j->rank == 0) return CLB_OK;
    if (!j->y || !j->w || (!j->x && !j->xq)) return CLB_EINVAL;
    const int64_t rows = j->kind == MLA_ABSORB ? j->nope : j->dv;
    const int nt = clb_threads_for(nthreads, j->heads * rows * rb * ((j->n + 3) / 4), j->heads);
    if (nt == 1)
        for (int64_t h = 0; h < j->heads; h++) mla_head(j, h);
    else
        clb_parallel_for(j->heads, mla_head, j, nt);
    return CLB_OK;
}

int clb_mla_absorb_q(int qtype, float *q_abs, const void *kv_b, const float *q, int64_t n,
                     int64_t n_heads, int64_t nope, int64_t dv, int64_t rank, int64_t dq,
                     int64_t dout, int nthreads) {
    if (dq < nope || dout < rank) return CLB_EINVAL;
    struct mla_job j = {.kind = MLA_ABSORB, .qtype = qtype, .y = q_abs, .w = kv_b, .x = q,
                        .n = n, .heads = n_heads, .nope = nope, .dv = dv, .rank = rank,
                        .dx = dq, .dy = dout, .xw = mla_xw_for_isa()};
    return mla_run(&j, nthreads);
}

int clb_mla_values(int qtype, float *out, const void *kv_b, const float *lat, int64_t n,
                   int64_t n_heads, int64_t nope, int64_t dv, int64_t rank, int64_t dl,
                   int nthreads) {
    if (dl < rank) return CLB_EINVAL;
    struct mla_job j = {.kind = MLA_VALUES, .qtype = qtype, .y = out, .w = kv_b, .x = lat,
                        .n = n, .heads = n_heads, .nope = nope, .dv = dv, .rank = rank, .dx = dl,
                        .mm = clb_mm_rows_for_isa()};
    return mla_run(&j, nthreads);
}

int clb_mla_values_q8(int qtype, float *out, const void *kv_b, const void *xq, int64_t n,
                      int64_t n_heads, int64_t nope, int64_t dv, int64_t rank, int nthreads) {
    if (qtype != CLB_QTYPE_Q4_0 && qtype != CLB_QTYPE_Q8_0) return CLB_EQTYPE;
    const int64_t xrb = clb_row_nbytes(CLB_QTYPE_Q8_0, rank);
    if (xrb < 0) return (int)xrb;
    struct mla_job j = {.kind = MLA_VALUES_Q8, .qtype = qtype, .y = out, .w = kv_b, .xq = xq,
                        .n = n, .heads = n_heads, .nope = nope, .dv = dv, .rank = rank,
                        .xrb = xrb, .mmq = clb_mmq_rows_for_isa()};
    return mla_run(&j, nthreads);
}
