/* Stands in for <immintrin.h> when tests/test_matmul.py builds csrc/arch/avx512.c on a CPU
 * without AVX-512: the intrinsics come from SIMDe (Debian: libsimde-dev) in portable C. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
static inline float _cvtsh_ss(unsigned short h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16((short)h))); }
/* element-wise stand-ins for intrinsics SIMDe 0.7 lacks */
#include <stdint.h>
static inline __m512 _mm512_cvtepi32_ps(__m512i a) {
    int32_t t[16]; float f[16]; _mm512_storeu_si512(t, a);
    for (int i = 0; i < 16; i++) f[i] = (float)t[i];
    return _mm512_loadu_ps(f);
}
#define EMU_WIDEN(name, src_t, srcvec_t, store)                                           \
    static inline __m512i name(srcvec_t a) {                                              \
        src_t s[16]; int32_t t[16]; store((void *)s, a);                                  \
        for (int i = 0; i < 16; i++) t[i] = (int32_t)s[i];                                \
        return _mm512_loadu_si512(t);                                                     \
    }
EMU_WIDEN(_mm512_cvtepi8_epi32, int8_t, __m128i, _mm_storeu_si128)
EMU_WIDEN(_mm512_cvtepu8_epi32, uint8_t, __m128i, _mm_storeu_si128)
EMU_WIDEN(_mm512_cvtepu16_epi32, uint16_t, __m256i, _mm256_storeu_si256)
static inline __m512 _mm512_cvtph_ps(__m256i a) {
    uint16_t s[16]; float f[16]; _mm256_storeu_si256((void *)s, a);
    for (int i = 0; i < 16; i++) f[i] = _cvtsh_ss(s[i]);
    return _mm512_loadu_ps(f);
}
static inline float _mm512_reduce_add_ps(__m512 a) {
    float f[16], s = 0; _mm512_storeu_ps(f, a);
    for (int i = 0; i < 16; i++) s += f[i];
    return s;
}
