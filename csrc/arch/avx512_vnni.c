/* avx512_vnni.c — the Q8_0-activation matmul (matmul_q8.inc) with AVX512-VNNI's vpdpbusd on
 * 256-bit registers (AVX512VL): one instruction per 4-byte-group dot where AVX2 needs
 * vpmaddubsw + vpmaddwd, and Q8_0 weights as w + 128 instead of the sign trick. Same bits as
 * arch/avx2.c's; run when the CPU reports avx512vnni at the AVX-512 level (matmul.c). */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "quant.h"
#include "kquants.h"

#define h2f(h) _cvtsh_ss(h)
#define MMQ_VNNI 1
#define MMQ_FN clb_mmq_rows_avx512vnni
#define MMQ_QUANT_FN clb_quantize_q8_0_avx512vnni
#define MMQ_X16_FN clb_mmq_x16_rows_avx512vnni
#define MMQ_X16_UNPACK_FN clb_x16_unpack_avx512vnni
#define MMQ_X16_PACK_FN clb_x16_pack_avx512vnni
#include "matmul_q8.inc"
#define MMQ_MX_FN clb_mxfp4_rows_avx512vnni
#define MMQ_MX_X16_FN clb_mxfp4_x16_rows_avx512vnni
#include "matmul_mxfp4.inc"
