/* csrc/arch/amx_gemm.c on emulated tiles (the test copies it here without its target pragma
 * and compiles this file for AVX-512: AVX-512 native, AMX emulated). */
#include <immintrin.h>
#include "amx_tiles.h"
#include "amx_gemm_src.c"
