/* isa.c — instruction-set dispatch and thread defaults.
 *
 * The best level is detected once from the CPU (__builtin_cpu_supports also checks that the OS
 * saves the wide registers). COLIBRI_ISA=scalar|avx2|avx512 forces a level at load time; tests
 * force one with clb_isa_set(). Kernels read clb_isa_get() on every call and branch to their
 * *_ref (scalar), *_avx2 or *_avx512 variant.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "colibri.h"

static int g_isa = -1;  /* level in use; -1 = not yet initialised */

int clb_isa_detect(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return CLB_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return CLB_ISA_AVX2;
    return CLB_ISA_SCALAR;
}

int clb_isa_set(int isa) {
    if (isa < CLB_ISA_SCALAR || isa > CLB_ISA_AVX512 || isa > clb_isa_detect()) return CLB_EISA;
    g_isa = isa;
    return CLB_OK;
}

int clb_isa_get(void) {
    if (g_isa < 0) g_isa = clb_isa_detect();
    return g_isa;
}

/* COLIBRI_ISA read when the library loads; an unsupported or unknown value is reported on
 * stderr and ignored (ops.py re-applies it and raises KernelError). */
__attribute__((constructor)) static void isa_init(void) {
    g_isa = clb_isa_detect();
    const char *env = getenv("COLIBRI_ISA");
    if (!env || !*env) return;
    int want = !strcasecmp(env, "scalar") ? CLB_ISA_SCALAR
             : !strcasecmp(env, "avx2")   ? CLB_ISA_AVX2
             : !strcasecmp(env, "avx512") ? CLB_ISA_AVX512 : -1;
    if (want < 0 || clb_isa_set(want) != CLB_OK)
        fprintf(stderr, "colibri: COLIBRI_ISA=%s is unknown or unsupported here; using level %d\n",
                env, g_isa);
}

/* Physical cores: online CPUs / hardware threads per core (cpu0's thread siblings). */
int clb_default_threads(void) {
    static int cached = 0;
    if (cached > 0) return cached;
    long nprocs = sysconf(_SC_NPROCESSORS_ONLN);
    if (nprocs < 1) nprocs = 1;
    int per_core = 1;
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list", "r");
    if (f) {
        char buf[256] = {0};
        if (fgets(buf, sizeof buf, f)) {
            /* formats: "0", "0,64", "0-1" */
            int count = 0;
            for (char *p = buf; *p && *p != '\n';) {
                long a = strtol(p, &p, 10), b = a;
                if (*p == '-') b = strtol(p + 1, &p, 10);
                count += (int)(b - a + 1);
                if (*p == ',') p++;
                else break;
            }
            if (count >= 1) per_core = count;
        }
        fclose(f);
    }
    long cores = nprocs / per_core;
    cached = cores >= 1 ? (int)cores : 1;
    return cached;
}
