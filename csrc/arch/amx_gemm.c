/* amx_gemm.c — Q4_0 / Q8_0 weights x Q8_0 activations on AMX tiles (tdpbssd), for batches
 * (prefill); the same bits as clb_mmq_rows_ref and the AVX-512 VNNI path (matmul_q8.inc).
 *
 * Design after ggml's ggml-cpu/amx/mmq.cpp: one tdpbssd per 32-weight block (K = 32), so that
 * each block's exact int32 sum gets its own scale product in f32 afterwards:
 *   A (tmm0/1) = 16 x rows x 32 int8 of one block, from the x panel repacked once per call
 *                ([16-row tile][block][16][32], aligned; rows past n zero);
 *   B (tmm2/3) = the block of 16 weight rows in VNNI layout: 8 rows (K groups of 4) x 16
 *                weight rows x 4 int8, repacked per call per 16-row tile (amx_pack16; Q4_0 as
 *                q - 8, Q8_0 as is), in 16-block chunks that stay in L1 when x has <= 32 rows;
 *   C (tmm4..7) = 16 x rows x 16 weight rows int32, zeroed per block, stored to an L1 buffer.
 * Two blocks per step, two sets of C tiles, software-pipelined (amx_tile16). Epilogue per x
 * row r, 16 weight rows in the lanes, in block order:
 *     acc[r] = fma((float)isum_b, d_w,b * d_x,b, acc[r])
 * the scalar twin's sequence (quant.c), then + bias, * scale, + y: a row's value does not
 * depend on the batch, the tile, the chunking, the thread or whether AMX ran (batch
 * invariance). Below AMX_MIN x rows the call goes to the VNNI kernels (same bits).
 * Q8_0 weights from AMX_MIN_Q8 x rows take amx_q8w instead: the operands swap (weights = A,
 * loaded in place with the row stride; x = B, packed once per call), no weight repack; same
 * chain, same bits. Measured on one core (GMAC per CPU second, load 1-4, best of 3
 * interleaved; in place / repack / VNNI): 32000 x 4096 at 16 x rows 178 / 114 / 103, at 8 rows
 * 90 / 71 / 70; 4096 x 4096 at 16 rows 233 / 194 / 123, at 8 rows 123 / 87 / 87; at 64 and
 * 512 rows equal to the repack path within noise (~270-330, VNNI ~165-190).
 *
 * Tiles need the process's XTILEDATA permission (amx.c); each call loads the tile config and
 * releases the tiles at its end (a thread holding tiles has 8 KiB more state to switch).
 * Measured on one Sapphire Rapids core: tdpbssd alone 5.1 ns, zero + loads + product + store
 * 9.2 ns and the epilogue 8 ns per 16 x 16 x 32 tile-block; together ~16 ns in a loop on L1
 * data (they overlap little), ~20-25 ns in the kernel. */
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "colibri.h"
#include "quant.h"

#define AMX_XB 34          /* bytes of a Q8_0 block */
#define AMX_PB (64 + 512)  /* packed block: 16 f32 d_w, then the B tile (8 x 64 bytes) */
#define AMX_PANEL 128      /* x rows per panel of precomputed d_x (x panel stays in L2) */
#define AMX_KC 16          /* blocks per packed chunk for <= 32 x rows: 9 KiB, L1-resident */
#ifndef AMX_MIN
#define AMX_MIN 12         /* x rows from which AMX beats the VNNI GEMM (measured: not at 8) */
#endif
#ifndef AMX_MIN_Q8
#define AMX_MIN_Q8 5 /* the same for Q8_0 weights (amx_q8w; measured +7% at 4, +23% at 6) */
#endif

/* palette 1: tiles 0, 1 = A (16 x 32 bytes), 2, 3 = B (8 x 64), 4 .. 7 = C (16 x 64) */
struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Load the tile configuration above (this thread's tiles, until _tile_release). */
static void amx_load_config(void) {
    struct amx_cfg c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = t < 2 ? 32 : 64;
        c.rows[t] = t == 2 || t == 3 ? 8 : 16;
    }
    __asm__ volatile("" ::: "memory"); /* ldtilecfg's asm names only 8 of the 64 bytes */
    _tile_loadconfig(&c);
}

