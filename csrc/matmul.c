/* matmul.c — y[n, rows] = x[n, cols] @ W[rows, cols]^T for every storage type.
 *
 * Argument checks, ISA dispatch and threading over chunks of weight rows (pool.c). The inner loops are
 * clb_mm_rows_ref (quant.c, scalar twin) and clb_mm_rows_avx2 / _avx512 (arch/); on Q8_0
 * activations (clb_matmul_q8) clb_mmq_rows_ref / _avx2 / _avx512 (arch/matmul_q8.inc).
 */
#include <stdint.h>

#include "amx.h"
#include "colibri.h"
#include "pool.h"
#include "quant.h"
#include "kquants.h"

clb_mm_rows_fn clb_mm_rows_for_isa(void) {
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return clb_mm_rows_avx512;
    case CLB_ISA_AVX2: return clb_mm_rows_avx2;
    default: return clb_mm_rows_ref;
    }
}

/* AVX512-VNNI (vpdpbusd) within the AVX-512 level: the same bits, fewer instructions. */
static int has_vnni(void) {
    static int v = -1;
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    }
    return v;
}

clb_mmq_rows_fn clb_mmq_rows_for_isa(void) {
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512:
        if (clb_amx_get()) return clb_mmq_rows_amx; /* amx.h: batches on tiles, same bits */
        return has_vnni() ? clb_mmq_rows_avx512vnni : clb_mmq_rows_avx512;
    case CLB_ISA_AVX2: return clb_mmq_rows_avx2;
    default: return clb_mmq_rows_ref;
    }
}

clb_mmq_rows_fn clb_mxfp4_rows_for_isa(void) {
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return has_vnni() ? clb_mxfp4_rows_avx512vnni : clb_mxfp4_rows_avx512;
    case CLB_ISA_AVX2: return clb_mxfp4_rows_avx2;
    default: return clb_kq_mmq_rows_ref;
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

struct mm_job {
    clb_mm_rows_fn fn;
    int qtype;
    float *y;
    const void *w;
    const float *x;
    int64_t rows, cols, n, rb, ch;
};

/* Chunk c = weight rows [c ch, min((c + 1) ch, rows)). */
static void mm_chunk(void *ctx, int64_t c) {
    const struct mm_job *j = ctx;
    const int64_t r0 = c * j->ch, r1 = r0 + j->ch < j->rows ? r0 + j->ch : j->rows;
    j->fn(j->qtype, j->y, j->rows, j->w, j->rb, j->x, j->cols, j->cols, j->n, r0, r1, NULL, NULL,
          0);
}

int clb_matmul(int qtype, float *y, const void *w, const float *x, int64_t rows, int64_t cols,
               int64_t n, int nthreads) {
    const int64_t rb = clb_row_nbytes(qtype, cols);
    if (rb < 0) return (int)rb;
    if (rows < 0 || n < 0) return CLB_EINVAL;
    if (rows == 0 || n == 0) return CLB_OK;
    if (!y || !w || !x) return CLB_EINVAL;
    const clb_mm_rows_fn fn = clb_mm_rows_for(qtype);
    /* batches are compute-heavier: count each group of 4 x rows as one more pass */
    const int nt = clb_threads_for(nthreads, rows * rb * ((n + 3) / 4), rows);
    if (nt == 1) {
        fn(qtype, y, rows, w, rb, x, cols, cols, n, 0, rows, NULL, NULL, 0);
        return CLB_OK;
    }
    struct mm_job j = {fn, qtype, y, w, x, rows, cols, n, rb, clb_chunk_rows(rows, nt)};
    clb_parallel_for((rows + j.ch - 1) / j.ch, mm_chunk, &j, nt);
    return CLB_OK;
}

struct mmq_job {
    clb_mmq_rows_fn fn;
    int qtype;
    float *y;
    const void *w, *xq;
    int64_t rows, cols, n, rb, xrb, ch;
};

static void mmq_chunk(void *ctx, int64_t c) {
    const struct mmq_job *j = ctx;
    const int64_t r0 = c * j->ch, r1 = r0 + j->ch < j->rows ? r0 + j->ch : j->rows;
    j->fn(j->qtype, j->y, j->rows, j->w, j->rb, j->xq, j->xrb, j->cols, j->n, r0, r1, NULL, NULL,
          0);
}

int clb_matmul_q8(int qtype, float *y, const void *w, const void *xq, int64_t rows, int64_t cols,
                  int64_t n, int nthreads) {
    if (!clb_q8_act_supported(qtype)) return CLB_EQTYPE;
    const int64_t rb = clb_row_nbytes(qtype, cols), xrb = clb_row_nbytes(CLB_QTYPE_Q8_0, cols);
    if (rb < 0) return (int)rb;
    if (rows < 0 || n < 0) return CLB_EINVAL;
    if (rows == 0 || n == 0) return CLB_OK;
    if (!y || !w || !xq) return CLB_EINVAL;
    const clb_mmq_rows_fn fn = clb_mmq_rows_for(qtype);
    const int nt = clb_threads_for(nthreads, rows * rb * ((n + 3) / 4), rows);
    if (nt == 1) {
        fn(qtype, y, rows, w, rb, xq, xrb, cols, n, 0, rows, NULL, NULL, 0);
        return CLB_OK;
    }
    struct mmq_job j = {fn, qtype, y, w, xq, rows, cols, n, rb, xrb, clb_chunk_rows(rows, nt)};
    clb_parallel_for((rows + j.ch - 1) / j.ch, mmq_chunk, &j, nt);
    return CLB_OK;
}
