/* ops_internal.h — private to ops.c, attention.c and arch/ops_*.c (not part of the C API).
 *
 * Each small op has three bodies: *_ref (scalar, ops.c / attention.c), *_avx2 and *_avx512
 * (arch/ops_simd.inc compiled twice). The public clb_* functions in ops.c / attention.c check
 * arguments, then branch on clb_isa_get().
 */
#ifndef COLIBRI_OPS_INTERNAL_H
#define COLIBRI_OPS_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* IEEE half -> float, exact (scalar twin of F16C's vcvtph2ps). */
static inline float ops_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0x1f) bits = sign | 0x7f800000u | (m << 13);          /* inf, nan */
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);       /* normal */
    else if (!m) bits = sign;                                      /* +-0 */
    else { float f = ldexpf((float)m, -24); return sign ? -f : f; } /* subnormal */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One attention call's arguments (see clb_attention in colibri.h for meanings and layouts). */
struct ops_attn {
    float *out;            /* [n_q, n_heads, dv] */
    const float *q;        /* [n_q, n_heads, dk] */
    const void *k, *v;     /* [n_ctx, n_kv_heads, dk|dv], f32 or f16 */
    const float *sinks;    /* [n_heads] or NULL */
    int kv_f16;
    int64_t q_pos0, n_heads, n_kv_heads, group, dk, dv, window;
    float scale;
};

/* An attention tile is nr consecutive query rows x nh query heads of one KV group, at most
 * OPS_ATTN_HEADS heads and OPS_ATTN_ENTRIES (row, head) pairs: each K/V row it loads serves
 * all of them. Keys are scored OPS_ATTN_KEYS at a time (scores on the stack). */
#define OPS_ATTN_HEADS 8
#define OPS_ATTN_ENTRIES 128
#define OPS_ATTN_KEYS 32
/* values a block of ops_logsumexp sums in f32 lanes before adding the block to an f64 sum */
#define OPS_LSE_BLOCK 256

/* RoPE on one token's heads, for frequencies [i0, i0 + ni):
 *   NEOX: c, s [ni] = cos, sin; pairs (x[i], x[i + half]).
 *   INTERLEAVED: c, s [2 ni] = (cos, cos), (-sin, +sin) per pair; pairs (x[2i], x[2i+1]). */
#define OPS_DECLARE(sfx)                                                                     \
    void ops_rmsnorm_##sfx(float *y, const float *x, const float *w, int64_t n, int64_t d,   \
                           float eps);                                                       \
    void ops_rope_##sfx(float *x, int64_t n_heads, int64_t head_dim, int64_t half,          \
                        int64_t i0, int64_t ni, const float *c, const float *s, int mode);   \
    void ops_softmax_##sfx(float *x, int64_t n, int64_t d);                                 \
    void ops_logsumexp_##sfx(double *out, const float *x, int64_t n, int64_t d);           \
    void ops_silu_##sfx(float *y, const float *x, int64_t n);                               \
    void ops_swiglu_##sfx(float *g, const float *u, int64_t n);                             \
    void ops_gelu_##sfx(float *y, const float *x, int64_t n);                               \
    void ops_attn_tile_##sfx(const struct ops_attn *a, int64_t i0, int64_t nr, int64_t h0,   \
                             int64_t nh);

OPS_DECLARE(ref)
OPS_DECLARE(avx2)
OPS_DECLARE(avx512)

/* One DSA indexer call's arguments (see clb_index_scores in colibri.h); a tile scores keys
 * [t0, t1) for query row i. */
struct ops_index {
    float *out;         /* [n_q, n_kv] */
    const float *q, *w; /* [n_q, n_heads, d], [n_q, n_heads] */
    const void *k;      /* [n_ctx, d], f32 or f16 */
    int k_f16;
    int64_t n_kv, q_pos0, n_heads, d;
    float scale;
};
#define OPS_INDEX_KEYS 64
void ops_index_tile_ref(const struct ops_index *a, int64_t i, int64_t t0, int64_t t1);
void ops_index_tile_avx2(const struct ops_index *a, int64_t i, int64_t t0, int64_t t1);
void ops_index_tile_avx512(const struct ops_index *a, int64_t i, int64_t t0, int64_t t1);
/* Gated delta rule on one value head over n tokens (deltanet.c, arch/deltanet_simd.inc): see
 * clb_gated_delta_rule; q, k point at the head's key head in token 0 (stride kstride floats
 * between tokens), v, out at the value head (stride vstride), g, beta at the head (stride
 * gstride); s is the head's [dk, dv] state. */
#define OPS_GDR_MAX_DV 1024
#define OPS_GDR_DECLARE(sfx)                                                                 \
    void ops_gdr_head_##sfx(float *out, float *s, const float *q, const float *k,           \
                            const float *v, const float *g, const float *beta, int64_t n,    \
                            int64_t dk, int64_t dv, int64_t kstride, int64_t vstride,        \
                            int64_t gstride);
OPS_GDR_DECLARE(ref)
OPS_GDR_DECLARE(avx2)
OPS_GDR_DECLARE(avx512)

#endif