/* 4 x 4 dword transpose inside each 128-bit lane (matmul_q8.inc's mmq_tr4x4). */
static inline __attribute__((always_inline)) void amx_tr4x4(const __m512i z[4], __m512i g[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    g[0] = _mm512_unpacklo_epi64(t0, t2);
    g[1] = _mm512_unpackhi_epi64(t0, t2);
    g[2] = _mm512_unpacklo_epi64(t1, t3);
    g[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 rows' 16 bytes at byte offset `off`: z[a] lane L = row a + 4L. */
static inline __attribute__((always_inline)) void
amx_load16(const uint8_t *const bl[16], int off, __m512i z[4]) {
    for (int a = 0; a < 4; a++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(bl[a] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(bl[a + 4] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(bl[a + 8] + off)), 2);
        z[a] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(bl[a + 12] + off)), 3);
    }
}

/* Rows [0, nr) (nr <= 16; the rest zero) of nblk blocks -> pk (AMX_PB a block): d_w as f32,
 * then B row k = the 16 rows' elements 4k .. 4k + 3 as signed int8 (dword lane j = row j). */
static void amx_pack16(int fmt, uint8_t *pk, const uint8_t *w, int64_t row_nbytes, int nr,
                       int64_t nblk) {
    static const uint8_t zero[AMX_XB];
    const int64_t bb = fmt == CLB_QTYPE_Q4_0 ? 18 : 34;
    const __m512i m4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    const uint8_t *rp[16];
    int64_t step[16];
    for (int j = 0; j < 16; j++) {
        rp[j] = j < nr ? w + j * row_nbytes : zero;
        step[j] = j < nr ? bb : 0;
    }
    /* the 16 rows' f16 scales by one gather (dword j = row j's first 4 bytes of the block) */
    const __mmask16 live = (__mmask16)((1u << nr) - 1);
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int32_t)row_nbytes));
    for (int64_t b = 0; b < nblk; b++) {
        uint8_t *o = pk + b * AMX_PB;
        const uint8_t *bl[16];
        for (int j = 0; j < 16; j++) bl[j] = rp[j] + b * step[j];
        const __m512i dh =
            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, w + b * bb, 1);
        _mm512_storeu_ps((float *)(void *)o, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh)));
        __m512i z[4], g[4];
        __m512i *dv = (__m512i *)(void *)(o + 64);
        amx_load16(bl, 2, z);
        amx_tr4x4(z, g);
        if (fmt == CLB_QTYPE_Q4_0) {
            for (int k = 0; k < 4; k++) {
                _mm512_storeu_si512(dv + k, _mm512_sub_epi8(_mm512_and_si512(g[k], m4), eight));
                _mm512_storeu_si512(
                    dv + k + 4,
                    _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(g[k], 4), m4), eight));
            }
        } else {
            for (int k = 0; k < 4; k++) _mm512_storeu_si512(dv + k, g[k]);
            amx_load16(bl, 18, z);
            amx_tr4x4(z, g);
            for (int k = 0; k < 4; k++) _mm512_storeu_si512(dv + k + 4, g[k]);
        }
    }
}

/* The f32 chain of one block for the 16 x rows: c = its C tile as stored, dw = the block's
 * 16 d_w, dx = its 16 d_x. */
static inline __attribute__((always_inline)) void
amx_epi(__m512 acc[16], const int32_t *c, const float *dwp, const float *dx) {
    const __m512 dw = _mm512_loadu_ps(dwp);
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)),
                                 _mm512_mul_ps(dw, _mm512_set1_ps(dx[r])), acc[r]);
}

/* Blocks b (and b + 1 if two) of a 16-row x tile xa against packed weights pk into C tiles
 * c0 (and c1); AMX_ST stores them to cb (cb + 256). */
