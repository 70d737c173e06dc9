/* CUDA IPC through the C API. Runs everywhere: without a usable GPU it
 * checks the SS_ERR_CUDA_UNAVAILABLE statuses; with one, a forked consumer
 * opens what the parent shares (fork happens before the parent touches
 * CUDA, which does not survive fork). The counter release needs no GPU and
 * is checked for real on a counter file made here. */
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

#define SZ (1u << 20)

static void make_name(char *buf, size_t len, const char *what) {
    snprintf(buf, len, "/ss_ctest_cuda_%s_%d", what, (int)getpid());
}

static int shm_exists(const char *name) {
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    return access(path, F_OK) == 0;
}

static void test_handle_text(void) {
    ss_cuda_ipc_handle h, back;
    memset(&h, 0, sizeof h);
    h.device = 0;
    h.mem_handle[0] = 2;
    h.mem_handle[1] = 'c';
    for (int i = 2; i < SS_CUDA_MEM_HANDLE_MAX; i++) h.mem_handle[i] = (uint8_t)i;
    h.mem_handle_len = SS_CUDA_MEM_HANDLE_MAX;
    h.size_bytes = 4096;
    h.offset_bytes = 512;
    strcpy(h.ref_counter_handle, "/torch_1_2_3");
    h.ref_counter_offset = 17;
    for (int i = 0; i < SS_CUDA_IPC_HANDLE_SIZE; i++) h.event_handle[i] = (uint8_t)(255 - i);
    h.event_sync_required = true;

    char text[SS_CUDA_HANDLE_TEXT_MAX];
    CHECK_OK(ss_cuda_ipc_handle_to_text(&h, text, sizeof text));
    memset(&back, 0xee, sizeof back);
    CHECK_OK(ss_cuda_ipc_handle_from_text(text, &back));
    CHECK(back.device == 0 && back.mem_handle_len == 66 && memcmp(back.mem_handle, h.mem_handle, 66) == 0);
    CHECK(back.size_bytes == 4096 && back.offset_bytes == 512 && back.ref_counter_offset == 17);
    CHECK(strcmp(back.ref_counter_handle, "/torch_1_2_3") == 0);
    CHECK(memcmp(back.event_handle, h.event_handle, 64) == 0 && back.event_sync_required);

    char small[8];
    CHECK_STATUS(ss_cuda_ipc_handle_to_text(&h, small, sizeof small), SS_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(ss_cuda_ipc_handle_to_text(NULL, text, sizeof text), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_cuda_ipc_handle_from_text("1 2 3", &back), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "3 fields") != NULL);
    CHECK_STATUS(ss_cuda_ipc_handle_from_text(text, NULL), SS_ERR_NULL_POINTER);
    h.mem_handle_len = 99;
    CHECK_STATUS(ss_cuda_ipc_handle_to_text(&h, text, sizeof text), SS_ERR_INVALID_ARGUMENT);
}

/* A PyTorch-layout counter file: releases decrement, refuse below 0,
 * and a vanished file reads as a gone producer. */
static void test_release_counter(void) {
    char name[64];
    make_name(name, sizeof name, "rc");
    ss_map *m = NULL;
    CHECK_OK(ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE,
                                    SS_CUDA_COUNTER_SLOTS * sizeof(int64_t), &m));
    int64_t *slots = (int64_t *)ss_map_data(m);
    slots[5] = 2;
    CHECK_OK(ss_cuda_ipc_counter_release(name, 5));
    CHECK(slots[5] == 1);
    CHECK_OK(ss_cuda_ipc_counter_release(name, 5));
    CHECK(slots[5] == 0);
    CHECK_STATUS(ss_cuda_ipc_counter_release(name, 5), SS_ERR_BAD_REFCOUNT);
    CHECK(slots[5] == 0);
    CHECK_STATUS(ss_cuda_ipc_counter_release(name, SS_CUDA_COUNTER_SLOTS), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_cuda_ipc_counter_release(NULL, 0), SS_ERR_NULL_POINTER);
    ss_map_free(m);
    CHECK(!shm_exists(name));
    CHECK_STATUS(ss_cuda_ipc_counter_release(name, 0), SS_ERR_PEER_GONE);
    CHECK(strstr(ss_last_error_message(), name) != NULL);
}

static void test_unavailable(void) {
    CHECK(!ss_cuda_available());
    const char *why = ss_last_error_message();
    printf("CUDA unavailable here: %s\n", why);
    CHECK(strncmp(why, "CUDA is not available: ", 23) == 0);
    ss_cuda_ipc_handle h;
    ss_cuda_sent *sent = NULL;
    int dummy = 0;
    CHECK_STATUS(ss_cuda_share(&dummy, 4, 0, NULL, NULL, NULL, &h, &sent), SS_ERR_CUDA_UNAVAILABLE);
    CHECK(sent == NULL);
    memset(&h, 0, sizeof h);
    ss_cuda_received *r = NULL;
    CHECK_STATUS(ss_cuda_received_open(&h, NULL, &r), SS_ERR_CUDA_UNAVAILABLE);
    CHECK(r == NULL);
    void *p = NULL;
    size_t size = 0;
    int32_t version = 0, count = 0;
    CHECK_STATUS(ss_cuda_alloc(0, 64, &p), SS_ERR_CUDA_UNAVAILABLE);
    CHECK_STATUS(ss_cuda_free(0, &dummy), SS_ERR_CUDA_UNAVAILABLE);
    CHECK_STATUS(ss_cuda_pointer_base(&dummy, 0, &p, &size), SS_ERR_CUDA_UNAVAILABLE);
    CHECK_STATUS(ss_cuda_driver_info(&version, &count), SS_ERR_CUDA_UNAVAILABLE);
    /* Nothing to collect, nothing in limbo, NULL frees are no-ops. */
    size_t freed = 99;
    CHECK_OK(ss_cuda_ipc_collect(&freed));
    CHECK(freed == 0);
    CHECK(ss_cuda_limbo_size() == 0);
    CHECK_OK(ss_cuda_sent_free(NULL, NULL));
    CHECK_OK(ss_cuda_received_free(NULL));
    ss_cuda_ipc_teardown();
    /* Argument checks come first. */
    CHECK_STATUS(ss_cuda_share(&dummy, 4, 0, NULL, NULL, NULL, NULL, &sent), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_cuda_received_open(NULL, NULL, &r), SS_ERR_NULL_POINTER);
}

