/* uring.h — colibri's io_uring shim (cffi cdef). Plain declarations only.
 * All functions return >= 0 on success or -errno. Built without liburing, every call
 * returns -ENOSYS and clb_uring_built() returns 0.
 *
 * One ring per reader. Reads carry a 64-bit user_data (the Python side's request id) and come
 * back through clb_ring_reap as (user_data, res) pairs: res = bytes read (may be short) or
 * -errno. buf_index >= 0 selects a buffer registered with clb_ring_register_buffers
 * (IORING_OP_READ_FIXED); buf_index < 0 issues a plain IORING_OP_READ. */
typedef struct clb_ring clb_ring;

int clb_uring_built(void);
/* entries: submission queue size (the queue depth). *out is set on success. */
int clb_ring_open(clb_ring **out, unsigned entries);
void clb_ring_close(clb_ring *ring);
/* completions signal this eventfd (the event loop watches it). */
int clb_ring_register_eventfd(clb_ring *ring, int efd);
/* register num_bufs buffers of buf_nbytes each, contiguous from base (the slab pool's slots). */
int clb_ring_register_buffers(clb_ring *ring, void *base, size_t buf_nbytes, unsigned num_bufs);
/* queue one read; -EBUSY when the submission queue is full (call clb_ring_submit first). */
int clb_ring_prep_read(clb_ring *ring, int fd, void *buf, unsigned nbytes, uint64_t offset,
                       int buf_index, uint64_t user_data);
/* submit every queued read; returns how many the kernel took. */
int clb_ring_submit(clb_ring *ring);
/* copy up to max ready completions out without waiting; returns how many. */
int clb_ring_reap(clb_ring *ring, uint64_t *user_data, int32_t *res, int max);