#define AMX_DP(c0, c1, b, two)                                    \
    do {                                                          \
        _tile_zero(c0);                                           \
        _tile_loadd(0, xa + (b) * as, ast);                       \
        _tile_loadd(2, pk + (b) * AMX_PB + 64, 64);               \
        _tile_dpbssd(c0, 0, 2);                                   \
        if (two) {                                                \
            _tile_zero(c1);                                       \
            _tile_loadd(1, xa + ((b) + 1) * as, ast);             \
            _tile_loadd(3, pk + ((b) + 1) * AMX_PB + 64, 64);     \
            _tile_dpbssd(c1, 1, 3);                               \
        }                                                         \
    } while (0)
#define AMX_ST(c0, c1, two, cb)                                   \
    do {                                                          \
        _tile_stored(c0, (cb), 64);                               \
        if (two) _tile_stored(c1, (cb) + 256, 64);                \
    } while (0)

/* acc[r] (the 16 rows of the packed operand pk in the lanes) continues its chain through nblk
 * blocks: A tile of block b = 16 rows of 32 int8 at xa + b as, row stride ast; B tile and the
 * lanes' 16 scales from pk (AMX_PB a block); dx [nblk][16] the A rows' scales; cbuf 4 KiB,
 * 64-aligned. Two uses: A = a 16-row x tile packed [nblk][16][32] (as 512, ast 32) and pk the
 * packed weights (C[x row][weight row]); or A = 16 Q8_0 weight rows in place (as 34, ast the
 * row stride) and pk the packed x tile (C[weight row][x row]).
 * Software-pipelined by steps of 2 blocks, C tiles 4, 5 for even steps and 6, 7 for odd ones:
 * the products of step s + 1 are issued before the epilogue of step s and stored after it, so
 * the tile unit and the vector epilogue overlap (measured 16 ns a tile-block here against
 * 18.5 ns in turn). */
static inline __attribute__((always_inline)) void
amx_tile16(__m512 acc[16], const uint8_t *pk, const uint8_t *xa, int64_t as, int64_t ast,
           const float *dx, int64_t nblk, int32_t *cbuf, const uint8_t *pf, int64_t pfs) {
    __m512 a[16]; /* in registers: acc[] is indexed by a variable in the caller */
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) a[r] = acc[r];
    const int64_t ns = (nblk + 1) / 2, nf = nblk / 2; /* steps; full ones */
    AMX_DP(4, 5, 0, nblk > 1);
    AMX_ST(4, 5, nblk > 1, cbuf);
    int64_t st = 0;
    for (; st + 2 < nf; st += 2) { /* steps st, st + 1, st + 2 full: no branches */
        const int64_t b = 2 * st;
        AMX_DP(6, 7, b + 2, 1);
        amx_epi(a, cbuf, (const float *)(const void *)(pk + b * AMX_PB), dx + 16 * b);
        amx_epi(a, cbuf + 256, (const float *)(const void *)(pk + (b + 1) * AMX_PB),
                dx + 16 * (b + 1));
        if (pf) /* the next 16 Q8_0 weight rows' 4 blocks b .. b + 3, into L2 */
            for (int r = 0; r < 16; r++) {
                const char *q = (const char *)pf + r * pfs + b * AMX_XB;
                _mm_prefetch(q, _MM_HINT_T1);
                _mm_prefetch(q + 64, _MM_HINT_T1);
                _mm_prefetch(q + 128, _MM_HINT_T1);
            }
        AMX_ST(6, 7, 1, cbuf + 512);
        AMX_DP(4, 5, b + 4, 1);
        amx_epi(a, cbuf + 512, (const float *)(const void *)(pk + (b + 2) * AMX_PB),
                dx + 16 * (b + 2));
        amx_epi(a, cbuf + 768, (const float *)(const void *)(pk + (b + 3) * AMX_PB),
                dx + 16 * (b + 3));
        AMX_ST(4, 5, 1, cbuf);
    }
    for (; st < ns; st++) {
        const int64_t b = 2 * st, bn = b + 2;
        const int next = st + 1 < ns, two = bn + 1 < nblk;
        int32_t *cn = cbuf + 512 * ((st + 1) & 1);
        if (next) {
            if (st & 1) AMX_DP(4, 5, bn, two);
            else AMX_DP(6, 7, bn, two);
        }
        const int32_t *cb = cbuf + 512 * (st & 1);
        amx_epi(a, cb, (const float *)(const void *)(pk + b * AMX_PB), dx + 16 * b);
        if (b + 1 < nblk)
            amx_epi(a, cb + 256, (const float *)(const void *)(pk + (b + 1) * AMX_PB),
                    dx + 16 * (b + 1));
        if (next) {
            if (st & 1) AMX_ST(4, 5, two, cn);
            else AMX_ST(6, 7, two, cn);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = a[r];
}

/* acc (weight rows t .. t + nr in the lanes) -> y row: + bias, * scale[i], + y if accumulate
 * (the scalar twin's order). */
static inline __attribute__((always_inline)) void
amx_store16(__m512 o, float *yp, int nr, const float *bias, const float *scale, int64_t i,
            int accumulate) {
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(m, bias));
    if (scale) o = _mm512_mul_ps(o, _mm512_set1_ps(scale[i]));
    __asm__("" : "+v"(o)); /* two roundings, as the twin: no FMA contraction of * scale + y */
    if (accumulate) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(m, yp));
    _mm512_mask_storeu_ps(yp, m, o);
}

