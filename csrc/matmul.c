/* matmul.c — y[n, rows] = x[n, cols] @ W[rows, cols]^T for every storage type.
 *
 * Argument checks, ISA dispatch and threading over chunks of weight rows (pool.c). The inner loops are
 * clb_mm_rows_ref (quant.c, scalar twin) and clb_mm_rows_avx2 / _avx512 (arch/); on Q8_0
 * activations (clb_matmul_q8) clb_mmq_rows_ref / _avx2 / _avx512 (arch/matmul_q8.inc).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- X16-packed weights (colibri.h: clb_pack_x16) ------------------------------------------ */

int clb_x16_ok(int qtype, int64_t rows, int64_t cols) {
    return (qtype == CLB_QTYPE_Q4_0 || qtype == CLB_QTYPE_Q8_0 || qtype == CLB_QTYPE_MXFP4) &&
           rows > 0 && rows % 16 == 0 && cols > 0 && cols % 64 == 0;
}

/* The X16 kernels (arch/ AVX512-VNNI) run at this level. */
static int x16_vnni(void) { return clb_isa_get() == CLB_ISA_AVX512 && has_vnni(); }

/* Whether packing pays: the X16 kernels run, and no AMX takes the batches (its tiles read GGML
 * rows: packed weights would be unpacked for every prefill call). */
int clb_x16_fast(void) { return x16_vnni() && !clb_amx_get(); }

/* One tile of 16 rows: GGML rows g (row_nbytes rb apart) <-> X16 bytes x (16 rb). */
static void x16_tile(int qtype, uint8_t *x, uint8_t *g, int64_t rb, int64_t nblk, int pack) {
    const int64_t sb = qtype == CLB_QTYPE_MXFP4 ? 1 : 2; /* scale bytes: f16, or e8m0 */
    const int64_t bb = qtype == CLB_QTYPE_Q4_0 ? 18 : qtype == CLB_QTYPE_MXFP4 ? 17 : 34;
    const int64_t qb = 16 * (bb - sb);
    for (int64_t b = 0; b < nblk; b++) {
        uint8_t *pp = x + (b / 2) * 32 * bb, *q = pp + 32 * sb + (b & 1) * qb;
        for (int j = 0; j < 16; j++) {
            uint8_t *gb = g + j * rb + b * bb, *sc = pp + 16 * sb * (b & 1) + sb * j;
            if (pack) memcpy(sc, gb, sb);
            else memcpy(gb, sc, sb);
            for (int64_t k = 0; k < (bb - sb) / 4; k++) {
                if (pack) memcpy(q + 64 * k + 4 * j, gb + sb + 4 * k, 4);
                else memcpy(gb + sb + 4 * k, q + 64 * k + 4 * j, 4);
            }
        }
    }
}

static int x16_convert(int qtype, void *dst, const void *src, int64_t rows, int64_t cols,
                       int pack) {
    if (!clb_x16_ok(qtype, rows, cols)) return CLB_EINVAL;
    if (!dst || !src) return CLB_EINVAL;
    const int64_t rb = clb_row_nbytes(qtype, cols), nblk = cols / QK;
    uint8_t *tmp = malloc(16 * rb); /* the tile's source: dst may be src */
    if (!tmp) return CLB_EINVAL;
    const int simd = x16_vnni();
    for (int64_t t = 0; t < rows / 16; t++) {
        uint8_t *d = (uint8_t *)dst + t * 16 * rb;
        memcpy(tmp, (const uint8_t *)src + t * 16 * rb, 16 * rb);
        if (pack && simd) clb_x16_pack_avx512vnni(qtype, d, tmp, rb, nblk, 1);
        else if (pack) x16_tile(qtype, d, tmp, rb, nblk, 1);
        else if (simd) clb_x16_unpack_avx512vnni(qtype, d, tmp, rb, nblk, 1);
        else x16_tile(qtype, tmp, d, rb, nblk, 0);
    }
    free(tmp);
    return CLB_OK;
}

int clb_pack_x16(int qtype, void *dst, const void *src, int64_t rows, int64_t cols) {
    return x16_convert(qtype, dst, src, rows, cols, 1);
}

int clb_unpack_x16(int qtype, void *dst, const void *src, int64_t rows, int64_t cols) {
    return x16_convert(qtype, dst, src, rows, cols, 0);
}

/* Bigger batches (and other ISA levels) unpack at most this many bytes of rows at a time into
 * a per-thread buffer and run the row-major kernels on them. */
