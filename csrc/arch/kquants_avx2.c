/* kquants_avx2.c — AVX2 + FMA + F16C rows kernels of the issue-15 types (kquants_simd.inc). */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../colibri.h"
#include "../kquants.h"

#define KQ_MM_FN clb_kq_mm_rows_avx2
#define KQ_MMQ_FN clb_kq_mmq_rows_avx2
#include "kquants_simd.inc"
