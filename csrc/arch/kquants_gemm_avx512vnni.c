/* kquants_gemm_avx512vnni.c — the K-quant GEMM on Q8_K activations (kquants_gemm.inc) with
 * AVX512-VNNI: batches on 16-row tiles (vpdpbusd, 16 weight rows in the lanes), the rest as
 * the AVX-512 build; the same bits as every other build. Run when the CPU reports avx512vnni
 * at the AVX-512 level (kquants_gemm.c). */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../colibri.h"
#include "../kquants_gemm.h"

#define KQG_FN clb_kqg_rows_avx512vnni
#define KQG_512 1
#define KQG_VNNI 1
#include "kquants_gemm.inc"