#define X16_UNPACK_BYTES (4 << 20)
#define X16_VEC_MAX 8 /* x rows of the X16 tile kernel (arch/matmul_q8.inc MMQ_X16_MAX) */

static uint8_t *x16_scratch(size_t nbytes) {
    static __thread uint8_t *buf;
    static __thread size_t cap;
    if (nbytes > cap) {
        uint8_t *p = realloc(buf, nbytes);
        if (!p) return NULL;
        buf = p;
        cap = nbytes;
    }
    return buf;
}

struct x16_job {
    int qtype;
    float *y;
    const uint8_t *w, *xq;
    int64_t rows, cols, n, rb, xrb, ch;
};

/* clb_mmq_rows_fn on X16-packed weights (r0, r1 on tile bounds): the AVX512-VNNI kernels
 * (the tile kernel, or the GEMMs reading the packed tiles), but for AMX batches and at other
 * ISA levels tiles unpacked into a per-thread buffer for the row-major kernels. */
void clb_x16_rows(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t rb,
                  const uint8_t *xq, int64_t xrb, int64_t cols, int64_t n, int64_t r0, int64_t r1,
                  const float *bias, const float *scale, int accumulate) {
    const int fast = x16_vnni();
    if (fast && qtype == CLB_QTYPE_MXFP4) {
        clb_mxfp4_x16_rows_avx512vnni(qtype, y, ldy, w, rb, xq, xrb, cols, n, r0, r1, bias,
                                      scale, accumulate);
        return;
    }
    if (fast && (n <= X16_VEC_MAX || !clb_amx_get())) { /* AMX: its tiles on unpacked rows */
        clb_mmq_x16_rows_avx512vnni(qtype, y, ldy, w, rb, xq, xrb, cols, n, r0, r1, bias, scale,
                                    accumulate);
        return;
    }
    int64_t u = X16_UNPACK_BYTES / rb / 16 * 16;
    if (u < 16) u = 16;
    if (u > r1 - r0) u = r1 - r0;
    uint8_t *buf = x16_scratch(u * rb);
    if (!buf) {
        clb_kq_fail_rows(y, ldy, n, r0, r1);
        return;
    }
    const clb_mmq_rows_fn fn = clb_mmq_rows_for(qtype);
    const int64_t nblk = cols / QK;
    for (int64_t s = r0; s < r1; s += u) {
        const int64_t m = r1 - s < u ? r1 - s : u;
        const uint8_t *src = w + s * rb;
        if (fast) clb_x16_unpack_avx512vnni(qtype, buf, src, rb, nblk, m / 16);
        else
            for (int64_t t = 0; t < m / 16; t++)
                x16_tile(qtype, (uint8_t *)src + t * 16 * rb, buf + t * 16 * rb, rb, nblk, 0);
        fn(qtype, y + s, ldy, buf, rb, xq, xrb, cols, n, 0, m, bias ? bias + s : NULL, scale,
           accumulate);
    }
}

static void x16_chunk(void *ctx, int64_t c) {
    const struct x16_job *j = ctx;
    const int64_t r0 = c * j->ch, r1 = r0 + j->ch < j->rows ? r0 + j->ch : j->rows;
    clb_x16_rows(j->qtype, j->y, j->rows, j->w, j->rb, j->xq, j->xrb, j->cols, j->n, r0, r1,
                 NULL, NULL, 0);
}

int clb_matmul_q8_x16(int qtype, float *y, const void *w, const void *xq, int64_t rows,
                      int64_t cols, int64_t n, int nthreads) {
    if (!clb_x16_ok(qtype, rows, cols)) return CLB_EINVAL;
    if (n < 0) return CLB_EINVAL;
    if (n == 0) return CLB_OK;
    if (!y || !w || !xq) return CLB_EINVAL;
    const int64_t rb = clb_row_nbytes(qtype, cols), xrb = clb_row_nbytes(CLB_QTYPE_Q8_0, cols);
    const int nt = clb_threads_for(nthreads, rows * rb * ((n + 3) / 4), rows);
    struct x16_job j = {qtype, y, w, xq, rows, cols, n, rb, xrb, clb_chunk_rows(rows, nt)};
    const int64_t nch = (rows + j.ch - 1) / j.ch;
    if (nt == 1)
        for (int64_t c = 0; c < nch; c++) x16_chunk(&j, c);
    else clb_parallel_for(nch, x16_chunk, &j, nt);
    return CLB_OK;
}
