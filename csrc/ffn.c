/* ffn.c — the fused expert FFN, straight from an expert record's gate/up/down bytes.
 *
 * Two parallel loops per call (pool.c): threads take chunks of d_ff rows and compute gate and
 * up for them (x stays in cache between the two) and the activation; when all are done,
 * chunks of d_model rows of down, whose epilogue adds the bias, scales by the routing weight
 * and accumulates into y. Chunks are claimed dynamically (see clb_chunk_rows). Inner loops:
 * the matmul rows kernels (quant.h).
 *
 * scratch [n, 2 d_ff] f32: g = scratch[0 : n d_ff] as [n, d_ff], u = the rest; h overwrites g.
 *
 * Q8_0 activations (qscratch != NULL): x is quantized to xq once before the first loop; each
 * chunk of the first loop quantizes its own columns of h into hq (chunks are whole 32-column
 * blocks then), and both loops use the integer-dot kernels (clb_mmq_rows_*).
 */
#include <math.h>
#include <stdint.h>

#include "colibri.h"
#include "pool.h"
#include "quant.h"
#include "kquants.h"
#include "ops_internal.h"

/* h = act(g, u) for columns [c0, c1) of n rows of stride ld. Formulas: colibri.h. */
static void ffn_act(float *g, const float *u, int64_t ld, int64_t n, int64_t c0, int64_t c1,
                    int act, float alpha, float limit) {
    if (act == CLB_ACT_SILU) { /* in SIMD (ops_simd.inc), the scalar formula below at SCALAR */
        const int isa = clb_isa_get();
        for (int64_t i = 0; i < n; i++) {
            float *gi = g + i * ld + c0;
            const float *ui = u + i * ld + c0;
            if (isa == CLB_ISA_AVX512) ops_swiglu_avx512(gi, ui, c1 - c0);
            else if (isa == CLB_ISA_AVX2) ops_swiglu_avx2(gi, ui, c1 - c0);
            else ops_swiglu_ref(gi, ui, c1 - c0);
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float *gi = g + i * ld;
        const float *ui = u + i * ld;
        for (int64_t c = c0; c < c1; c++) {
            float a = gi[c], b = ui[c];
            if (act == CLB_ACT_SILU) {
                a = a / (1.0f + expf(-a));
            } else if (act == CLB_ACT_GELU) {
                a = 0.5f * a * (1.0f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a)));
            } else if (act == CLB_ACT_SILU_CLAMP) { /* DeepSeek-V4 */
                a = a < limit ? a : limit;
                b = b < -limit ? -limit : b > limit ? limit : b;
                a = a / (1.0f + expf(-a));
            } else { /* CLB_ACT_SWIGLU_OAI (gpt-oss) */
                a = a < limit ? a : limit;
                b = b < -limit ? -limit : b > limit ? limit : b;
                a = (b + 1.0f) * (a / (1.0f + expf(-alpha * a)));
                b = 1.0f;
            }
            gi[c] = a * b;
        }
    }
}

struct ffn_job {
    /* per tensor (gate, up, down): rows kernels for its storage type and its qtype */
    clb_mm_rows_fn fn_g, fn_u, fn_d;
    clb_mmq_rows_fn qfn_g, qfn_u, qfn_d;
    int qt_g, qt_u, qt_d;
    uint8_t *xq, *hq; /* Q8_0 [n, xrb_model] / [n, xrb_ff], or NULL for f32 activations */
    int64_t xrb_model, xrb_ff;
    int act, accumulate, x16; /* x16: gate, up, down X16-packed (Q8_0 activations only) */
    float alpha, limit;
    float *y, *g, *u;  /* y [n, d_model]; g, u [n, d_ff] (h overwrites g) */
    const float *x, *gate_bias, *up_bias, *down_bias, *row_weight;
    const void *gate, *up, *down;
    int64_t n, d_model, d_ff, rb_g, rb_u, rb_d, ch_ff, ch_model;
};

/* Chunk c of the first loop: d_ff rows [c ch_ff, ...) of gate and up, then the activation. */
static void ffn_up_chunk(void *ctx, int64_t c) {
    const struct ffn_job *j = ctx;
    const int64_t f0 = c * j->ch_ff, f1 = f0 + j->ch_ff < j->d_ff ? f0 + j->ch_ff : j->d_ff;
    if (j->xq) { /* (qfn_* are clb_x16_rows for X16-packed tensors) */
        j->qfn_g(j->qt_g, j->g, j->d_ff, j->gate, j->rb_g, j->xq, j->xrb_model, j->d_model,
                 j->n, f0, f1, j->gate_bias, NULL, 0);
        j->qfn_u(j->qt_u, j->u, j->d_ff, j->up, j->rb_u, j->xq, j->xrb_model, j->d_model,
                 j->n, f0, f1, j->up_bias, NULL, 0);
    } else {
        j->fn_g(j->qt_g, j->g, j->d_ff, j->gate, j->rb_g, j->x, j->d_model, j->d_model, j->n,
                f0, f1, j->gate_bias, NULL, 0);
        j->fn_u(j->qt_u, j->u, j->d_ff, j->up, j->rb_u, j->x, j->d_model, j->d_model, j->n,
                f0, f1, j->up_bias, NULL, 0);
    }
    ffn_act(j->g, j->u, j->d_ff, j->n, f0, f1, j->act, j->alpha, j->limit);
    if (j->hq) /* f0, f1 are multiples of 32 here (or f1 = d_ff) */
        for (int64_t i = 0; i < j->n; i++)
            clb_quantize_q8_0_blocks(j->hq + i * j->xrb_ff + f0 / QK * sizeof(block_q8_0),
                                     j->g + i * j->d_ff + f0, (f1 - f0) / QK);
}

