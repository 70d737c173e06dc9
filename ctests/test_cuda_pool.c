/* The GPU weights pool through the C API on the host device (no GPU):
 * a producer places two tensors (one a view of the other's storage),
 * exports, and a forked consumer opens the handle, reads a version, reads
 * it again nested (and from another thread) while the producer's update
 * waits for it, lets go, and reads the next version. Bad input is refused. */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "forks.h"

static void fill_floats(float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++) p[i] = v;
}

static int all_equal(const float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

/* A second thread of the consumer joins the process's hold. */
static void *join_hold(void *w) {
    uint64_t v = 0;
    if (ss_cuda_weights_acquire(w, 0, 5000, &v) != SS_OK || v != 1) return (void *)1;
    if (ss_cuda_weights_release(w, 0) != SS_OK) return (void *)1;
    return NULL;
}

/* The consumer: reads the handle from `in`, checks versions 1 and 2. */
static int consumer(int in, int out) {
    uint8_t handle[256];
    ssize_t len = read(in, handle, sizeof handle);
    CHECK(len > 0);
    ss_cuda_weights *w = NULL;
    CHECK_OK(ss_cuda_weights_open(handle, (size_t)len, 20000, &w));
    size_t count = 0, index = 0;
    CHECK_OK(ss_cuda_weights_count(w, &count));
    CHECK(count == 2);
    CHECK_OK(ss_cuda_weights_find(w, "w.T", &index));
    ss_cuda_weights_tensor_info t;
    CHECK_OK(ss_cuda_weights_tensor(w, index, &t));
    CHECK(strcmp(t.name, "w.T") == 0 && t.ndim == 2 && t.strides[0] == 1 && t.strides[1] == 16 && t.dtype == 6);
    ss_cuda_weights_tensor_info w0;
    CHECK_OK(ss_cuda_weights_tensor(w, 0, &w0));
    CHECK(w0.storage_index == t.storage_index && w0.data_ptr == t.data_ptr);
    CHECK_STATUS(ss_cuda_weights_tensor(w, 2, &t), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_cuda_weights_find(w, "nope", &index), SS_ERR_NOT_FOUND);
    uint64_t v = 0;
    CHECK_OK(ss_cuda_weights_acquire(w, 0, 20000, &v));
    CHECK(v == 1 && all_equal(w0.data_ptr, 256, 1.0f));
    CHECK(write(out, "r", 1) == 1); /* holding version 1 */
    char go;
    CHECK(read(in, &go, 1) == 1);   /* the producer's update is waiting for us */
    bool pending = false;
    for (int i = 0; i < 2000 && !pending; i++) {
        CHECK_OK(ss_cuda_weights_is_update_pending(w, &pending));
        if (!pending) usleep(5000);
    }
    CHECK(pending);
    /* Nested in this read, and from another thread: at once, not behind the
       producer (which waits for this very read). */
    CHECK_OK(ss_cuda_weights_acquire(w, 0, 5000, &v));
    CHECK(v == 1);
    pthread_t joiner;
    void *failed = NULL;
    CHECK(pthread_create(&joiner, NULL, join_hold, w) == 0 && pthread_join(joiner, &failed) == 0 && failed == NULL);
    CHECK_OK(ss_cuda_weights_release(w, 0));
    CHECK_STATUS(ss_cuda_weights_is_update_pending(w, NULL), SS_ERR_NULL_POINTER);
    CHECK_OK(ss_cuda_weights_release(w, 0));
    /* Acquiring again before the producer's update started would hold
       version 1 again: wait for its publish. */
    CHECK(read(in, &go, 1) == 1);
    CHECK_OK(ss_cuda_weights_acquire(w, 0, 20000, &v));
    CHECK(v == 2 && all_equal(w0.data_ptr, 256, 2.0f));
    CHECK_OK(ss_cuda_weights_release(w, 0));
    CHECK_STATUS(ss_cuda_weights_release(w, 0), SS_ERR_INVALID_ARGUMENT);
    ss_cuda_weights_free(w);
    return 0;
}

int main(void) {
    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0);
    /* Forked before the pool (and its server thread) exists. */
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) _exit(consumer(to_child[0], to_parent[1]));

    ss_cuda_pool_options o = SS_CUDA_POOL_OPTIONS_INIT;
    o.device_type = SS_POOL_DEVICE_HOST;
    o.segment_size = 1 << 16;
    o.max_consumers = 4;
    ss_cuda_pool *pool = NULL;
    CHECK_OK(ss_cuda_pool_new(&o, &pool));
    void *p = NULL;
    CHECK_OK(ss_cuda_pool_alloc(pool, 1024, &p));
    CHECK(((uintptr_t)p % 512) == 0);
    fill_floats(p, 256, 1.0f);
    int64_t sizes[2] = {16, 16}, strides[2] = {16, 1}, strides_t[2] = {1, 16};
    ss_tensor_desc d = SS_TENSOR_DESC_INIT;
    d.storage_ptr = p;
    d.storage_nbytes = 1024;
    d.dtype = 6; /* float32 */
    d.ndim = 2;
    d.sizes = sizes;
    d.strides = strides;
    CHECK_OK(ss_cuda_pool_add_tensor(pool, "w", &d));
    d.strides = strides_t;
    CHECK_OK(ss_cuda_pool_add_tensor(pool, "w.T", &d));
    CHECK_STATUS(ss_cuda_pool_add_tensor(pool, "w", &d), SS_ERR_INVALID_ARGUMENT);
    int64_t too_big[2] = {17, 16};
    d.sizes = too_big;
    CHECK_STATUS(ss_cuda_pool_add_tensor(pool, "big", &d), SS_ERR_INVALID_ARGUMENT);
    d.struct_size = 0;
    CHECK_STATUS(ss_cuda_pool_add_tensor(pool, "zero", &d), SS_ERR_INVALID_ARGUMENT);

    uint8_t handle[256];
    size_t len = 0;
    CHECK_STATUS(ss_cuda_pool_export(pool, handle, 4, &len), SS_ERR_BUFFER_TOO_SMALL);
    CHECK(len > 4 && len < sizeof handle);
    CHECK_OK(ss_cuda_pool_export(pool, handle, sizeof handle, &len));
    CHECK_STATUS(ss_cuda_pool_add_tensor(pool, "late", &d), SS_ERR_INVALID_ARGUMENT);

    /* A malformed handle is refused before any connection. */
    ss_cuda_weights *bad = NULL;
    CHECK_STATUS(ss_cuda_weights_open(handle, len - 1, 1000, &bad), SS_ERR_INVALID_ARGUMENT);
    CHECK(bad == NULL);

    CHECK(write(to_child[1], handle, len) == (ssize_t)len);
    char r;
    CHECK(read(to_parent[0], &r, 1) == 1);
    /* The consumer holds version 1: an update cannot start yet. */
    CHECK_STATUS(ss_cuda_pool_begin_update(pool, 50), SS_ERR_TIMEOUT);
    CHECK(write(to_child[1], "g", 1) == 1);
    /* Waits while the consumer reads nested, then for its let-go. */
    CHECK_OK(ss_cuda_pool_begin_update(pool, 20000));
    CHECK_STATUS(ss_cuda_pool_begin_update(pool, 10), SS_ERR_BUSY);
    fill_floats(p, 256, 2.0f);
    uint64_t v = 0;
    CHECK_OK(ss_cuda_pool_publish(pool, 0, &v));
    CHECK(v == 2);
    CHECK(write(to_child[1], "p", 1) == 1);
    wait_child_ok(pid);

    ss_cuda_pool_options cuda = SS_CUDA_POOL_OPTIONS_INIT;
    ss_cuda_pool *none = NULL;
    ss_status st = ss_cuda_pool_new(&cuda, &none);
    CHECK(st == SS_OK || st == SS_ERR_CUDA_UNAVAILABLE);
    ss_cuda_pool_free(none);
    ss_cuda_pool_free(pool);
    ss_cuda_pool_free(NULL);
    ss_cuda_weights_free(NULL);
    return 0;
}
