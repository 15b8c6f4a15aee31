/* membench.c — a streaming SIMD read of a buffer: the memory read bound of DESIGN.md §8.
 *
 * A copy counts write-allocate traffic and understates what kernels can read (on an AVX-512
 * EPYC here a Q8_0 matvec read 52.7 GB/s where a copy said 40.8), so decode's compute bound
 * is set by this instead: every byte loaded once into vector registers (4 independent XOR
 * chains, 256 bytes an iteration, no stores), chunks of CLB_RD_CHUNK bytes claimed
 * dynamically by nthreads threads of the kernel pool (pool.c).
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"
#include "pool.h"

#define CLB_RD_CHUNK (1 << 20)

static uint64_t rd_ref(const uint8_t *p, int64_t n) {
    uint64_t s = 0, v;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&v, p + i, 8);
        s ^= v;
    }
    for (; i < n; i++) s ^= p[i];
    return s;
}

__attribute__((target("avx512f"))) static uint64_t rd_avx512(const uint8_t *p, int64_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void *)(p + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void *)(p + i + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    uint64_t t[8], s = 0;
    _mm512_storeu_si512((void *)t,
                        _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
    for (int k = 0; k < 8; k++) s ^= t[k];
    return s ^ rd_ref(p + i, n - i);
}

__attribute__((target("avx2"))) static uint64_t rd_avx2(const uint8_t *p, int64_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t t[4], s = 0;
    _mm256_storeu_si256((__m256i *)t,
                        _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
    for (int k = 0; k < 4; k++) s ^= t[k];
    return s ^ rd_ref(p + i, n - i);
}

struct rd_job {
    const uint8_t *p;
    int64_t n;
    uint64_t (*fn)(const uint8_t *, int64_t);
    _Atomic uint64_t sum;
};

static void rd_chunk(void *ctx, int64_t c) {
    struct rd_job *j = ctx;
    const int64_t o = c * CLB_RD_CHUNK, len = j->n - o < CLB_RD_CHUNK ? j->n - o : CLB_RD_CHUNK;
    atomic_fetch_xor_explicit(&j->sum, j->fn(j->p + o, len), memory_order_relaxed);
}

int clb_mem_read(int64_t *xor_out, const void *buf, int64_t nbytes, int nthreads) {
    if (!xor_out || (!buf && nbytes) || nbytes < 0) return CLB_EINVAL;
    const int isa = clb_isa_get();
    struct rd_job j = {buf, nbytes,
                       isa == CLB_ISA_AVX512 ? rd_avx512 : isa == CLB_ISA_AVX2 ? rd_avx2 : rd_ref, 0};
    clb_parallel_for((nbytes + CLB_RD_CHUNK - 1) / CLB_RD_CHUNK, rd_chunk, &j, nthreads);
    *xor_out = (int64_t)atomic_load(&j.sum);
    return CLB_OK;
}

/* Write back and evict every cache line of buf from every cache level (clflush, SSE2: every
 * x86-64), then fence: the next read of buf comes from memory (a streaming read of 2x the L3
 * does not evict reliably: the L3's adaptive replacement keeps lines read several times). */
int clb_cache_flush(const void *buf, int64_t nbytes) {
    if ((!buf && nbytes) || nbytes < 0) return CLB_EINVAL;
    const uint8_t *p = buf;
    for (int64_t o = 0; o < nbytes; o += 64) _mm_clflush(p + o);
    if (nbytes) _mm_clflush(p + nbytes - 1);
    _mm_mfence();
    return CLB_OK;
}
