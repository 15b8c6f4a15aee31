/* ops.c — small ops: RMSNorm, RoPE, softmax, top-k, SiLU, GELU (tanh).
 *
 * clb_* check their arguments and branch on clb_isa_get() to the scalar *_ref twins below or
 * to the SIMD bodies in arch/ops_simd.inc. All math is f32, like Hugging Face's modules
 * (LlamaRMSNorm upcasts to f32, rotary cos/sin are computed in f32).
 */
#include <math.h>
#include <stdint.h>

#include "colibri.h"
#include "ops_internal.h"
#include "pool.h"

#define DISPATCH(fn, ...)                                                                    \
    do {                                                                                     \
        switch (clb_isa_get()) {                                                             \
        case CLB_ISA_AVX512: fn##_avx512(__VA_ARGS__); break;                                \
        case CLB_ISA_AVX2: fn##_avx2(__VA_ARGS__); break;                                    \
        default: fn##_ref(__VA_ARGS__);                                                      \
        }                                                                                    \
    } while (0)

/* ---- scalar twins ------------------------------------------------------------------------ */

/* y[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, the product in HF's order. */
void ops_rmsnorm_ref(float *y, const float *x, const float *w, int64_t n, int64_t d,
                     float eps) {
    for (int64_t r = 0; r < n; r++, x += d, y += d) {
        float ss = 0.0f;
        for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) y[i] = x[i] * inv * (w ? w[i] : 1.0f);
    }
}

void ops_rope_ref(float *x, int64_t n_heads, int64_t head_dim, int64_t half, int64_t i0,
                  int64_t ni, const float *c, const float *s, int mode) {
    for (int64_t h = 0; h < n_heads; h++) {
        float *xh = x + h * head_dim;
        for (int64_t j = 0; j < ni; j++) {
            float *p0, *p1, cj, sj;
            if (mode == CLB_ROPE_NEOX) {
                p0 = xh + i0 + j, p1 = p0 + half, cj = c[j], sj = s[j];
            } else {
                p0 = xh + 2 * (i0 + j), p1 = p0 + 1, cj = c[2 * j], sj = s[2 * j + 1];
            }
            const float a = *p0, b = *p1;
            *p0 = a * cj - b * sj;
            *p1 = b * cj + a * sj;
        }
    }
}

void ops_softmax_ref(float *x, int64_t n, int64_t d) {
    for (int64_t r = 0; r < n; r++, x += d) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < d; i++) mx = x[i] > mx ? x[i] : mx;
        for (int64_t i = 0; i < d; i++) sum += (x[i] = expf(x[i] - mx));
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < d; i++) x[i] *= inv;
    }
}

void ops_logsumexp_ref(double *out, const float *x, int64_t n, int64_t d) {
    for (int64_t r = 0; r < n; r++, x += d) {
        float mx = -INFINITY;
        for (int64_t i = 0; i < d; i++) mx = x[i] > mx ? x[i] : mx;
        double sum = 0.0;
        for (int64_t i = 0; i < d; i++) sum += (double)expf(x[i] - mx);
        out[r] = (double)mx + log(sum);
    }
}

void ops_silu_ref(float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] / (1.0f + expf(-x[i]));
}

/* g = silu(g) * u: the SwiGLU of an expert FFN's gate and up rows (ffn.c). */
void ops_swiglu_ref(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
void ops_gelu_ref(float *y, const float *x, int64_t n) {
    const float k = 0.7978845608028654f;
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        y[i] = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
    }
}

/* ---- public entry points ------------------------------------------------------------------ */

int clb_rmsnorm(float *y, const float *x, const float *w, int64_t n, int64_t d, float eps) {
    if (!y || !x || n < 0 || d < 1 || !(eps >= 0.0f)) return CLB_EINVAL;
    DISPATCH(ops_rmsnorm, y, x, w, n, d, eps);
    return CLB_OK;
}

/* cos/sin for a chunk of frequencies are computed once per token (f32, like HF's rotary
 * embedding: angle = float(pos) * inv_freq) and applied to every head. */
