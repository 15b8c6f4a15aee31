/* ops_avx512.c — AVX-512F bodies of the small ops and attention (16 f32 lanes), used only
 * when clb_isa_detect() reports AVX-512. The code is arch/ops_simd.inc; this file maps its
 * vector vocabulary onto AVX-512 (masked loads and stores for tails). */
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../colibri.h"
#include "../ops_internal.h"

#define VW 16
#define SFX(name) name##_avx512
typedef __m512 vf;

#define lane_mask(n) ((__mmask16)((1u << (n)) - 1u))
#define vset1(f) _mm512_set1_ps(f)
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vloadh(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define vloadn(p, n, fill) _mm512_mask_loadu_ps(_mm512_set1_ps(fill), lane_mask(n), p)
#define vstoren(p, v, n) _mm512_mask_storeu_ps(p, lane_mask(n), v)
#define vloadhn(p, n) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lane_mask(n), p))
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vfma _mm512_fmadd_ps
#define vfnma _mm512_fnmadd_ps
#define vround(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf vpow2i(vf n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
#define vzero_lt(v, x, lo) \
    _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps())
#define vswap_pairs(v) _mm512_permute_ps(v, 0xB1)
#define vhsum _mm512_reduce_add_ps
#define vhmax _mm512_reduce_max_ps

/* r[0..15] := its transpose (r[i][j] <-> r[j][i]): unpack pairs, then 4x4 blocks, then the
 * 128-bit lanes twice */
static inline void vtranspose(vf *r) {
    vf t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

#include "ops_simd.inc"
#include "deltanet_simd.inc"
