/* ffn.c — the fused expert FFN, straight from an expert record's gate/up/down bytes.
 *
 * One OpenMP region per call: threads take chunks of d_ff rows and compute gate and up for
 * them (x stays in cache between the two) and the activation; after one barrier, chunks of
 * d_model rows of down, whose epilogue adds the bias, scales by the routing weight and
 * accumulates into y. Chunks are scheduled dynamically (see clb_chunk_rows). Inner loops: the
 * matmul rows kernels (quant.h).
 *
 * scratch [n, 2 d_ff] f32: g = scratch[0 : n d_ff] as [n, d_ff], u = the rest; h overwrites g.
 */
#include <math.h>
#include <stdint.h>

#include "colibri.h"
#include "quant.h"

/* h = act(g, u) for columns [c0, c1) of n rows of stride ld. Formulas: colibri.h. */
static void ffn_act(float *g, const float *u, int64_t ld, int64_t n, int64_t c0, int64_t c1,
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

int clb_expert_ffn(int qtype, float *y, float *scratch, const float *x, const void *gate,
                   const void *up, const void *down, const float *gate_bias,
                   const float *up_bias, const float *down_bias, const float *row_weight,
                   int64_t n, int64_t d_model, int64_t d_ff, int act, float alpha, float limit,
                   int accumulate, int nthreads) {
    const int64_t rb_model = clb_row_nbytes(qtype, d_model), rb_ff = clb_row_nbytes(qtype, d_ff);
    if (rb_model < 0) return (int)rb_model;
    if (rb_ff < 0) return (int)rb_ff;
    if (n < 0 || d_model <= 0 || d_ff <= 0 || act < CLB_ACT_SILU || act > CLB_ACT_SWIGLU_OAI)
        return CLB_EINVAL;
    if (n == 0) return CLB_OK;
    if (!y || !scratch || !x || !gate || !up || !down) return CLB_EINVAL;
    const clb_mm_rows_fn fn = clb_mm_rows_for_isa();
    float *g = scratch, *u = scratch + n * d_ff;
    const int nt = clb_threads_for(nthreads, 3 * d_ff * rb_model * ((n + 3) / 4), d_ff);
    const int64_t ch_ff = clb_chunk_rows(d_ff, nt), ch_model = clb_chunk_rows(d_model, nt);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t f0 = 0; f0 < d_ff; f0 += ch_ff) {
            const int64_t f1 = f0 + ch_ff < d_ff ? f0 + ch_ff : d_ff;
            fn(qtype, g, d_ff, gate, rb_model, x, d_model, d_model, n, f0, f1, gate_bias, NULL, 0);
            fn(qtype, u, d_ff, up, rb_model, x, d_model, d_model, n, f0, f1, up_bias, NULL, 0);
            ffn_act(g, u, d_ff, n, f0, f1, act, alpha, limit);
        } /* implicit barrier: h complete */
#pragma omp for schedule(dynamic, 1)
        for (int64_t m0 = 0; m0 < d_model; m0 += ch_model)
            fn(qtype, y, d_model, down, rb_ff, g, d_ff, d_ff, n, m0,
               m0 + ch_model < d_model ? m0 + ch_model : d_model, down_bias, row_weight, accumulate);
    }
    return CLB_OK;
}
