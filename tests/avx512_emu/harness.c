/* Compares clb_mm_rows_avx512 (built on emulation) with the scalar twin clb_mm_rows_ref. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "colibri.h"
#include "quant.h"
#include "kquants.h"
/* quant.c's Q8_0 dispatcher also names the AVX2 twin, which this harness does not build. */
void clb_quantize_q8_0_avx2(void *out, const float *x, int64_t nblk) {
    clb_quantize_q8_0_ref(out, x, nblk);
}
static float rnd(void) { return (float)rand() / RAND_MAX * 2 - 1; }
/* The scalar twin and the AVX-512 rows kernel of a Q8_0-activation type. */
static clb_mmq_rows_fn mmq_ref(int qt) {
    return qt == CLB_QTYPE_MXFP4 ? clb_kq_mmq_rows_ref : clb_mmq_rows_ref;
}
static clb_mmq_rows_fn mmq_avx512(int qt) {
    return qt == CLB_QTYPE_MXFP4 ? clb_mxfp4_rows_avx512 : clb_mmq_rows_avx512;
}
int main(void) {
    const int qts[] = {CLB_QTYPE_F32, CLB_QTYPE_F16, CLB_QTYPE_Q4_0, CLB_QTYPE_Q4_1,
                       CLB_QTYPE_Q8_0, CLB_QTYPE_BF16};
    const int64_t rows_l[] = {1, 13, 40}, cols_l[] = {32, 96, 544, 37}, n_l[] = {1, 2, 3, 5, 8};
    int bad = 0, cases = 0;
    double worst = 0;
    for (int q = 0; q < 6; q++)
        for (int ri = 0; ri < 3; ri++)
            for (int ci = 0; ci < 4; ci++)
                for (int ni = 0; ni < 5; ni++) {
                    int64_t rows = rows_l[ri], cols = cols_l[ci], n = n_l[ni];
                    int64_t rb = clb_row_nbytes(qts[q], cols);
                    if (rb < 0) continue;
                    float *wf = malloc(rows * cols * 4), *wd = malloc(rows * cols * 4);
                    float *x = malloc(n * cols * 4), *bias = malloc(rows * 4), *sc = malloc(n * 4);
                    float *y0 = malloc(n * rows * 4), *y1 = malloc(n * rows * 4);
                    uint8_t *w = malloc(rows * rb);
                    for (int64_t i = 0; i < rows * cols; i++) wf[i] = rnd();
                    for (int64_t i = 0; i < n * cols; i++) x[i] = rnd();
                    for (int64_t i = 0; i < rows; i++) bias[i] = rnd();
                    for (int64_t i = 0; i < n; i++) sc[i] = rnd();
                    for (int64_t i = 0; i < n * rows; i++) y0[i] = y1[i] = rnd();
                    clb_quantize(qts[q], w, wf, rows, cols);
                    clb_dequantize(qts[q], wd, w, rows, cols);
                    int acc = (int)(n & 1);
                    const float *b = ri ? bias : NULL, *s = ni ? sc : NULL;
                    clb_mm_rows_ref(qts[q], y0, rows, w, rb, x, cols, cols, n, 0, rows, b, s, acc);
                    clb_mm_rows_avx512(qts[q], y1, rows, w, rb, x, cols, cols, n, 0, rows, b, s, acc);
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t r = 0; r < rows; r++) {
                            double mag = 1;
                            for (int64_t c = 0; c < cols; c++) mag += fabs(x[i * cols + c] * wd[r * cols + c]);
                            double e = fabs(y0[i * rows + r] - y1[i * rows + r]) / mag;
                            if (e > worst) worst = e;
                            if (!(e <= 2e-6)) {
                                if (bad < 10) printf("qtype %d rows %ld cols %ld n %ld: row %ld x %ld: ref %g avx512 %g\n", qts[q], (long)rows, (long)cols, (long)n, (long)r, (long)i, y0[i * rows + r], y1[i * rows + r]);
                                bad++;
                            }
                        }
                    cases++;
                    free(wf); free(wd); free(x); free(bias); free(sc); free(y0); free(y1); free(w);
                }
    /* Q8_0 activations: clb_mmq_rows_avx512 vs clb_mmq_rows_ref (MXFP4: clb_mxfp4_rows_avx512
     * vs clb_kq_mmq_rows_ref, arch/matmul_mxfp4.inc) */
    const int qq[] = {CLB_QTYPE_Q4_0, CLB_QTYPE_Q8_0, CLB_QTYPE_MXFP4};
    for (int q = 0; q < 3; q++)
        for (int ri = 0; ri < 3; ri++)
            for (int ci = 0; ci < 3; ci++)
                for (int ni = 0; ni < 5; ni++) {
                    int64_t rows = rows_l[ri], cols = cols_l[ci], n = n_l[ni];
                    int64_t rb = clb_row_nbytes(qq[q], cols), xrb = clb_row_nbytes(CLB_QTYPE_Q8_0, cols);
                    float *wf = malloc(rows * cols * 4), *wd = malloc(rows * cols * 4);
                    float *x = malloc(n * cols * 4), *xd = malloc(n * cols * 4), *bias = malloc(rows * 4);
                    float *sc = malloc(n * 4), *y0 = malloc(n * rows * 4), *y1 = malloc(n * rows * 4);
                    uint8_t *w = malloc(rows * rb), *xq = malloc(n * xrb);
                    for (int64_t i = 0; i < rows * cols; i++) wf[i] = rnd();
                    for (int64_t i = 0; i < n * cols; i++) x[i] = rnd();
                    for (int64_t i = 0; i < rows; i++) bias[i] = rnd();
                    for (int64_t i = 0; i < n; i++) sc[i] = rnd();
                    for (int64_t i = 0; i < n * rows; i++) y0[i] = y1[i] = rnd();
                    clb_quantize(qq[q], w, wf, rows, cols);
                    clb_dequantize(qq[q], wd, w, rows, cols);
                    clb_quantize_q8_0_ref(xq, x, n * cols / 32);
                    {   /* the AVX-512 build's quantizer gives the same bytes */
                        uint8_t *xq2 = malloc(n * xrb);
                        clb_quantize_q8_0_avx512(xq2, x, n * cols / 32);
                        if (memcmp(xq, xq2, n * xrb)) { printf("q8_0 quantize differs\n"); bad++; }
                        free(xq2);
                    }
                    clb_dequantize(CLB_QTYPE_Q8_0, xd, xq, n, cols);
                    int acc = (int)(n & 1);
                    const float *b = ri ? bias : NULL, *s = ni ? sc : NULL;
                    mmq_ref(qq[q])(qq[q], y0, rows, w, rb, xq, xrb, cols, n, 0, rows, b, s, acc);
                    mmq_avx512(qq[q])(qq[q], y1, rows, w, rb, xq, xrb, cols, n, 0, rows, b, s, acc);
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t r = 0; r < rows; r++) {
                            double mag = 1;
                            for (int64_t c = 0; c < cols; c++) mag += fabs(xd[i * cols + c] * wd[r * cols + c]);
                            double e = fabs(y0[i * rows + r] - y1[i * rows + r]) / mag;
                            if (e > worst) worst = e;
                            if (!(e <= 2e-6)) {
                                if (bad < 10) printf("q8 act qtype %d rows %ld cols %ld n %ld: row %ld x %ld: ref %g avx512 %g\n", qq[q], (long)rows, (long)cols, (long)n, (long)r, (long)i, y0[i * rows + r], y1[i * rows + r]);
                                bad++;
                            }
                        }
                    cases++;
                    free(wf); free(wd); free(x); free(xd); free(bias); free(sc); free(y0); free(y1); free(w); free(xq);
                }
    /* the batch (GEMM) path: x rows past the 64-row panel, rows [5, 45) (an 8-row tile tail,
     * a start inside a tile) */
    for (int q = 0; q < 3; q++) {
        const int64_t rows = 45, cols = 96, n = 70, r0 = 5;
        int64_t rb = clb_row_nbytes(qq[q], cols), xrb = clb_row_nbytes(CLB_QTYPE_Q8_0, cols);
        float *wf = malloc(rows * cols * 4), *x = malloc(n * cols * 4), *bias = malloc(rows * 4);
        float *y0 = calloc(n * rows, 4), *y1 = calloc(n * rows, 4);
        uint8_t *w = malloc(rows * rb), *xq = malloc(n * xrb);
        for (int64_t i = 0; i < rows * cols; i++) wf[i] = rnd();
        for (int64_t i = 0; i < n * cols; i++) x[i] = rnd();
        for (int64_t i = 0; i < rows; i++) bias[i] = rnd();
        clb_quantize(qq[q], w, wf, rows, cols);
        clb_quantize_q8_0_ref(xq, x, n * cols / 32);
        mmq_ref(qq[q])(qq[q], y0, rows, w, rb, xq, xrb, cols, n, r0, rows, bias, NULL, 0);
        mmq_avx512(qq[q])(qq[q], y1, rows, w, rb, xq, xrb, cols, n, r0, rows, bias, NULL, 0);
        for (int64_t i = 0; i < n * rows; i++) {
            double e = fabs(y0[i] - y1[i]) / (1 + fabs(y0[i]));
            if (e > worst) worst = e;
            if (!(e <= 2e-6)) {
                if (bad < 10) printf("q8 act gemm qtype %d: [%ld] ref %g avx512 %g\n", qq[q], (long)i, y0[i], y1[i]);
                bad++;
            }
        }
        cases++;
        free(wf); free(x); free(bias); free(y0); free(y1); free(w); free(xq);
    }
    printf("%d cases, %d mismatches, worst relative error %.2e\n", cases, bad, worst);
    return bad != 0;
}
