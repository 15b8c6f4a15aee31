/* ops_avx2.c — AVX2 + FMA + F16C bodies of the small ops and attention (8 f32 lanes).
 * The code is arch/ops_simd.inc; this file maps its vector vocabulary onto AVX2. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../colibri.h"
#include "../ops_internal.h"

#define VW 8
#define SFX(name) name##_avx2
typedef __m256 vf;

static inline __m256i lane_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define vset1(f) _mm256_set1_ps(f)
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vloadh(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
static inline vf vloadn(const float *p, int64_t n, float fill) {
    const __m256i k = lane_mask(n);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, k), _mm256_castsi256_ps(k));
}
static inline void vstoren(float *p, vf v, int64_t n) { _mm256_maskstore_ps(p, lane_mask(n), v); }
static inline vf vloadhn(const uint16_t *p, int64_t n) {
    uint16_t tmp[VW] = {0};
    memcpy(tmp, p, (size_t)n * sizeof *p);
    return vloadh(tmp);
}
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vfma _mm256_fmadd_ps
#define vfnma _mm256_fnmadd_ps
#define vround(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf vpow2i(vf n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
#define vzero_lt(v, x, lo) _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), v)
#define vswap_pairs(v) _mm256_permute_ps(v, 0xB1)
static inline float vhsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline float vhmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* r[0..7] := its transpose (r[i][j] <-> r[j][i]) */
static inline void vtranspose(vf *r) {
    vf t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

#include "ops_simd.inc"
#include "deltanet_simd.inc"
