/* kquants_gemm_avx512.c — the K-quant GEMM on Q8_K activations (kquants_gemm.inc) with 512-bit
 * integer dots (AVX512BW: two weight rows a register), the same bits as the AVX2 build's. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../colibri.h"
#include "../kquants_gemm.h"

#define KQG_FN clb_kqg_rows_avx512
#define KQG_512 1
#include "kquants_gemm.inc"
