/* pool.h — colibri's kernel thread pool (private; not part of the C API in colibri.h).
 *
 * clb_parallel_for(n_chunks, fn, ctx, nthreads) runs fn(ctx, c) once for every chunk
 * c in [0, n_chunks) and returns when all have finished. The caller takes part; chunk
 * boundaries are the caller's, never the thread's, so results do not depend on nthreads.
 * See pool.c for the scheduling rules (why a descheduled worker never stalls a call).
 */
#ifndef COLIBRI_POOL_H
#define COLIBRI_POOL_H

#include <stdint.h>

typedef void (*clb_chunk_fn)(void *ctx, int64_t chunk);

/* nthreads <= 0: clb_default_threads(); more than the pool holds is capped to the pool
 * (clb_default_threads() threads, caller included). nthreads == 1, n_chunks == 1, a pool in
 * use by another thread, or a call from inside a chunk: the caller runs every chunk itself. */
void clb_parallel_for(int64_t n_chunks, clb_chunk_fn fn, void *ctx, int nthreads);

#endif