/* Chunk c of the second loop: d_model rows [c ch_model, ...) of down. */
static void ffn_down_chunk(void *ctx, int64_t c) {
    const struct ffn_job *j = ctx;
    const int64_t m0 = c * j->ch_model;
    const int64_t m1 = m0 + j->ch_model < j->d_model ? m0 + j->ch_model : j->d_model;
    if (j->hq)
        j->qfn_d(j->qt_d, j->y, j->d_model, j->down, j->rb_d, j->hq, j->xrb_ff, j->d_ff, j->n, m0,
                 m1, j->down_bias, j->row_weight, j->accumulate);
    else
        j->fn_d(j->qt_d, j->y, j->d_model, j->down, j->rb_d, j->g, j->d_ff, j->d_ff, j->n, m0, m1,
                j->down_bias, j->row_weight, j->accumulate);
}

int clb_expert_ffn(int qtype, float *y, float *scratch, const float *x, const void *gate,
                   const void *up, const void *down, const float *gate_bias,
                   const float *up_bias, const float *down_bias, const float *row_weight,
                   int64_t n, int64_t d_model, int64_t d_ff, int act, float alpha, float limit,
                   int accumulate, void *qscratch, int nthreads) {
    if (qscratch && qtype != CLB_QTYPE_Q4_0 && qtype != CLB_QTYPE_Q8_0 && !clb_is_kq(qtype))
        return CLB_EQTYPE;
    return clb_expert_ffn_mixed(qtype, qtype, qtype, y, scratch, x, gate, up, down, gate_bias,
                                up_bias, down_bias, row_weight, n, d_model, d_ff, act, alpha,
                                limit, accumulate, qscratch, nthreads);
}

static int ffn_mixed(int qt_g, int qt_u, int qt_d, float *y, float *scratch, const float *x,
                     const void *gate, const void *up, const void *down, const float *gate_bias,
                     const float *up_bias, const float *down_bias, const float *row_weight,
                     int64_t n, int64_t d_model, int64_t d_ff, int act, float alpha, float limit,
                     int accumulate, void *qscratch, int x16, int nthreads);

int clb_expert_ffn_mixed(int qt_g, int qt_u, int qt_d, float *y, float *scratch, const float *x,
                         const void *gate, const void *up, const void *down,
                         const float *gate_bias, const float *up_bias, const float *down_bias,
                         const float *row_weight, int64_t n, int64_t d_model, int64_t d_ff,
                         int act, float alpha, float limit, int accumulate, void *qscratch,
                         int nthreads) {
    return ffn_mixed(qt_g, qt_u, qt_d, y, scratch, x, gate, up, down, gate_bias, up_bias,
                     down_bias, row_weight, n, d_model, d_ff, act, alpha, limit, accumulate,
                     qscratch, 0, nthreads);
}

int clb_expert_ffn_x16(int qtype, float *y, float *scratch, const float *x, const void *gate,
                       const void *up, const void *down, const float *gate_bias,
                       const float *up_bias, const float *down_bias, const float *row_weight,
                       int64_t n, int64_t d_model, int64_t d_ff, int act, float alpha,
                       float limit, int accumulate, void *qscratch, int nthreads) {
    return ffn_mixed(qtype, qtype, qtype, y, scratch, x, gate, up, down, gate_bias, up_bias,
                     down_bias, row_weight, n, d_model, d_ff, act, alpha, limit, accumulate,
                     qscratch, 1, nthreads);
}

/* x16: the three tensors are X16-packed (clb_pack_x16): Q8_0 activations, Q4_0 / Q8_0 with
 * clb_x16_ok shapes (else CLB_EINVAL); the same bits as on GGML rows. */
