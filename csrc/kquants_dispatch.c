/* kquants_dispatch.c — which rows kernels run a storage type (kquants.h) at the current ISA
 * level, for matmul.c and ffn.c. Kept apart from kquants.c so that quant.c + kquants.c link
 * without the SIMD files (tests/avx512_emu's harness). */
#include <stdint.h>

#include "colibri.h"
#include "kquants.h"
#include "quant.h"

clb_mm_rows_fn clb_mm_rows_for(int qtype) {
    if (!clb_is_kq(qtype)) return clb_mm_rows_for_isa();
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return clb_kq_mm_rows_avx512;
    case CLB_ISA_AVX2: return clb_kq_mm_rows_avx2;
    default: return clb_kq_mm_rows_ref;
    }
}

clb_mmq_rows_fn clb_mmq_rows_for(int qtype) {
    if (!clb_is_kq(qtype)) return clb_mmq_rows_for_isa();
    if (qtype == CLB_QTYPE_MXFP4) return clb_mxfp4_rows_for_isa();
    switch (clb_isa_get()) {
    case CLB_ISA_AVX512: return clb_kq_mmq_rows_avx512;
    case CLB_ISA_AVX2: return clb_kq_mmq_rows_avx2;
    default: return clb_kq_mmq_rows_ref;
    }
}

int clb_q8_act_supported(int qtype) {
    return qtype == CLB_QTYPE_Q4_0 || qtype == CLB_QTYPE_Q8_0 || clb_is_kq(qtype);
}
