/* quant.h — GGML-compatible block layouts, half/bfloat conversions and the internal interface
 * between quant.c, matmul.c, ffn.c and the SIMD files in arch/. Not part of the cffi cdef. */
#ifndef CLB_QUANT_H
#define CLB_QUANT_H

#include <stdint.h>
#include <string.h>

#define QK 32 /* weights per block, all block formats */

/* Q4_0: 32 weights, 18 bytes. d: f16 scale. qs[j] low nibble = weight j, high nibble =
 * weight j + 16 (j < 16). Weight = (q - 8) * d. */
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;
/* Q4_1: 32 weights, 20 bytes. d: f16 scale, m: f16 min. Nibbles as Q4_0. Weight = q * d + m. */
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;
/* Q8_0: 32 weights, 34 bytes. d: f16 scale, qs: int8 in element order. Weight = q * d. */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;

_Static_assert(sizeof(block_q4_0) == 18, "Q4_0 block must be 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "Q4_1 block must be 20 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block must be 34 bytes");

static inline uint32_t clb_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float clb_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* IEEE half -> float, exact (subnormals, inf, nan). */
static inline float clb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return clb_bits_f32(sign | 0x7f800000 | (man << 13));
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 is exact in float */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    return clb_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* float -> IEEE half, round to nearest even, overflow to inf (= numpy astype(float16)).
 * Algorithm of FP16 (Maratyszcza) as used by ggml: the float unit does the rounding. */
static inline uint16_t clb_f32_to_f16(float f) {
    float base = (__builtin_fabsf(f) * 0x1p+112f) * 0x1p-110f;
    uint32_t w = clb_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = clb_bits_f32((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = clb_f32_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

static inline float clb_bf16_to_f32(uint16_t h) { return clb_bits_f32((uint32_t)h << 16); }

/* = ggml_compute_fp32_to_bf16: NaN forced quiet, else round to nearest even. */
static inline uint16_t clb_f32_to_bf16(float f) {
    uint32_t u = clb_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)(((uint64_t)u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline uint16_t clb_load_u16(const void *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Bytes of one block (or of one element for the float formats) and elements per unit. */
int clb_qtype_block(int qtype, int64_t *block_elems, int64_t *block_bytes);

/* Row-range matmul with an epilogue, the shared inner loop of matmul and the expert FFN:
 *   for i in [0, n), r in [r0, r1):
 *     s = dot(x[i * ldx : i * ldx + cols], W[r]) + (bias ? bias[r] : 0)
 *     y[i * ldy + r] = (accumulate ? y[i * ldy + r] : 0) + (scale ? scale[i] : 1) * s
 * W row r starts at w + r * row_nbytes. Arguments are already validated. */
typedef void (*clb_mm_rows_fn)(int qtype, float *y, int64_t ldy, const uint8_t *w,
                               int64_t row_nbytes, const float *x, int64_t ldx, int64_t cols,
                               int64_t n, int64_t r0, int64_t r1, const float *bias,
                               const float *scale, int accumulate);

void clb_mm_rows_ref(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                     const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0, int64_t r1,
                     const float *bias, const float *scale, int accumulate);
void clb_mm_rows_avx2(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                      const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0,
                      int64_t r1, const float *bias, const float *scale, int accumulate);
void clb_mm_rows_avx512(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,
                        const float *x, int64_t ldx, int64_t cols, int64_t n, int64_t r0,
                        int64_t r1, const float *bias, const float *scale, int accumulate);

/* The variant for the current ISA level (clb_isa_get()). */
clb_mm_rows_fn clb_mm_rows_for_isa(void);

/* The same on Q8_0-quantized activations (clb_matmul_q8): x row i is the Q8_0 blocks at
 * xq + i * ldxq (bytes), cols a multiple of 32, qtype Q4_0 or Q8_0 (validated). */
typedef void (*clb_mmq_rows_fn)(int qtype, float *y, int64_t ldy, const uint8_t *w,
                                int64_t row_nbytes, const uint8_t *xq, int64_t ldxq,
                                int64_t cols, int64_t n, int64_t r0, int64_t r1,
                                const float *bias, const float *scale, int accumulate);
#define CLB_DECLARE_MMQ(name)                                                                  \
    void name(int qtype, float *y, int64_t ldy, const uint8_t *w, int64_t row_nbytes,          \
              const uint8_t *xq, int64_t ldxq, int64_t cols, int64_t n, int64_t r0, int64_t r1, \
              const float *bias, const float *scale, int accumulate);
CLB_DECLARE_MMQ(clb_mmq_rows_ref)
CLB_DECLARE_MMQ(clb_mmq_rows_avx2)
CLB_DECLARE_MMQ(clb_mmq_rows_avx512)
CLB_DECLARE_MMQ(clb_mmq_rows_avx512vnni) /* same bits as the others (AVX512-VNNI vpdpbusd) */
clb_mmq_rows_fn clb_mmq_rows_for_isa(void);

/* X16-packed Q4_0 / Q8_0 / MXFP4 weights (clb_pack_x16, colibri.h), AVX512-VNNI: the rows kernels for
 * any n (r0, r1 multiples of 16; same bits as the row-major kernels), and tiles back to GGML
 * rows. */
CLB_DECLARE_MMQ(clb_mmq_x16_rows_avx512vnni)
CLB_DECLARE_MMQ(clb_mxfp4_x16_rows_avx512vnni) /* MXFP4 (arch/matmul_mxfp4.inc) */
void clb_x16_unpack_avx512vnni(int qtype, uint8_t *dst, const uint8_t *src, int64_t row_nbytes,
                               int64_t nblk, int64_t ntiles);
void clb_x16_pack_avx512vnni(int qtype, uint8_t *dst, const uint8_t *src, int64_t row_nbytes,
                             int64_t nblk, int64_t ntiles);
/* clb_mmq_rows_fn on X16-packed weights at any ISA level and batch (matmul.c): the kernel
 * above where it runs, else tiles unpacked for clb_mmq_rows_for(qtype); r0, r1 on tile bounds. */
CLB_DECLARE_MMQ(clb_x16_rows)

/* nblk Q8_0 blocks from 32 * nblk floats, on the calling thread, at the current ISA level;
 * every variant gives clb_quantize's (and gguf's) exact bytes. */
void clb_quantize_q8_0_blocks(void *out, const float *x, int64_t nblk);
void clb_quantize_q8_0_ref(void *out, const float *x, int64_t nblk);
void clb_quantize_q8_0_avx2(void *out, const float *x, int64_t nblk);
void clb_quantize_q8_0_avx512(void *out, const float *x, int64_t nblk);
void clb_quantize_q8_0_avx512vnni(void *out, const float *x, int64_t nblk);

/* Threads for a job of `work_bytes` weight bytes (times batch), capped by the request. */
int clb_threads_for(int nthreads, int64_t work_bytes, int64_t rows);
/* Rows per chunk when `rows` are shared among nt threads by dynamic scheduling. */
int64_t clb_chunk_rows(int64_t rows, int nt);

#endif