int clb_rope(float *x, const int32_t *pos, const float *inv_freq, int64_t n_tokens,
             int64_t n_heads, int64_t head_dim, int64_t rot_dim, float mscale, int mode) {
    if (!x || !pos || !inv_freq || n_tokens < 0 || n_heads < 0 || rot_dim < 2 || rot_dim % 2 ||
        rot_dim > head_dim || (mode != CLB_ROPE_NEOX && mode != CLB_ROPE_INTERLEAVED))
        return CLB_EINVAL;
    enum { CHUNK = 64 };
    float c[2 * CHUNK], s[2 * CHUNK];
    const int64_t half = rot_dim / 2;
    const int isa = clb_isa_get();
    for (int64_t t = 0; t < n_tokens; t++) {
        float *xt = x + t * n_heads * head_dim;
        for (int64_t i0 = 0; i0 < half; i0 += CHUNK) {
            const int64_t ni = half - i0 < CHUNK ? half - i0 : CHUNK;
            for (int64_t j = 0; j < ni; j++) {
                const float theta = (float)pos[t] * inv_freq[i0 + j];
                const float cj = cosf(theta) * mscale, sj = sinf(theta) * mscale;
                if (mode == CLB_ROPE_NEOX) c[j] = cj, s[j] = sj;
                else c[2 * j] = c[2 * j + 1] = cj, s[2 * j] = -sj, s[2 * j + 1] = sj;
            }
            if (isa == CLB_ISA_AVX512)
                ops_rope_avx512(xt, n_heads, head_dim, half, i0, ni, c, s, mode);
            else if (isa == CLB_ISA_AVX2)
                ops_rope_avx2(xt, n_heads, head_dim, half, i0, ni, c, s, mode);
            else
                ops_rope_ref(xt, n_heads, head_dim, half, i0, ni, c, s, mode);
        }
    }
    return CLB_OK;
}

int clb_softmax(float *x, int64_t n, int64_t d) {
    if (!x || n < 0 || d < 1) return CLB_EINVAL;
    DISPATCH(ops_softmax, x, n, d);
    return CLB_OK;
}

struct lse_job {
    double *out;
    const float *x;
    int64_t n, d, rows;
};

static void lse_chunk(void *ctx, int64_t c) {
    const struct lse_job *j = ctx;
    const int64_t r0 = c * j->rows, nr = r0 + j->rows < j->n ? j->rows : j->n - r0;
    DISPATCH(ops_logsumexp, j->out + r0, j->x + r0 * j->d, nr, j->d);
}

int clb_logsumexp(double *out, const float *x, int64_t n, int64_t d, int nthreads) {
    if (!out || !x || n < 0 || d < 1) return CLB_EINVAL;
    /* chunks of ~64 KiB of x, at least one row */
    int64_t rows = (64 << 10) / (d * 4);
    if (rows < 1) rows = 1;
    struct lse_job j = {out, x, n, d, rows};
    clb_parallel_for((n + rows - 1) / rows, lse_chunk, &j, n * d >= (1 << 16) ? nthreads : 1);
    return CLB_OK;
}

int clb_silu(float *y, const float *x, int64_t n) {
    if (!y || !x || n < 0) return CLB_EINVAL;
    DISPATCH(ops_silu, y, x, n);
    return CLB_OK;
}

int clb_gelu(float *y, const float *x, int64_t n) {
    if (!y || !x || n < 0) return CLB_EINVAL;
    DISPATCH(ops_gelu, y, x, n);
    return CLB_OK;
}

/* a ranks before b: larger value, NaN last (like numpy's argsort of -x); equal values keep
 * index order because candidates arrive in index order and only strictly better ones move. */
static inline int topk_before(float a, float b) { return a > b || (b != b && a == a); }

/* Top-k by insertion into the sorted prefix: O(d) compares when k << d (routers: k 1-8 of
 * 8-256, samplers: k <= ~100 of a vocabulary). Scalar only: SIMD buys nothing at these sizes
 * and would complicate the exact tie rule. */
int clb_topk(int32_t *idx, float *val, const float *x, int64_t n, int64_t d, int64_t k) {
    if (!idx || !val || !x || n < 0 || d < 1 || d > INT32_MAX || k < 0 || k > d) return CLB_EINVAL;
    for (int64_t r = 0; r < n; r++, x += d, idx += k, val += k) {
        int64_t len = 0;
        for (int64_t i = 0; i < d; i++) {
            const float v = x[i];
            if (len == k && (k == 0 || !topk_before(v, val[k - 1]))) continue;
            int64_t p = len < k ? len++ : k - 1;
            for (; p > 0 && topk_before(v, val[p - 1]); p--)
                val[p] = val[p - 1], idx[p] = idx[p - 1];
            val[p] = v, idx[p] = (int32_t)i;
        }
    }
    return CLB_OK;
}
