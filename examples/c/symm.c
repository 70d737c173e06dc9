/* Two processes share symmetric memory: each allocates a block, they meet
 * through a file store, then each reads the other's buffer and they
 * synchronise with a barrier and a signal. Build and run:
 *   cc -std=c11 symm.c $(pkg-config --cflags --libs storage_sharing) && ./a.out */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, fork */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <storage_sharing.h>

#define CHECK(call)                                                              \
    do {                                                                         \
        ss_status st_ = (call);                                                  \
        if (st_ != SS_OK) {                                                      \
            fprintf(stderr, "%s: %s\n", #call, ss_last_error_message());         \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

enum { WORLD = 2, COUNT = 1024, TIMEOUT_MS = 10000 };

static void run_rank(const char *store_dir, int rank) {
    ss_store *store;
    CHECK(ss_store_file_open(store_dir, &store));
    CHECK(ss_symm_set_group_info("demo", rank, WORLD, store));
    ss_store_free(store); /* the group keeps its own reference */

    void *mine;
    CHECK(ss_symm_alloc(SS_DEVICE_CPU, 0, COUNT * sizeof(int64_t), "demo", &mine));
    const ss_symm_mem *mem;
    CHECK(ss_symm_mem_rendezvous(mine, NULL, TIMEOUT_MS, &mem));

    int64_t *own = mine;
    for (int i = 0; i < COUNT; i++) own[i] = rank * 1000000 + i;
    CHECK(ss_symm_mem_barrier(mem, 0, TIMEOUT_MS, NULL)); /* everyone wrote */

    int peer = 1 - ss_symm_mem_rank(mem);
    void *theirs;
    CHECK(ss_symm_mem_buffer_ptr(mem, peer, &theirs));
    const int64_t *other = theirs;
    for (int i = 0; i < COUNT; i++) {
        if (other[i] != peer * 1000000 + i) {
            fprintf(stderr, "rank %d: element %d of rank %d is %lld\n", rank, i, peer, (long long)other[i]);
            exit(1);
        }
    }
    printf("rank %d read %d values from rank %d\n", rank, COUNT, peer);
    CHECK(ss_symm_mem_barrier(mem, 0, TIMEOUT_MS, NULL)); /* everyone read */

    /* Rank 0 writes into rank 1's buffer, then signals it on channel 1. */
    if (rank == 0) {
        ((int64_t *)theirs)[0] = 42;
        CHECK(ss_symm_mem_put_signal(mem, 1, 1, TIMEOUT_MS, NULL));
    } else {
        CHECK(ss_symm_mem_wait_signal(mem, 0, 1, TIMEOUT_MS, NULL));
        printf("rank 1 got %lld from rank 0\n", (long long)own[0]);
        if (own[0] != 42) exit(1);
    }
    CHECK(ss_symm_mem_barrier(mem, 0, TIMEOUT_MS, NULL));
    CHECK(ss_symm_free(mine)); /* also ends `mem` */
}

int main(void) {
    char store_dir[] = "/tmp/symm-demo-XXXXXX";
    if (!mkdtemp(store_dir)) return 1;
    pid_t child = fork();
    if (child == 0) {
        run_rank(store_dir, 1);
        fflush(stdout);
        _exit(0);
    }
    run_rank(store_dir, 0);
    int status;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
    /* Tidy up the store's folder (each key is one file). */
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", store_dir);
    return system(cmd) == 0 ? 0 : 1;
}