struct freeing {
    int calls;
    void *base;
};

/* Frees the allocation once both sends of it are done. */
static void deleter(void *ctx, void *ptr) {
    struct freeing *f = ctx;
    CHECK((char *)ptr >= (char *)f->base && (char *)ptr < (char *)f->base + SZ);
    if (++f->calls == 2) CHECK_OK(ss_cuda_free(0, f->base));
}

static void read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        CHECK(n > 0);
        p += n;
        len -= (size_t)n;
    }
}

static void write_all(int fd, const void *buf, size_t len) {
    CHECK(write(fd, buf, len) == (ssize_t)len);
}

static void consumer(int in, int out) {
    ss_cuda_ipc_handle h[2];
    ss_cuda_received *r[2];
    char ack = 'k';
    for (int i = 0; i < 2; i++) {
        read_all(in, &h[i], sizeof h[i]);
        CHECK_OK(ss_cuda_received_open(&h[i], NULL, &r[i]));
        CHECK(ss_cuda_received_size(r[i]) == h[i].size_bytes);
        void *base = NULL;
        size_t size = 0;
        CHECK_OK(ss_cuda_pointer_base(ss_cuda_received_data(r[i]), h[i].device, &base, &size));
        CHECK((char *)ss_cuda_received_data(r[i]) == (char *)base + h[i].offset_bytes);
        CHECK(size >= SZ);
        write_all(out, &ack, 1);
    }
    read_all(in, &ack, 1);
    CHECK_OK(ss_cuda_received_free(r[0]));
    CHECK_OK(ss_cuda_received_free(r[1]));
    write_all(out, &ack, 1);
    exit(0);
}

static void test_gpu(void) {
    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) consumer(to_child[0], to_parent[1]);

    int32_t version = 0, count = 0;
    CHECK_OK(ss_cuda_driver_info(&version, &count));
    printf("CUDA driver %d, %d device(s)\n", version, count);
    struct freeing f = {0, NULL};
    CHECK_OK(ss_cuda_alloc(0, SZ, &f.base));
    ss_cuda_ipc_handle h[2];
    ss_cuda_sent *sent[2];
    char ack;
    CHECK_OK(ss_cuda_share(f.base, SZ, 0, NULL, deleter, &f, &h[0], &sent[0]));
    CHECK(h[0].mem_handle_len == 66 && h[0].mem_handle[0] == 2 && h[0].mem_handle[1] == 'c');
    CHECK(h[0].offset_bytes == 0 && h[0].event_sync_required);
    CHECK_OK(ss_cuda_share((char *)f.base + 4096, SZ - 4096, 0, NULL, deleter, &f, &h[1], &sent[1]));
    CHECK(h[1].offset_bytes == 4096 && memcmp(h[0].mem_handle, h[1].mem_handle, 66) == 0);
    CHECK(h[1].ref_counter_offset == h[0].ref_counter_offset + 1);
    for (int i = 0; i < 2; i++) {
        write_all(to_child[1], &h[i], sizeof h[i]);
        read_all(to_parent[0], &ack, 1);
    }
    int64_t c = -1;
    CHECK_OK(ss_cuda_sent_counter(sent[0], &c));
    CHECK(c == 1);
    bool in_limbo = false;
    size_t limbo0 = ss_cuda_limbo_size();
    CHECK_OK(ss_cuda_sent_free(sent[0], &in_limbo));
    CHECK(in_limbo && ss_cuda_limbo_size() == limbo0 + 1 && f.calls == 0);
    write_all(to_child[1], "g", 1);
    read_all(to_parent[0], &ack, 1);
    size_t freed = 0;
    CHECK_OK(ss_cuda_ipc_collect(&freed));
    CHECK(freed == 1 && f.calls == 1 && ss_cuda_limbo_size() == limbo0);
    CHECK_OK(ss_cuda_sent_counter(sent[1], &c));
    CHECK(c == 0);
    CHECK_OK(ss_cuda_sent_free(sent[1], &in_limbo));
    CHECK(!in_limbo && f.calls == 2);
    /* Nothing in use and limbo empty: a full collection drops the file. */
    CHECK(shm_exists(h[0].ref_counter_handle));
    CHECK_OK(ss_cuda_ipc_collect(&freed));
    CHECK(freed == 0 && !shm_exists(h[0].ref_counter_handle));
    ss_cuda_ipc_teardown();
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    printf("GPU share/open/release through the C API: ok\n");
}

int main(void) {
    test_handle_text();
    test_release_counter();
    /* Probe CUDA in a child so this process can still fork a consumer. */
    pid_t probe = fork();
    CHECK(probe >= 0);
    if (probe == 0) exit(ss_cuda_available() ? 0 : 3);
    int status = 0;
    CHECK(waitpid(probe, &status, 0) == probe && WIFEXITED(status));
    if (WEXITSTATUS(status) == 0) {
        test_gpu();
    } else {
        test_unavailable();
        printf("skipped: GPU part (no usable CUDA device)\n");
    }
    printf("test_cuda: ok\n");
    return 0;
}
