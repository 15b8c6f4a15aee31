/* kquants_gemm_avx2.c — the K-quant GEMM on Q8_K activations (kquants_gemm.inc), AVX2 + FMA. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../colibri.h"
#include "../kquants_gemm.h"

#define KQG_FN clb_kqg_rows_avx2
#include "kquants_gemm.inc"
