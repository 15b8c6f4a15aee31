/* attention.c — grouped-query attention over a KV cache, decode (n_q = 1) and prefill (n_q > 1).
 *
 * Work is split into tiles of a few query rows x up to OPS_ATTN_HEADS query heads of one KV
 * group, so each key/value row is loaded once for all of them. Each (row, head) runs an online
 * (flash-style) softmax over its visible keys j in [lo, p], p = q_pos0 + i,
 * lo = max(0, p - window + 1) (HF's sliding_window_overlay: kv_idx > q_idx - window):
 *   m = running max, l = running sum of exp(s - m), o = running sum of exp(s - m) v;
 *   a new max m' rescales l and o by exp(m - m'); finally o /= l.
 * A sink (gpt-oss) is a logit with no value: it starts the recurrence as m = sink, l = 1, so it
 * enters the denominator only, exactly as HF's eager_attention_forward (softmax over
 * [scores, sink], sink column dropped). o accumulates directly in out: no scratch memory.
 * Tiles run in parallel on the kernel pool (pool.c; claimed dynamically: causal rows differ
 * in length).
 */
#include <math.h>
#include <stdint.h>

#include "colibri.h"
#include "ops_internal.h"
#include "pool.h"

/* Element e of cache row (position j, kv head g) of a [n_ctx, n_kv_heads, d] cache. */
static inline float kv_at(const void *cache, int f16, int64_t row, int64_t e) {
    return f16 ? ops_f16_to_f32(((const uint16_t *)cache)[row + e])
               : ((const float *)cache)[row + e];
}

/* Scalar twin: per row, per head, per key, the textbook online softmax. */
void ops_attn_tile_ref(const struct ops_attn *a, int64_t i0, int64_t nr, int64_t h0, int64_t nh) {
    const int64_t g = h0 / a->group;
    for (int64_t i = i0; i < i0 + nr; i++) {
        const int64_t p = a->q_pos0 + i;
        const int64_t lo = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
        for (int64_t h = h0; h < h0 + nh; h++) {
            const float *q = a->q + (i * a->n_heads + h) * a->dk;
            float *o = a->out + (i * a->n_heads + h) * a->dv;
            float m = a->sinks ? a->sinks[h] : -INFINITY, l = a->sinks ? 1.0f : 0.0f;
            for (int64_t e = 0; e < a->dv; e++) o[e] = 0.0f;
            for (int64_t j = lo; j <= p; j++) {
                const int64_t kr = (j * a->n_kv_heads + g) * a->dk;
                const int64_t vr = (j * a->n_kv_heads + g) * a->dv;
                float s = 0.0f;
                for (int64_t e = 0; e < a->dk; e++) s += q[e] * kv_at(a->k, a->kv_f16, kr, e);
                s *= a->scale;
                const float m1 = s > m ? s : m, c = expf(m - m1), w = expf(s - m1);
                l = l * c + w;
                for (int64_t e = 0; e < a->dv; e++)
                    o[e] = o[e] * c + w * kv_at(a->v, a->kv_f16, vr, e);
                m = m1;
            }
            for (int64_t e = 0; e < a->dv; e++) o[e] /= l;
        }
    }
}

struct attn_job {
    const struct ops_attn *a;
    int isa;
    int64_t n_q, rblocks, chunks, rows, heads;
};

/* Tile t = (kv head g, chunk c of the group's heads, block r of rows), rows innermost so
 * that consecutive tiles reuse one head's K/V rows from cache during prefill. */
static void attn_tile(void *ctx, int64_t t) {
    const struct attn_job *j = ctx;
    const struct ops_attn *a = j->a;
    const int64_t r = t % j->rblocks, c = t / j->rblocks % j->chunks;
    const int64_t g = t / j->rblocks / j->chunks;
    const int64_t i0 = r * j->rows, nr = j->n_q - i0 < j->rows ? j->n_q - i0 : j->rows;
    const int64_t h0 = g * a->group + c * OPS_ATTN_HEADS;
    const int64_t left = a->group - c * OPS_ATTN_HEADS, nh = left < j->heads ? left : j->heads;
    if (j->isa == CLB_ISA_AVX512) ops_attn_tile_avx512(a, i0, nr, h0, nh);
    else if (j->isa == CLB_ISA_AVX2) ops_attn_tile_avx2(a, i0, nr, h0, nh);
    else ops_attn_tile_ref(a, i0, nr, h0, nh);
}

int clb_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                  int kv_f16, int64_t n_q, int64_t n_kv, int64_t q_pos0, int64_t n_heads,
                  int64_t n_kv_heads, int64_t dk, int64_t dv, float scale, int64_t window,
                  const float *sinks, int nthreads) {
    if (!out || !q || !k_cache || !v_cache || n_q < 0 || n_kv < 0 || q_pos0 < 0 ||
        q_pos0 + n_q > n_kv || n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads ||
        dk < 1 || dv < 1 || window < 0 || !isfinite(scale))
        return CLB_EINVAL;
    const struct ops_attn a = {
        .out = out, .q = q, .k = k_cache, .v = v_cache, .sinks = sinks, .kv_f16 = !!kv_f16,
        .q_pos0 = q_pos0, .n_heads = n_heads, .n_kv_heads = n_kv_heads,
        .group = n_heads / n_kv_heads, .dk = dk, .dv = dv, .window = window, .scale = scale,
    };
    /* tiles: (kv head g, chunk c of the group's heads, block r of rows), see attn_tile */
    const int64_t chunks = (a.group + OPS_ATTN_HEADS - 1) / OPS_ATTN_HEADS;
    const int64_t heads = a.group < OPS_ATTN_HEADS ? a.group : OPS_ATTN_HEADS;
    const int64_t rows = OPS_ATTN_ENTRIES / heads, rblocks = (n_q + rows - 1) / rows;
    const struct attn_job j = {&a, clb_isa_get(), n_q, rblocks, chunks, rows, heads};
    /* threads pay off past ~100 us of work (~1M multiply-adds); below that waking them costs
     * more than it saves */
    const int64_t ctx = window > 0 && window < q_pos0 + n_q ? window : q_pos0 + n_q;
    const int par = n_q * n_heads * ctx * (dk + dv) > 1000000;
    clb_parallel_for(n_kv_heads * chunks * rblocks, attn_tile, (void *)&j, par ? nthreads : 1);
    return CLB_OK;
}
