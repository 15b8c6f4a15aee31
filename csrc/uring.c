/* uring.c — thin wrappers over liburing's inline helpers, for cffi. See uring.h. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include "uring.h"

#ifdef CLB_HAVE_URING
#include <liburing.h>

struct clb_ring { struct io_uring ring; };

int clb_uring_built(void) { return 1; }

int clb_ring_open(clb_ring **out, unsigned entries) {
    clb_ring *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    int rc = io_uring_queue_init(entries, &r->ring, 0);
    if (rc < 0) { free(r); return rc; }
    *out = r;
    return 0;
}

void clb_ring_close(clb_ring *r) {
    if (!r) return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

int clb_ring_register_eventfd(clb_ring *r, int efd) { return io_uring_register_eventfd(&r->ring, efd); }

int clb_ring_register_buffers(clb_ring *r, void *base, size_t buf_nbytes, unsigned num_bufs) {
    struct iovec *iov = calloc(num_bufs, sizeof *iov);
    if (!iov) return -ENOMEM;
    for (unsigned i = 0; i < num_bufs; i++) {
        iov[i].iov_base = (char *)base + (size_t)i * buf_nbytes;
        iov[i].iov_len = buf_nbytes;
    }
    int rc = io_uring_register_buffers(&r->ring, iov, num_bufs);
    free(iov);
    return rc;
}

int clb_ring_prep_read(clb_ring *r, int fd, void *buf, unsigned nbytes, uint64_t offset,
                       int buf_index, uint64_t user_data) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe) return -EBUSY;
    if (buf_index >= 0) io_uring_prep_read_fixed(sqe, fd, buf, nbytes, offset, buf_index);
    else io_uring_prep_read(sqe, fd, buf, nbytes, offset);
    io_uring_sqe_set_data64(sqe, user_data);
    return 0;
}

int clb_ring_submit(clb_ring *r) {
    int rc;
    do rc = io_uring_submit(&r->ring); while (rc == -EINTR);
    return rc;
}

int clb_ring_reap(clb_ring *r, uint64_t *user_data, int32_t *res, int max) {
    struct io_uring_cqe *cqe;
    int n = 0;
    while (n < max && io_uring_peek_cqe(&r->ring, &cqe) == 0) {
        user_data[n] = io_uring_cqe_get_data64(cqe);
        res[n] = cqe->res;
        io_uring_cqe_seen(&r->ring, cqe);
        n++;
    }
    return n;
}

#else /* built without liburing */

struct clb_ring { int unused; };
int clb_uring_built(void) { return 0; }
int clb_ring_open(clb_ring **out, unsigned entries) { (void)out; (void)entries; return -ENOSYS; }
void clb_ring_close(clb_ring *r) { (void)r; }
int clb_ring_register_eventfd(clb_ring *r, int efd) { (void)r; (void)efd; return -ENOSYS; }
int clb_ring_register_buffers(clb_ring *r, void *base, size_t n, unsigned k) {
    (void)r; (void)base; (void)n; (void)k; return -ENOSYS;
}
int clb_ring_prep_read(clb_ring *r, int fd, void *buf, unsigned nbytes, uint64_t offset,
                       int buf_index, uint64_t user_data) {
    (void)r; (void)fd; (void)buf; (void)nbytes; (void)offset; (void)buf_index; (void)user_data;
    return -ENOSYS;
}
int clb_ring_submit(clb_ring *r) { (void)r; return -ENOSYS; }
int clb_ring_reap(clb_ring *r, uint64_t *u, int32_t *res, int max) {
    (void)r; (void)u; (void)res; (void)max; return -ENOSYS;
}
#endif
