/* indexer.c — the DeepSeek Sparse Attention "lightning indexer" scores (DeepSeek-V3.2, GLM-5;
 * transformers DeepseekV32Indexer): for query i at position q_pos0 + i and past key t,
 *   out[i, t] = sum_h w[i, h] * max(0, scale * q[i, h, :] . k[t, :]),
 * keys t > q_pos0 + i (the future) get -inf. Work is split into tiles of one query row x
 * OPS_INDEX_KEYS keys, run in parallel on the kernel pool (decode has one row: the keys are
 * what splits). Each key row is loaded once for all heads of the query.
 */
#include <math.h>
#include <stdint.h>

#include "colibri.h"
#include "ops_internal.h"
#include "pool.h"

/* Scalar twin: per key, per head, the plain dot product, relu, weighted sum. */
void ops_index_tile_ref(const struct ops_index *a, int64_t i, int64_t t0, int64_t t1) {
    const float *q = a->q + i * a->n_heads * a->d, *w = a->w + i * a->n_heads;
    for (int64_t t = t0; t < t1; t++) {
        float s = 0.0f;
        for (int64_t h = 0; h < a->n_heads; h++) {
            float dot = 0.0f;
            for (int64_t e = 0; e < a->d; e++) {
                const float k = a->k_f16 ? ops_f16_to_f32(((const uint16_t *)a->k)[t * a->d + e])
                                         : ((const float *)a->k)[t * a->d + e];
                dot += q[h * a->d + e] * k;
            }
            dot *= a->scale;
            s += w[h] * (dot > 0.0f ? dot : 0.0f);
        }
        a->out[i * a->n_kv + t] = s;
    }
}

struct index_job {
    const struct ops_index *a;
    int isa;
    int64_t chunks; /* key chunks per query row */
};

static void index_tile(void *ctx, int64_t c) {
    const struct index_job *j = ctx;
    const struct ops_index *a = j->a;
    const int64_t i = c / j->chunks, t0 = c % j->chunks * OPS_INDEX_KEYS;
    const int64_t vis = a->q_pos0 + i + 1; /* keys 0 .. q_pos0 + i */
    const int64_t t1 = t0 + OPS_INDEX_KEYS < vis ? t0 + OPS_INDEX_KEYS : vis;
    for (int64_t t = t0 > vis ? t0 : vis; t < t0 + OPS_INDEX_KEYS && t < a->n_kv; t++)
        a->out[i * a->n_kv + t] = -INFINITY;
    if (t0 >= t1) return;
    if (j->isa == CLB_ISA_AVX512) ops_index_tile_avx512(a, i, t0, t1);
    else if (j->isa == CLB_ISA_AVX2) ops_index_tile_avx2(a, i, t0, t1);
    else ops_index_tile_ref(a, i, t0, t1);
}

int clb_index_scores(float *out, const float *q, const float *w, const void *k, int k_f16,
                     int64_t n_q, int64_t n_kv, int64_t q_pos0, int64_t n_heads, int64_t d,
                     float scale, int nthreads) {
    if (!out || !q || !w || !k || n_q < 0 || n_kv < 0 || q_pos0 < 0 || q_pos0 + n_q > n_kv ||
        n_heads < 1 || d < 1 || !isfinite(scale))
        return CLB_EINVAL;
    const struct ops_index a = {
        .out = out, .q = q, .w = w, .k = k, .k_f16 = !!k_f16, .n_kv = n_kv,
        .q_pos0 = q_pos0, .n_heads = n_heads, .d = d, .scale = scale,
    };
    const int64_t chunks = (n_kv + OPS_INDEX_KEYS - 1) / OPS_INDEX_KEYS;
    const struct index_job j = {&a, clb_isa_get(), chunks};
    /* threads pay off past ~1M multiply-adds (see attention.c) */
    const int par = n_q * n_heads * n_kv * d > 1000000;
    clb_parallel_for(n_q * chunks, index_tile, (void *)&j, par ? nthreads : 1);
    return CLB_OK;
}