/* This thread's scratch, kept between calls; NULL when it cannot grow to nbytes. */
static uint8_t *amx_scratch(size_t nbytes) {
    static __thread uint8_t *buf;
    static __thread size_t cap;
    if (nbytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (nbytes + 63) / 64 * 64);
        cap = buf ? nbytes : 0;
    }
    return buf;
}

/* Q8_0 weights, no repack: the weights are the A operand loaded in place (16 rows x the 32
 * quants of block b at w + r row_nbytes + 34 b + 2, stride row_nbytes) and the x rows the B
 * operand, packed once per call per 16-row x tile (amx_pack16 on x: d_x, VNNI K-groups of 4);
 * C[weight row][x row]. The f32 chain per (weight row, x row) and block order are the twin's
 * (d_x * d_w == d_w * d_x: IEEE products commute); a 16 x 16 transpose of the accumulators
 * (once per weight tile and x tile) gives amx_store16 its x row. A last tile of fewer than 16
 * weight rows is copied, zero-padded, so no load passes row r1. Panels of more than one x
 * tile reuse the weight tile: its quants are first copied as they are (no transpose) to
 * [nblk][16][32], so that each A load reads 8 contiguous lines from L2, not 16 strided ones
 * (in place measured 8% slower at 64 x rows of a 32000 x 4096 head); chunks of 16 to 64 blocks
 * kept in L1 measured 3-10% slower. Returns 0 if the scratch cannot grow (then the caller
 * falls back). */
