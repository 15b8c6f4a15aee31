/* AMX tile instructions in portable C with the hardware's semantics (Intel SDM: LDTILECFG,
 * TILELOADD, TILESTORED, TILEZERO, TDPBSSD, TILERELEASE), so that tests/test_amx.py can run
 * csrc/arch/amx_gemm.c's tile logic on CPUs without AMX. Included after <immintrin.h>; replaces
 * its _tile_* macros. One thread (the harness calls the kernel on its own thread). */
#include <stdint.h>
#include <string.h>
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#define _tile_loadconfig emu_tile_loadconfig
#define _tile_release emu_tile_release
#define _tile_loadd(t, base, stride) emu_tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_tile_stored(t, base, stride)
#define _tile_zero(t) emu_tile_zero(t)
#define _tile_dpbssd(c, a, b) emu_tile_dpbssd(c, a, b)

static struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} emu_cfg;
static uint8_t emu_t[8][16][64]; /* 8 tiles of at most 16 rows x 64 bytes */
static int emu_on;

static void emu_tile_loadconfig(const void *cfg) {
    memcpy(&emu_cfg, cfg, 64);
    memset(emu_t, 0, sizeof emu_t);
    emu_on = emu_cfg.palette == 1;
}
static void emu_tile_release(void) { emu_on = 0; }
static void emu_check(int t) {
    if (!emu_on || t < 0 || t > 7 || emu_cfg.rows[t] > 16 || emu_cfg.colsb[t] > 64) __builtin_trap();
}
static void emu_tile_loadd(int t, const void *base, long stride) {
    emu_check(t);
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy(emu_t[t][r], (const uint8_t *)base + r * stride, emu_cfg.colsb[t]);
}
static void emu_tile_stored(int t, void *base, long stride) {
    emu_check(t);
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emu_t[t][r], emu_cfg.colsb[t]);
}
static void emu_tile_zero(int t) {
    emu_check(t);
    memset(emu_t[t], 0, sizeof emu_t[t]);
}
/* C[m][n] += sum_k sum_i A[m][4k + i] * B[k][4n + i], int8 x int8 -> int32 (TDPBSSD) */
static void emu_tile_dpbssd(int c, int a, int b) {
    emu_check(c), emu_check(a), emu_check(b);
    const int M = emu_cfg.rows[c], N = emu_cfg.colsb[c] / 4, K = emu_cfg.colsb[a] / 4;
    if (emu_cfg.rows[a] != M || emu_cfg.rows[b] != K || emu_cfg.colsb[b] != emu_cfg.colsb[c])
        __builtin_trap(); /* the shapes #UD on hardware */
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t s;
            memcpy(&s, &emu_t[c][m][4 * n], 4);
            for (int k = 0; k < K; k++)
                for (int i = 0; i < 4; i++)
                    s += (int8_t)emu_t[a][m][4 * k + i] * (int8_t)emu_t[b][k][4 * n + i];
            memcpy(&emu_t[c][m][4 * n], &s, 4);
        }
}
