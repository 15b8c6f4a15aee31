/* pool.c — a persistent pthread pool for the kernels (llama.cpp-style: caller takes part,
 * workers spin briefly, then sleep on a futex).
 *
 * One job at a time. The job is one 64-bit atomic word
 *     gen:16 | want:8 | n:20 | next:20
 * (want = threads taking part, caller included; n = chunks; next = the next unclaimed chunk).
 * A thread claims chunk `next` with a compare-and-swap of the whole word, and only then reads
 * fn/ctx: the job cannot finish while one of its chunks is claimed and not done, so the fields
 * it reads are that job's. A finished chunk adds 1 to `done`; the caller returns when
 * done == n. A worker that is descheduled, or has not woken yet, claims nothing and delays
 * nobody: the worst case is the caller running every chunk (single-thread speed). Only a
 * worker preempted in the middle of a chunk is waited for, and it holds one chunk.
 *
 * Waking: the caller bumps the futex word `seq`; workers spin on it (pause) for
 * COLIBRI_SPIN_US microseconds (environment, default SPIN_US; at least 128 pauses), then
 * sleep in FUTEX_WAIT. `sleepers` tells the caller whether FUTEX_WAKE is needed.
 * A caller that finds the pool busy (another thread's job, or a nested call) runs its chunks
 * itself: no deadlock, no oversubscription. After fork() the child drops the parent's pool
 * (its threads do not exist there) and builds a new one on first use.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "colibri.h"
#include "pool.h"

/* Default COLIBRI_SPIN_US. Measured on the shared 2-core machine (demo model, interleaved
 * runs): 50 us of spinning cost the engine ~30% tok/s (the spinning worker takes CPU from the
 * engine's own threads) and did not speed up back-to-back kernels; so idle workers sleep after
 * two checks of the clock (128 pauses, ~5 us). Raise it on a dedicated machine. */
#define SPIN_US 0
#define MAX_CHUNKS ((1 << 20) - 1)  /* n and next are 20-bit fields of the job word */
#define MAX_THREADS 255             /* want is an 8-bit field */

#define JOB_NEXT(v) ((int64_t)((v) & 0xfffff))
#define JOB_N(v) ((int64_t)(((v) >> 20) & 0xfffff))
#define JOB_WANT(v) ((int)(((v) >> 40) & 0xff))

struct pool {
    _Atomic uint64_t job;       /* gen | want | n | next, see above */
    _Atomic int64_t done;       /* chunks finished in the current job */
    clb_chunk_fn fn;            /* the current job; written by the caller before `job` */
    void *ctx;
    uint16_t gen;
    int nworkers;               /* threads besides the caller */
    _Atomic uint32_t seq;       /* futex word: bumped once per job */
    _Atomic int sleepers;       /* workers in (or entering) FUTEX_WAIT */
    int64_t spin_ns;            /* COLIBRI_SPIN_US in ns */
};

struct worker {
    struct pool *pool;
    int idx;                    /* 1..nworkers; the caller is 0 */
};

static struct pool *g_pool;     /* created on first use by the holder of g_busy */
static _Atomic int g_busy;      /* try-lock: 1 while a caller owns the pool */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

/* Claim and run chunks of the current job until none is left for thread `idx`. */
static void run_chunks(struct pool *p, int idx) {
    uint64_t v = atomic_load_explicit(&p->job, memory_order_acquire);
    for (;;) {
        if (idx >= JOB_WANT(v) || JOB_NEXT(v) >= JOB_N(v)) return;
        if (!atomic_compare_exchange_weak_explicit(&p->job, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;  /* v reloaded */
        p->fn(p->ctx, JOB_NEXT(v));  /* safe: the job cannot end before this chunk is done */
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        v = atomic_load_explicit(&p->job, memory_order_acquire);
    }
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    struct pool *p = w->pool;
    uint32_t seen = atomic_load(&p->seq);
    for (;;) {
        uint32_t s;
        int64_t t0 = 0;
        for (int i = 0; (s = atomic_load_explicit(&p->seq, memory_order_acquire)) == seen; i++) {
            if (i % 64 == 63) {  /* read the clock now and then, not every pause */
                int64_t t = now_ns();
                if (!t0) t0 = t;
                else if (t - t0 >= p->spin_ns) {
                    atomic_fetch_add(&p->sleepers, 1);
                    if (atomic_load(&p->seq) == seen) futex_wait(&p->seq, seen);
                    atomic_fetch_sub(&p->sleepers, 1);
                    t0 = 0;
                    continue;
                }
            }
            cpu_relax();
        }
        seen = s;
        run_chunks(p, w->idx);
    }
    return NULL;
}

/* The child of a fork has the parent's memory but none of its pool threads. */
static void pool_atfork_child(void) {
    g_pool = NULL;  /* leaked: its threads are gone, its memory is the parent's copy */
    atomic_store(&g_busy, 0);
}

/* A pool of clb_default_threads() - 1 workers (fewer if thread creation fails). */
static struct pool *pool_create(void) {
    static int atfork_done;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_atfork_child);
        atfork_done = 1;
    }
    int want = clb_default_threads() - 1;
    if (want > MAX_THREADS - 1) want = MAX_THREADS - 1;
    struct pool *p = calloc(1, sizeof *p);
    struct worker *ws = calloc(want > 0 ? (size_t)want : 1, sizeof *ws);
    if (!p || !ws) {
        free(p);
        free(ws);
        return NULL;
    }
    const char *env = getenv("COLIBRI_SPIN_US");
    p->spin_ns = (env && *env ? atol(env) : SPIN_US) * 1000;
    sigset_t all, old;  /* workers never take signals: Python handles them on its main thread */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10);
    for (int i = 0; i < want; i++) {
        ws[i] = (struct worker){.pool = p, .idx = i + 1};
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, &ws[i])) break;
        p->nworkers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return p;  /* p and ws live as long as the process */
}

static void run_serial(int64_t n_chunks, clb_chunk_fn fn, void *ctx) {
    for (int64_t c = 0; c < n_chunks; c++) fn(ctx, c);
}

void clb_parallel_for(int64_t n_chunks, clb_chunk_fn fn, void *ctx, int nthreads) {
    if (n_chunks <= 0) return;
    int nt = nthreads > 0 ? nthreads : clb_default_threads();
    if (nt > n_chunks) nt = (int)n_chunks;
    int expected = 0;
    if (nt <= 1 || n_chunks > MAX_CHUNKS ||
        !atomic_compare_exchange_strong(&g_busy, &expected, 1)) {
        run_serial(n_chunks, fn, ctx);
        return;
    }
    if (!g_pool) g_pool = pool_create();
    struct pool *p = g_pool;
    if (!p || p->nworkers == 0) {
        atomic_store(&g_busy, 0);
        run_serial(n_chunks, fn, ctx);
        return;
    }
    if (nt > p->nworkers + 1) nt = p->nworkers + 1;
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    p->gen++;
    atomic_store_explicit(&p->job,
                          (uint64_t)p->gen << 48 | (uint64_t)nt << 40 | (uint64_t)n_chunks << 20,
                          memory_order_release);
    atomic_fetch_add(&p->seq, 1);
    if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->seq);
    run_chunks(p, 0);
    /* every chunk is claimed; wait for the ones running on workers (yielding the core after a
     * while, in case the worker holding one is waiting for it) */
    for (int i = 0; atomic_load_explicit(&p->done, memory_order_acquire) < n_chunks; i++) {
        if (i < 4096) cpu_relax();
        else sched_yield();
    }
    atomic_store_explicit(&g_busy, 0, memory_order_release);
}
