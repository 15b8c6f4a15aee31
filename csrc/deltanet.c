/* deltanet.c — the gated delta rule's recurrent step (Gated DeltaNet linear attention).
 *
 * Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (arXiv:2412.06464), as
 * transformers implements it (torch_recurrent_gated_delta_rule, Qwen3-Next / Qwen3.5). The
 * state of one value head is S [dk, dv], row-major; each token costs two passes over it:
 *   pass 1: S *= exp(g);   m = S^T k            (rows i: S[i,:] *= decay, m += k[i] S[i,:])
 *   u = (v - m) * beta
 *   pass 2: S += k u^T;    o = S^T q            (rows i: S[i,:] += k[i] u, o += q[i] S[i,:])
 * Work is split by value head, so each head's state stays in L2 across all n tokens and the
 * result does not depend on the thread count. The SIMD bodies are arch/deltanet_simd.inc.
 */
#include <math.h>
#include <stdint.h>

#include "colibri.h"
#include "ops_internal.h"
#include "pool.h"

void ops_gdr_head_ref(float *out, float *s, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, int64_t n, int64_t dk, int64_t dv,
                      int64_t kstride, int64_t vstride, int64_t gstride) {
    float m[OPS_GDR_MAX_DV], u[OPS_GDR_MAX_DV];
    for (int64_t t = 0; t < n; t++, q += kstride, k += kstride, v += vstride, out += vstride) {
        const float decay = expf(g[t * gstride]), b = beta[t * gstride];
        for (int64_t j = 0; j < dv; j++) m[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                row[j] *= decay;
                m[j] += k[i] * row[j];
            }
        }
        for (int64_t j = 0; j < dv; j++) u[j] = (v[j] - m[j]) * b, out[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                row[j] += k[i] * u[j];
                out[j] += q[i] * row[j];
            }
        }
    }
}

struct gdr_job {
    float *out, *state;
    const float *q, *k, *v, *g, *beta;
    int64_t n, n_heads, group, dk, dv;
    int isa;
};

static void gdr_head(void *ctx, int64_t h) {
    const struct gdr_job *j = ctx;
    const int64_t hk = h / j->group, ks = (j->n_heads / j->group) * j->dk, vs = j->n_heads * j->dv;
    float *out = j->out + h * j->dv, *s = j->state + h * j->dk * j->dv;
    const float *q = j->q + hk * j->dk, *k = j->k + hk * j->dk, *v = j->v + h * j->dv;
    const float *g = j->g + h, *beta = j->beta + h;
    if (j->isa == CLB_ISA_AVX512)
        ops_gdr_head_avx512(out, s, q, k, v, g, beta, j->n, j->dk, j->dv, ks, vs, j->n_heads);
    else if (j->isa == CLB_ISA_AVX2)
        ops_gdr_head_avx2(out, s, q, k, v, g, beta, j->n, j->dk, j->dv, ks, vs, j->n_heads);
    else
        ops_gdr_head_ref(out, s, q, k, v, g, beta, j->n, j->dk, j->dv, ks, vs, j->n_heads);
}

int clb_gated_delta_rule(float *out, float *state, const float *q, const float *k,
                         const float *v, const float *g, const float *beta, int64_t n,
                         int64_t n_heads, int64_t n_k_heads, int64_t dk, int64_t dv,
                         int nthreads) {
    if (!out || !state || !q || !k || !v || !g || !beta || n < 0 || n_heads < 1 ||
        n_k_heads < 1 || n_heads % n_k_heads || dk < 1 || dv < 1 || dv > OPS_GDR_MAX_DV)
        return CLB_EINVAL;
    const struct gdr_job j = {out, state, q, k, v, g, beta, n, n_heads, n_heads / n_k_heads,
                              dk, dv, clb_isa_get()};
    /* threads pay off past ~1M multiply-adds (see clb_attention) */
    const int par = n * n_heads * dk * dv * 4 > 1000000;
    clb_parallel_for(n_heads, gdr_head, (void *)&j, par ? nthreads : 1);
    return CLB_OK;
}
