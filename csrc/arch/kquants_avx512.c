/* kquants_avx512.c — the same kernels (kquants_simd.inc) compiled for AVX-512 (F, BW, VL): the
 * f32 dots run on 16 lanes, the integer dots stay 256-bit (as matmul_q8.inc), and the scalar
 * unpackers auto-vectorize wider. Run only when clb_isa_detect() reports AVX-512. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../colibri.h"
#include "../kquants.h"

#define KQ_MM_FN clb_kq_mm_rows_avx512
#define KQ_MMQ_FN clb_kq_mmq_rows_avx512
#define KQ_AVX512 1
#include "kquants_simd.inc"
