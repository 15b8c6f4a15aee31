/* Compares clb_kq_mm_rows_avx512 / clb_kq_mmq_rows_avx512 (arch/kquants_avx512.c built on
 * emulation) with the scalar twins of kquants.c, for every issue-15 type: random blocks whose
 * scale fields are sane (the f16 fields of each block, as compute/ref.py random_blocks). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "colibri.h"
#include "kquants.h"
#include "quant.h"
void clb_quantize_q8_0_avx2(void *out, const float *x, int64_t nblk) {
    clb_quantize_q8_0_ref(out, x, nblk);
}
void clb_quantize_q8_0_avx512(void *out, const float *x, int64_t nblk) {
    clb_quantize_q8_0_ref(out, x, nblk);
}
static float rnd(void) { return (float)rand() / RAND_MAX * 2 - 1; }
/* offsets of the f16 scale fields of a block (-1 ends) */
static void scale_fields(int qt, int off[3]) {
    off[0] = off[1] = off[2] = -1;
    switch (qt) {
    case CLB_QTYPE_Q5_0: case CLB_QTYPE_IQ4_NL: case CLB_QTYPE_IQ4_XS: off[0] = 0; break;
    case CLB_QTYPE_Q5_1: case CLB_QTYPE_Q4_K: case CLB_QTYPE_Q5_K: off[0] = 0; off[1] = 2; break;
    case CLB_QTYPE_Q2_K: off[0] = 80; off[1] = 82; break;
    case CLB_QTYPE_Q3_K: off[0] = 108; break;
    case CLB_QTYPE_Q6_K: off[0] = 208; break;
    default: break;
    }
}
static void random_row(int qt, uint8_t *row, int64_t cols) {
    int64_t e, bb;
    clb_kq_block(qt, &e, &bb);
    const int64_t rb = clb_kq_row_nbytes(qt, cols);
    for (int64_t i = 0; i < rb; i++) row[i] = (uint8_t)(rand() & 255);
    if (qt == CLB_QTYPE_FP8) {
        for (int64_t b = 0; b < clb_fp8_nscales(cols); b++) {
            float s = 0.001f + 0.05f * (rnd() + 1);
            memcpy(row + 4 * b, &s, 4);
        }
        for (int64_t c = 0; c < cols; c++) {
            uint8_t *v = row + 4 * clb_fp8_nscales(cols) + c;
            if ((*v & 0x7f) == 0x7f) *v = 0x7e;
        }
        return;
    }
    int off[3];
    scale_fields(qt, off);
    for (int64_t b = 0; b < cols / e; b++) {
        for (int k = 0; k < 3 && off[k] >= 0; k++) {
            uint16_t h = clb_f32_to_f16(0.001f + 0.025f * (rnd() + 1));
            memcpy(row + b * bb + off[k], &h, 2);
        }
        if (qt == CLB_QTYPE_MXFP4) row[b * bb] = (uint8_t)(120 + rand() % 10);
    }
}
int main(void) {
    const int qts[] = {CLB_QTYPE_Q5_0, CLB_QTYPE_Q5_1, CLB_QTYPE_Q2_K, CLB_QTYPE_Q3_K,
                       CLB_QTYPE_Q4_K, CLB_QTYPE_Q5_K, CLB_QTYPE_Q6_K, CLB_QTYPE_MXFP4,
                       CLB_QTYPE_IQ4_NL, CLB_QTYPE_IQ4_XS, CLB_QTYPE_FP8};
    const int64_t rows_l[] = {1, 13}, cols_l[] = {32, 96, 256, 768, 250}, n_l[] = {1, 2, 5};
    int bad = 0, cases = 0;
    double worst = 0;
    for (int q = 0; q < 11; q++)
        for (int ri = 0; ri < 2; ri++)
            for (int ci = 0; ci < 5; ci++)
                for (int ni = 0; ni < 3; ni++)
                    for (int act = 0; act < 2; act++) {
                        const int qt = qts[q];
                        const int64_t rows = rows_l[ri], cols = cols_l[ci], n = n_l[ni];
                        const int64_t rb = clb_row_nbytes(qt, cols);
                        if (rb < 0 || (act && cols % 32)) continue;
                        uint8_t *w = malloc(rows * rb), *xq = malloc(n * (cols / 32 + 1) * 34);
                        float *wd = malloc(rows * cols * 4), *x = malloc(n * cols * 4);
                        float *xd = malloc(n * cols * 4), *y0 = malloc(n * rows * 4);
                        float *y1 = malloc(n * rows * 4), *bias = malloc(rows * 4);
                        for (int64_t r = 0; r < rows; r++) random_row(qt, w + r * rb, cols);
                        clb_dequantize(qt, wd, w, rows, cols);
                        for (int64_t i = 0; i < n * cols; i++) x[i] = rnd();
                        for (int64_t i = 0; i < rows; i++) bias[i] = rnd();
                        for (int64_t i = 0; i < n * rows; i++) y0[i] = y1[i] = rnd();
                        const int64_t xrb = cols / 32 * 34;
                        if (act) {
                            clb_quantize(CLB_QTYPE_Q8_0, xq, x, n, cols);
                            clb_dequantize(CLB_QTYPE_Q8_0, xd, xq, n, cols);
                            clb_kq_mmq_rows_ref(qt, y0, rows, w, rb, xq, xrb, cols, n, 0, rows, bias, NULL, 1);
                            clb_kq_mmq_rows_avx512(qt, y1, rows, w, rb, xq, xrb, cols, n, 0, rows, bias, NULL, 1);
                        } else {
                            memcpy(xd, x, n * cols * 4);
                            clb_kq_mm_rows_ref(qt, y0, rows, w, rb, x, cols, cols, n, 0, rows, bias, NULL, 1);
                            clb_kq_mm_rows_avx512(qt, y1, rows, w, rb, x, cols, cols, n, 0, rows, bias, NULL, 1);
                        }
                        for (int64_t i = 0; i < n; i++)
                            for (int64_t r = 0; r < rows; r++) {
                                double mag = 1;
                                for (int64_t c = 0; c < cols; c++) mag += fabs(xd[i * cols + c] * wd[r * cols + c]);
                                const double e = fabs(y0[i * rows + r] - y1[i * rows + r]) / mag;
                                if (e > worst) worst = e;
                                if (!(e <= 2e-6)) {
                                    if (bad < 10) printf("qtype %d act %d rows %ld cols %ld n %ld: ref %g avx512 %g\n", qt, act, (long)rows, (long)cols, (long)n, y0[i * rows + r], y1[i * rows + r]);
                                    bad++;
                                }
                            }
                        cases++;
                        free(w); free(xq); free(wd); free(x); free(xd); free(y0); free(y1); free(bias);
                    }
    printf("%d cases, %d mismatches, worst relative error %.3g\n", cases, bad, worst);
    return bad != 0;
}
