/* amx.h — AMX (Advanced Matrix Extensions, tile int8) detection and the AMX GEMM rows kernel.
 *
 * clb_amx_supported(): the CPU reports amx_tile + amx_int8 + AVX512-VNNI, the OS enables the
 * tile state in XCR0, and Linux granted this process XTILEDATA (arch_prctl
 * ARCH_REQ_XCOMP_PERM, asked once; process-wide, so the pool's threads may use tiles).
 * clb_amx_get() / clb_amx_set() (colibri.h): whether the AVX-512 level's Q8_0-activation GEMM
 * runs on AMX tiles; COLIBRI_AMX=0 turns it off when the library loads.
 */
#ifndef CLB_AMX_H
#define CLB_AMX_H

#include <stdint.h>

#include "quant.h"

int clb_amx_supported(void);

/* Q4_0 / Q8_0 weights x Q8_0 activations on AMX (arch/amx_gemm.c; Q8_0 weights are read in
 * place, Q4_0 ones repacked): the bits of clb_mmq_rows_ref; small batches and other types go
 * to clb_mmq_rows_avx512vnni. */
CLB_DECLARE_MMQ(clb_mmq_rows_amx)

#endif
