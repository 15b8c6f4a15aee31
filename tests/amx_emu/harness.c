/* clb_mmq_rows_amx built on emulated tiles (amx_tiles.h) against the scalar twin
 * clb_mmq_rows_ref, bit for bit: Q4_0 / Q8_0 (Q8_0 weights in place, amx_q8w), ragged rows and
 * x rows, 1 to 130 blocks, past the 128-row x panel (300 rows: three panels), bias / scale / accumulate. Below the AMX threshold the kernel hands
 * the call to the VNNI path, stood in for here by the scalar twin. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "colibri.h"
#include "quant.h"
/* quant.c's Q8_0 dispatcher names the SIMD twins, which this harness does not build */
void clb_quantize_q8_0_avx2(void *out, const float *x, int64_t nblk) {
    clb_quantize_q8_0_ref(out, x, nblk);
}
void clb_quantize_q8_0_avx512(void *out, const float *x, int64_t nblk) {
    clb_quantize_q8_0_ref(out, x, nblk);
}
void clb_mmq_rows_avx512vnni(int qtype, float *y, int64_t ldy, const uint8_t *w,
                             int64_t row_nbytes, const uint8_t *xq, int64_t ldxq, int64_t cols,
                             int64_t n, int64_t r0, int64_t r1, const float *bias,
                             const float *scale, int accumulate) {
    clb_mmq_rows_ref(qtype, y, ldy, w, row_nbytes, xq, ldxq, cols, n, r0, r1, bias, scale,
                     accumulate);
}
void clb_mmq_rows_amx(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                      const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0,
                      int64_t r1, const float *bias, const float *scale, int accumulate);
static float rnd(void) { return (float)rand() / RAND_MAX * 2 - 1; }
int main(void) {
    const int qts[] = {CLB_QTYPE_Q4_0, CLB_QTYPE_Q8_0};
    const int64_t rows_l[] = {1, 16, 37}, cols_l[] = {32, 96, 160, 192, 4160};
    const int64_t n_l[] = {5, 8, 12, 16, 29, 130, 300}; /* Q8_0 from 5 (amx_q8w), Q4_0 from 12 */
    int bad = 0, cases = 0;
    for (int q = 0; q < 2; q++)
        for (int ri = 0; ri < 3; ri++)
            for (int ci = 0; ci < 5; ci++)
                for (int ni = 0; ni < 7; ni++) {
                    const int64_t rows = rows_l[ri], cols = cols_l[ci], n = n_l[ni];
                    if (cols > 1000 && n > 29) continue; /* emulation is slow */
                    const int64_t rb = clb_row_nbytes(qts[q], cols);
                    const int64_t xrb = clb_row_nbytes(CLB_QTYPE_Q8_0, cols);
                    float *wf = malloc(rows * cols * 4), *x = malloc(n * cols * 4);
                    float *bias = malloc(rows * 4), *sc = malloc(n * 4);
                    float *y0 = malloc(n * rows * 4), *y1 = malloc(n * rows * 4);
                    uint8_t *w = malloc(rows * rb), *xq = malloc(n * xrb);
                    for (int64_t i = 0; i < rows * cols; i++) wf[i] = rnd();
                    for (int64_t i = 0; i < n * cols; i++) x[i] = rnd() * (1 + i % 7);
                    for (int64_t i = 0; i < rows; i++) bias[i] = rnd();
                    for (int64_t i = 0; i < n; i++) sc[i] = rnd();
                    for (int64_t i = 0; i < n * rows; i++) y0[i] = y1[i] = rnd();
                    clb_quantize(qts[q], w, wf, rows, cols);
                    clb_quantize(CLB_QTYPE_Q8_0, xq, x, n, cols);
                    const int acc = (int)(ni & 1);
                    const float *b = ri ? bias : NULL, *s = ci ? sc : NULL;
                    clb_mmq_rows_ref(qts[q], y0, rows, w, rb, xq, xrb, cols, n, 0, rows, b, s,
                                     acc);
                    clb_mmq_rows_amx(qts[q], y1, rows, w, rb, xq, xrb, cols, n, 0, rows, b, s,
                                     acc);
                    cases++;
                    if (memcmp(y0, y1, n * rows * 4)) {
                        if (bad < 10)
                            printf("qtype %d rows %ld cols %ld n %ld differ\n", qts[q],
                                   (long)rows, (long)cols, (long)n);
                        bad++;
                    }
                    free(wf), free(x), free(bias), free(sc), free(y0), free(y1), free(w), free(xq);
                }
    printf("%d cases, %d mismatches\n", cases, bad);
    return bad != 0;
}
