/* matmul.c — y[n, rows] = x[n, cols] @ W[rows, cols]^T for every storage type.
 *
 * Argument checks, ISA dispatch and OpenMP threading over chunks of weight rows. The inner loops are
 * clb_mm_rows_ref (quant.c, scalar twin) and clb_mm_rows_avx2 / _avx512 (arch/).
 */
#include <stdint.h>

#include "colibri.h"
#include "quant.h"

clb_mm_rows_fn clb_mm_rows_for_isa(void) {
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return clb_mm_rows_avx512;
    case CLB_ISA_AVX2: return clb_mm_rows_avx2;
    default: return clb_mm_rows_ref;
    }
}

/* Below ~64 KiB of weights per thread, waking another thread costs more than it saves. */
#define CLB_MIN_BYTES_PER_THREAD (64 << 10)

int clb_threads_for(int nthreads, int64_t work_bytes, int64_t rows) {
    int nt = nthreads > 0 ? nthreads : clb_default_threads();
    int64_t by_work = work_bytes / CLB_MIN_BYTES_PER_THREAD;
    if (by_work < nt) nt = by_work < 1 ? 1 : (int)by_work;
    if (rows < nt) nt = rows < 1 ? 1 : (int)rows;
    return nt;
}

/* Rows per dynamically scheduled chunk: about 8 chunks a thread, whole 16-row tiles. On a
 * shared machine a thread that is not running holds at most one chunk, not 1/nt of the work. */
int64_t clb_chunk_rows(int64_t rows, int nt) {
    int64_t ch = (rows / (8 * (int64_t)nt) + 15) / 16 * 16;
    return ch < 16 ? 16 : ch;
}

int clb_matmul(int qtype, float *y, const void *w, const float *x, int64_t rows, int64_t cols,
               int64_t n, int nthreads) {
    const int64_t rb = clb_row_nbytes(qtype, cols);
    if (rb < 0) return (int)rb;
    if (rows < 0 || n < 0) return CLB_EINVAL;
    if (rows == 0 || n == 0) return CLB_OK;
    if (!y || !w || !x) return CLB_EINVAL;
    const clb_mm_rows_fn fn = clb_mm_rows_for_isa();
    /* batches are compute-heavier: count each group of 4 x rows as one more pass */
    const int nt = clb_threads_for(nthreads, rows * rb * ((n + 3) / 4), rows);
    if (nt == 1) {
        fn(qtype, y, rows, w, rb, x, cols, cols, n, 0, rows, NULL, NULL, 0);
        return CLB_OK;
    }
    const int64_t ch = clb_chunk_rows(rows, nt);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t c = 0; c < rows; c += ch)
        fn(qtype, y, rows, w, rb, x, cols, cols, n, c, c + ch < rows ? c + ch : rows, NULL, NULL, 0);
    return CLB_OK;
}
