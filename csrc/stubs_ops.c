/* stubs_ops.c — TEMPORARY: placeholders for the small ops and attention so the library links
 * while ops.c / attention.c are being written. Delete this file when they exist. */
#include <stdint.h>

#include "colibri.h"

int clb_rmsnorm(float *y, const float *x, const float *w, int64_t n, int64_t d, float eps) {
    (void)y; (void)x; (void)w; (void)n; (void)d; (void)eps;
    return CLB_EINVAL;
}
int clb_rope(float *x, const int32_t *pos, const float *inv_freq, int64_t n_tokens,
             int64_t n_heads, int64_t head_dim, int64_t rot_dim, float mscale, int mode) {
    (void)x; (void)pos; (void)inv_freq; (void)n_tokens; (void)n_heads; (void)head_dim;
    (void)rot_dim; (void)mscale; (void)mode;
    return CLB_EINVAL;
}
int clb_softmax(float *x, int64_t n, int64_t d) { (void)x; (void)n; (void)d; return CLB_EINVAL; }
int clb_topk(int32_t *idx, float *val, const float *x, int64_t n, int64_t d, int64_t k) {
    (void)idx; (void)val; (void)x; (void)n; (void)d; (void)k;
    return CLB_EINVAL;
}
int clb_silu(float *y, const float *x, int64_t n) { (void)y; (void)x; (void)n; return CLB_EINVAL; }
int clb_gelu(float *y, const float *x, int64_t n) { (void)y; (void)x; (void)n; return CLB_EINVAL; }
int clb_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                  int kv_f16, int64_t n_q, int64_t n_kv, int64_t q_pos0, int64_t n_heads,
                  int64_t n_kv_heads, int64_t dk, int64_t dv, float scale, int64_t window,
                  const float *sinks, int nthreads) {
    (void)out; (void)q; (void)k_cache; (void)v_cache; (void)kv_f16; (void)n_q; (void)n_kv;
    (void)q_pos0; (void)n_heads; (void)n_kv_heads; (void)dk; (void)dv; (void)scale;
    (void)window; (void)sinks; (void)nthreads;
    return CLB_EINVAL;
}
