/* amx.c — is AMX usable here, and is it in use (amx.h). Plain x86-64 code: it runs on every
 * CPU, so it must not be compiled for AMX or AVX-512 (the kernel is arch/amx_gemm.c). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "amx.h"
#include "colibri.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CLB_ARCH_REQ_XCOMP_PERM 0x1023
#define CLB_XFEATURE_XTILEDATA 18

static int amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return 0; /* AMX-TILE, AMX-INT8 */
    if (!(c & (1u << 11))) return 0;                       /* AVX512-VNNI (the epilogue, small n) */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo & (3u << 17)) != (3u << 17)) return 0; /* XTILECFG, XTILEDATA enabled by the OS */
    if (clb_isa_detect() < CLB_ISA_AVX512) return 0;
    /* Linux >= 5.16: tile data must be requested per process before the first tile op */
    return syscall(SYS_arch_prctl, CLB_ARCH_REQ_XCOMP_PERM, CLB_XFEATURE_XTILEDATA) == 0;
}
#else
static int amx_probe(void) { return 0; }
#endif

static int g_supported = -1, g_on = -1;

int clb_amx_supported(void) {
    if (g_supported < 0) g_supported = amx_probe();
    return g_supported;
}

int clb_amx_get(void) {
    if (g_on < 0) g_on = clb_amx_supported();
    return g_on && clb_isa_get() == CLB_ISA_AVX512;
}

int clb_amx_set(int on) {
    if (on && !clb_amx_supported()) return CLB_EISA;
    g_on = on ? 1 : 0;
    return CLB_OK;
}

/* COLIBRI_AMX=0 (or off/no/false) turns AMX off at load time, before permission is asked. */
__attribute__((constructor)) static void amx_init(void) {
    const char *env = getenv("COLIBRI_AMX");
    if (env && (!strcmp(env, "0") || !strcasecmp(env, "off") || !strcasecmp(env, "no") ||
                !strcasecmp(env, "false")))
        g_on = 0;
}