static int amx_q8w(float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                   const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0,
                   int64_t r1, const float *bias, const float *scale, int accumulate) {
    const int64_t nblk = cols / QK;
    const int64_t np = n < AMX_PANEL ? (n + 15) / 16 * 16 : AMX_PANEL, ng = np / 16;
    /* xpk [ng nblk AMX_PB] | cbuf [4096] | dwt [nblk 16] f32 | tr [256] f32 | wc [nblk 512] |
     * wpad [16 rb] */
    const size_t off_c = (size_t)ng * nblk * AMX_PB, off_dw = off_c + 4096;
    const size_t off_tr = off_dw + (size_t)nblk * 64;
    const size_t off_wc = off_tr + 1024, off_wp = off_wc + (ng > 1 ? (size_t)nblk * 512 : 0);
    uint8_t *s = amx_scratch(off_wp + (size_t)(16 * row_nbytes + 63) / 64 * 64);
    if (!s) return 0;
    uint8_t *xpk = s, *wpad = s + off_wp, *wc = s + off_wc;
    int32_t *cbuf = (int32_t *)(void *)(s + off_c);
    float *dwt = (float *)(void *)(s + off_dw), *tr = (float *)(void *)(s + off_tr);
    const __m512i col = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int32_t)row_nbytes));
    amx_load_config();
    for (int64_t p0 = 0; p0 < n; p0 += AMX_PANEL) {
        const int64_t p1 = p0 + AMX_PANEL < n ? p0 + AMX_PANEL : n;
        for (int64_t i = p0; i < p1; i += 16) {
            const int m = p1 - i < 16 ? (int)(p1 - i) : 16;
            amx_pack16(CLB_QTYPE_Q8_0, xpk + (i - p0) / 16 * nblk * AMX_PB, xq + i * ldxq, ldxq,
                       m, nblk);
        }
        for (int64_t t = r0; t < r1; t += 16) {
            const int nr = r1 - t < 16 ? (int)(r1 - t) : 16;
            const float *bt = bias ? bias + t : NULL;
            const uint8_t *wt = w + t * row_nbytes;
            if (nr < 16) {
                memcpy(wpad, wt, (size_t)(nr * row_nbytes));
                memset(wpad + nr * row_nbytes, 0, (size_t)((16 - nr) * row_nbytes));
                wt = wpad;
            }
            const __mmask16 live = (__mmask16)((1u << nr) - 1);
            const int copy = p1 - p0 > 16;
            for (int64_t b = 0; b < nblk; b++) {
                const __m512i dh = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx,
                                                               wt + b * AMX_XB, 1);
                _mm512_storeu_ps(dwt + 16 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh)));
                if (copy)
                    for (int r = 0; r < 16; r++)
                        _mm256_store_si256(
                            (__m256i *)(void *)(wc + b * 512 + r * 32),
                            _mm256_loadu_si256(
                                (const __m256i *)(wt + r * row_nbytes + b * AMX_XB + 2)));
            }
            const uint8_t *wa = copy ? wc : wt + 2;
            const int64_t as = copy ? 512 : AMX_XB, ast = copy ? 32 : row_nbytes;
            __asm__ volatile("" ::: "memory"); /* tileloadd's asm does not name xpk, wc, wpad */
            for (int64_t i = p0; i < p1; i += 16) {
                __m512 acc[16];
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                amx_tile16(acc, xpk + (i - p0) / 16 * nblk * AMX_PB, wa, as, ast, dwt, nblk,
                           cbuf, i == p0 && t + 16 < r1 ? w + (t + 16) * row_nbytes : NULL,
                           row_nbytes);
                /* acc[weight row] has the x rows in its lanes: transpose through tr */
                for (int r = 0; r < 16; r++) _mm512_store_ps(tr + 16 * r, acc[r]);
                const int m = p1 - i < 16 ? (int)(p1 - i) : 16;
                for (int j = 0; j < m; j++)
                    amx_store16(
                        _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(j)), tr, 4),
                        y + (i + j) * ldy + t, nr, bt, scale, i + j, accumulate);
            }
        }
    }
    _tile_release();
    return 1;
}

