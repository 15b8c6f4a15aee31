/* mla.h — private interface between mla.c and arch/mla_simd.inc (not part of the C API).
 *
 * The inner loop of clb_mla_absorb_q, a "transposed" matmul over quantized rows:
 *   y[i * ldy + c] = sum_{j < nrows} x[i * ldx + j] * W[j, c]   (i < n, c < cols)
 * W row j starts at w + j * row_nbytes (any clb_qtype, cols a multiple of 32 for block
 * formats). Each weight block is decoded once per group of up to 4 x rows and accumulated into
 * y in j order (y starts at 0). Arguments are already validated.
 */
#ifndef COLIBRI_MLA_H
#define COLIBRI_MLA_H

#include <stdint.h>

typedef void (*clb_mla_xw_fn)(int qtype, float *y, int64_t ldy, const uint8_t *w,
                              int64_t row_nbytes, const float *x, int64_t ldx, int64_t nrows,
                              int64_t cols, int64_t n);
#define CLB_DECLARE_MLA_XW(name)                                                               \
    void name(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,          \
              const float *x, int64_t ldx, int64_t nrows, int64_t cols, int64_t n);
CLB_DECLARE_MLA_XW(clb_mla_xw_ref)
CLB_DECLARE_MLA_XW(clb_mla_xw_avx2)
CLB_DECLARE_MLA_XW(clb_mla_xw_avx512)

#endif
