/* stubs_kernels.c — TEMPORARY: placeholders for quant/matmul/ffn until quant.c, matmul.c and
 * ffn.c land (same owner; deleted then). */
#include <stdint.h>

#include "colibri.h"

int64_t clb_row_nbytes(int qtype, int64_t ncols) { (void)qtype; (void)ncols; return CLB_EINVAL; }
int clb_quantize(int qtype, void *out, const float *x, int64_t nrows, int64_t ncols) {
    (void)qtype; (void)out; (void)x; (void)nrows; (void)ncols;
    return CLB_EINVAL;
}
int clb_dequantize(int qtype, float *out, const void *data, int64_t nrows, int64_t ncols) {
    (void)qtype; (void)out; (void)data; (void)nrows; (void)ncols;
    return CLB_EINVAL;
}
int clb_matmul(int qtype, float *y, const void *w, const float *x, int64_t rows, int64_t cols,
               int64_t n, int nthreads) {
    (void)qtype; (void)y; (void)w; (void)x; (void)rows; (void)cols; (void)n; (void)nthreads;
    return CLB_EINVAL;
}
int clb_expert_ffn(int qtype, float *y, float *scratch, const float *x, const void *gate,
                   const void *up, const void *down, const float *gate_bias,
                   const float *up_bias, const float *down_bias, const float *row_weight,
                   int64_t n, int64_t d_model, int64_t d_ff, int act, float alpha, float limit,
                   int accumulate, int nthreads) {
    (void)qtype; (void)y; (void)scratch; (void)x; (void)gate; (void)up; (void)down;
    (void)gate_bias; (void)up_bias; (void)down_bias; (void)row_weight; (void)n; (void)d_model;
    (void)d_ff; (void)act; (void)alpha; (void)limit; (void)accumulate; (void)nthreads;
    return CLB_EINVAL;
}