void clb_mmq_rows_amx(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                      const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0,
                      int64_t r1, const float *bias, const float *scale, int accumulate) {
    if (qtype == CLB_QTYPE_Q8_0 && n >= AMX_MIN_Q8 &&
        amx_q8w(y, ldy, w, row_nbytes, xq, ldxq, cols, n, r0, r1, bias, scale, accumulate))
        return;
    const int64_t nblk = cols / QK;
    const int64_t np = n < AMX_PANEL ? (n + 15) / 16 * 16 : AMX_PANEL;
    /* pk [kc AMX_PB] | cbuf [4096] | accs [np] zmm | dx [np nblk] f32 | xp [np nblk 32] */
    const int64_t bb = qtype == CLB_QTYPE_Q4_0 ? 18 : 34;
    /* few x rows: pack and use the weights in L1-sized chunks of blocks (measured +12-18% at
     * 16 rows); more rows: the whole tile once (the x tiles then reuse it from L2) */
    const int64_t kc = np <= 32 ? AMX_KC : nblk;
    const size_t off_c = (size_t)kc * AMX_PB, off_acc = off_c + 4096;
    const size_t off_dx = off_acc + (size_t)np * 64;
    const size_t off_xp = off_dx + (size_t)np * nblk * 4;
    uint8_t *s = (qtype == CLB_QTYPE_Q4_0 || qtype == CLB_QTYPE_Q8_0) && n >= AMX_MIN
                     ? amx_scratch(off_xp + (size_t)np * nblk * 32)
                     : NULL;
    if (!s) { /* small batch, other type or no memory: the VNNI kernels give the same bits */
        clb_mmq_rows_avx512vnni(qtype, y, ldy, w, row_nbytes, xq, ldxq, cols, n, r0, r1, bias,
                                scale, accumulate);
        return;
    }
    uint8_t *pk = s, *xp = s + off_xp;
    int32_t *cbuf = (int32_t *)(void *)(s + off_c);
    float *dx = (float *)(void *)(s + off_dx);
    __m512 *accs = (__m512 *)(void *)(s + off_acc); /* per x row of the panel: its acc */
    amx_load_config();
    for (int64_t p0 = 0; p0 < n; p0 += AMX_PANEL) {
        const int64_t p1 = p0 + AMX_PANEL < n ? p0 + AMX_PANEL : n;
        const int64_t pe = p0 + (p1 - p0 + 15) / 16 * 16; /* rows [p1, pe) are zero padding */
        /* per 16-row x tile: d_x [block][16] and the quants as A tiles [block][16][32] */
        for (int64_t i = p0; i < pe; i++) {
            const int64_t ti = (i - p0) / 16, r = (i - p0) % 16;
            float *d = dx + ti * nblk * 16 + r;
            uint8_t *q = xp + (ti * nblk * 16 + r) * 32;
            for (int64_t b = 0; b < nblk; b++) {
                const uint8_t *xb = xq + i * ldxq + b * AMX_XB;
                d[16 * b] = i < p1 ? _cvtsh_ss(clb_load_u16(xb)) : 0.0f;
                const __m256i v = i < p1 ? _mm256_loadu_si256((const __m256i *)(xb + 2))
                                         : _mm256_setzero_si256();
                _mm256_store_si256((__m256i *)(void *)(q + 512 * b), v);
            }
        }
        for (int64_t t = r0; t < r1; t += 16) {
            const int nr = r1 - t < 16 ? (int)(r1 - t) : 16;
            const float *bt = bias ? bias + t : NULL;
            for (int64_t k0 = 0; k0 < nblk; k0 += kc) {
                const int64_t kn = nblk - k0 < kc ? nblk - k0 : kc;
                amx_pack16(qtype, pk, w + t * row_nbytes + k0 * bb, row_nbytes, nr, kn);
                __asm__ volatile("" ::: "memory"); /* tileloadd's asm does not name pk, xp */
                for (int64_t i = p0; i < p1; i += 16) {
                    __m512 *acc = accs + (i - p0);
                    if (!k0)
                        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                    amx_tile16(acc, pk, xp + ((i - p0) * nblk + 16 * k0) * 32, 512, 32,
                               dx + (i - p0) * nblk + 16 * k0, kn, cbuf, NULL, 0);
                    if (k0 + kn < nblk) continue;
                    const int m = p1 - i < 16 ? (int)(p1 - i) : 16;
                    for (int r = 0; r < m; r++)
                        amx_store16(acc[r], y + (i + r) * ldy + t, nr, bt, scale, i + r,
                                    accumulate);
                }
            }
        }
    }
    _tile_release();
}