static int ffn_mixed(int qt_g, int qt_u, int qt_d, float *y, float *scratch, const float *x,
                     const void *gate, const void *up, const void *down, const float *gate_bias,
                     const float *up_bias, const float *down_bias, const float *row_weight,
                     int64_t n, int64_t d_model, int64_t d_ff, int act, float alpha, float limit,
                     int accumulate, void *qscratch, int x16, int nthreads) {
    const int64_t rb_g = clb_row_nbytes(qt_g, d_model), rb_u = clb_row_nbytes(qt_u, d_model);
    const int64_t rb_d = clb_row_nbytes(qt_d, d_ff);
    if (rb_g < 0) return (int)rb_g;
    if (rb_u < 0) return (int)rb_u;
    if (rb_d < 0) return (int)rb_d;
    if (n < 0 || d_model <= 0 || d_ff <= 0 || act < CLB_ACT_SILU || act > CLB_ACT_SILU_CLAMP)
        return CLB_EINVAL;
    if (n == 0) return CLB_OK;
    if (qscratch && (!clb_q8_act_supported(qt_g) || !clb_q8_act_supported(qt_u) ||
                     !clb_q8_act_supported(qt_d)))
        return CLB_EQTYPE;
    if (qscratch && (d_model % QK || d_ff % QK)) return CLB_EBLOCK;
    if (x16 && (!qscratch || !clb_x16_ok(qt_g, d_ff, d_model) ||
                !clb_x16_ok(qt_u, d_ff, d_model) || !clb_x16_ok(qt_d, d_model, d_ff)))
        return CLB_EINVAL;
    if (!y || !scratch || !x || !gate || !up || !down) return CLB_EINVAL;
    const int nt = clb_threads_for(nthreads, (d_ff * (rb_g + rb_u) + d_model * rb_d) * ((n + 3) / 4), d_ff);
    const int64_t xrb_model = clb_row_nbytes(CLB_QTYPE_Q8_0, d_model);
    const int64_t xrb_ff = clb_row_nbytes(CLB_QTYPE_Q8_0, d_ff);
    int64_t ch_ff = clb_chunk_rows(d_ff, nt);
    uint8_t *xq = NULL, *hq = NULL;
    if (qscratch) {
        xq = qscratch;
        hq = xq + n * xrb_model;
        ch_ff = (ch_ff + QK - 1) / QK * QK;
        clb_quantize_q8_0_blocks(xq, x, n * d_model / QK); /* rows are whole blocks */
    }
    const struct ffn_job j = {
        .fn_g = clb_mm_rows_for(qt_g), .fn_u = clb_mm_rows_for(qt_u), .fn_d = clb_mm_rows_for(qt_d),
        .qfn_g = x16 ? clb_x16_rows : clb_mmq_rows_for(qt_g),
        .qfn_u = x16 ? clb_x16_rows : clb_mmq_rows_for(qt_u),
        .qfn_d = x16 ? clb_x16_rows : clb_mmq_rows_for(qt_d), .qt_g = qt_g, .qt_u = qt_u, .qt_d = qt_d,
        .xq = xq, .hq = hq, .xrb_model = xrb_model, .xrb_ff = xrb_ff, .act = act,
        .accumulate = accumulate, .x16 = x16, .alpha = alpha, .limit = limit, .y = y, .g = scratch,
        .u = scratch + n * d_ff, .x = x, .gate_bias = gate_bias, .up_bias = up_bias,
        .down_bias = down_bias, .row_weight = row_weight, .gate = gate, .up = up, .down = down,
        .n = n, .d_model = d_model, .d_ff = d_ff, .rb_g = rb_g, .rb_u = rb_u, .rb_d = rb_d,
        .ch_ff = ch_ff, .ch_model = clb_chunk_rows(d_model, nt),
    };
    clb_parallel_for((d_ff + j.ch_ff - 1) / j.ch_ff, ffn_up_chunk, (void *)&j, nt);
    clb_parallel_for((d_model + j.ch_model - 1) / j.ch_model, ffn_down_chunk, (void *)&j, nt);
    return CLB_OK;
}

int clb_expert_ffn_group(int n_experts, int qt_g, int qt_u, int qt_d, int q8k, int x16,
                         float *y, float *scratch, const float *x, const void *const *gate,
                         const void *const *up, const void *const *down,
                         const float *const *gate_bias, const float *const *up_bias,
                         const float *const *down_bias, const float *row_weight,
                         const int64_t *row_off, int64_t d_model, int64_t d_ff, int act,
                         float alpha, float limit, void *qscratch, int nthreads) {
    if (n_experts < 0 || !row_off || (q8k && x16)) return CLB_EINVAL;
    if (n_experts == 0) return CLB_OK;
    if (!gate || !up || !down) return CLB_EINVAL;
    for (int e = 0; e < n_experts; e++)
        if (row_off[e + 1] < row_off[e] || row_off[e] < 0) return CLB_EINVAL;
    for (int e = 0; e < n_experts; e++) {
        const int64_t r0 = row_off[e], n = row_off[e + 1] - r0;
        if (n == 0) continue;
        const float *gb = gate_bias ? gate_bias[e] : NULL, *ub = up_bias ? up_bias[e] : NULL;
        const float *db = down_bias ? down_bias[e] : NULL;
        const float *rw = row_weight ? row_weight + r0 : NULL;
        int rc = q8k ? clb_expert_ffn_q8k(qt_g, qt_u, qt_d, y + r0 * d_model, scratch,
                                          x + r0 * d_model, gate[e], up[e], down[e], gb, ub, db,
                                          rw, n, d_model, d_ff, act, alpha, limit, 0, nthreads)
                     : ffn_mixed(qt_g, qt_u, qt_d, y + r0 * d_model, scratch,
                                 x + r0 * d_model, gate[e], up[e], down[e], gb, ub, db, rw, n,
                                 d_model, d_ff, act, alpha, limit, 0, qscratch, x16, nthreads);
        if (rc) return rc;
    }
    return CLB_OK;
}
