/* A child forked from an arena's producer shares the parent's segments
 * but not its allocator: every call on the inherited arena is refused in
 * the child (it would hand out the parent's next block, or free, share,
 * cancel or recycle the parent's), reading the parent's blocks still
 * works, closing the inherited arena leaves the parent's segments alone,
 * and dropping a view inherited from the parent keeps the parent's hold.
 * Also from a parent whose other threads are inside the arena at the fork. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "forks.h"

static int matches(const unsigned char *p, size_t n, unsigned seed) {
    return matches_from(p, 0, n, seed);
}

static int all_zero(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != 0) return 0;
    return 1;
}

/* The status every call on an inherited arena gives in the child, with a
 * message that says so. */
static void check_refused(ss_status st) {
    CHECK_STATUS(st, SS_ERR_INVALID_ARGUMENT);
    const char *msg = ss_last_error_message();
    char want[64];
    snprintf(want, sizeof want, "created by pid %d", (int)getppid());
    if (strstr(msg, want) == NULL || strstr(msg, "forked child") == NULL) {
        fprintf(stderr, "unclear refusal in the child: %s\n", msg);
        _exit(3);
    }
}

/* Whether the named segment of a by-name handle is in /dev/shm. */
static int name_exists(const ss_arena_handle *h) {
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", h->segment_name);
    struct stat st;
    return stat(path, &st) == 0;
}

static void opens_in_this_process(ss_arena *a, const ss_arena_handle *h, ss_arena_view **v) {
    if (h->strategy == SS_ARENA_BY_FD) {
        int fd = -1;
        CHECK_OK(ss_arena_segment_fd(a, h->segment_id, &fd));
        CHECK_OK(ss_arena_import_segment_fd(h, dup(fd)));
    }
    CHECK_OK(ss_arena_view_open(h, v));
}

static void test_child_refuses(uint32_t strategy) {
    ss_arena *a = open_arena(strategy);
    void *block = NULL, *held = NULL;
    CHECK_OK(ss_arena_alloc(a, 1000, 64, &block));
    fill(block, 1000, 5);
    CHECK_OK(ss_arena_alloc(a, 1000, 64, &held));
    /* A share in flight and a view of our own, both made before the fork. */
    ss_arena_handle in_flight, viewed;
    CHECK_OK(ss_arena_share(a, block, &in_flight));
    CHECK_OK(ss_arena_share(a, held, &viewed));
    ss_arena_view *view = NULL;
    opens_in_this_process(a, &viewed, &view);
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        alarm(30); /* a hang guard: a refusal must not wait on anything */
        close(sv[0]);
        CHECK(matches(block, 1000, 5));
        void *p = NULL;
        check_refused(ss_arena_alloc(a, 1000, 64, &p));
        CHECK(p == NULL);
        check_refused(ss_arena_dealloc(a, block));
        ss_arena_handle h;
        check_refused(ss_arena_share(a, block, &h));
        check_refused(ss_arena_unshare(a, &in_flight));
        int fd = -1;
        check_refused(ss_arena_segment_fd(a, in_flight.segment_id, &fd));
        check_refused(ss_arena_collect(a, NULL, NULL));
        ss_arena_stats st;
        check_refused(ss_arena_stats_get(a, &st));
        check_refused(ss_arena_send(a, sv[1], block));
        ss_storage *s = NULL;
        check_refused(ss_storage_new_in_arena(a, 4096, &s));
        CHECK(matches(block, 1000, 5));
        /* An arena of the child's own works. */
        ss_arena *own = open_arena(strategy);
        void *q = NULL;
        CHECK_OK(ss_arena_alloc(own, 1000, 64, &q));
        fill(q, 1000, 9);
        CHECK_OK(ss_arena_dealloc(own, q));
        ss_arena_close(own);
        /* Neither releases anything of the parent's. */
        ss_arena_view_free(view);
        ss_arena_close(a);
        CHECK(write(sv[1], "d", 1) == 1);
        _exit(0);
    }
    close(sv[1]);
    char c;
    CHECK(read(sv[0], &c, 1) == 1 && c == 'd');
    wait_child_ok(pid);
    close(sv[0]);
    /* The parent's allocator is whole: its next block is a new one, with
     * none of the child's bytes, and its blocks are still live. */
    void *next = NULL;
    CHECK_OK(ss_arena_alloc(a, 1000, 64, &next));
    CHECK(next != block && next != held);
    CHECK(all_zero(next, 1000));
    ss_arena_stats st;
    CHECK_OK(ss_arena_stats_get(a, &st));
    CHECK(st.live_blocks == 3 && st.deferred_blocks == 0);
    /* The share the child could not cancel is still in flight. */
    CHECK_OK(ss_arena_unshare(a, &in_flight));
    /* Our view still holds its block: freed, the block waits. */
    CHECK_OK(ss_arena_dealloc(a, held));
    CHECK_OK(ss_arena_collect(a, NULL, NULL));
    CHECK_OK(ss_arena_stats_get(a, &st));
    CHECK(st.deferred_blocks == 1);
    CHECK(ss_arena_view_size(view) >= 1000);
    ss_arena_view_free(view);
    /* The segment was neither retired nor unlinked by the child's close. */
    ss_arena_handle again;
    CHECK_OK(ss_arena_share(a, block, &again));
    if (strategy == SS_ARENA_BY_NAME) CHECK(name_exists(&again));
    ss_arena_view *v2 = NULL;
    CHECK_OK(ss_arena_view_open(&again, &v2));
    CHECK(matches(ss_arena_view_data(v2), 1000, 5));
    ss_arena_view_free(v2);
    CHECK_OK(ss_arena_dealloc(a, block));
    CHECK_OK(ss_arena_dealloc(a, next));
    ss_arena_close(a);
}

struct busy {
    ss_arena *arena;
    atomic_int stop;
};

static void *churn(void *arg) {
    struct busy *b = arg;
    while (!atomic_load(&b->stop)) {
        void *p = NULL;
        CHECK_OK(ss_arena_alloc(b->arena, 3000, 64, &p));
        ss_arena_handle h;
        CHECK_OK(ss_arena_share(b->arena, p, &h));
        CHECK_OK(ss_arena_unshare(b->arena, &h));
        CHECK_OK(ss_arena_dealloc(b->arena, p));
    }
    return NULL;
}

/* Forks while two threads allocate, share and free in the arena: each
 * child's calls are refused at once, never waiting on the lock a vanished
 * thread held, and its close releases nothing. */
static void test_fork_from_threaded_parent(uint32_t strategy) {
    struct busy b;
    b.arena = open_arena(strategy);
    atomic_init(&b.stop, 0);
    pthread_t t[2];
    for (int i = 0; i < 2; i++) CHECK(pthread_create(&t[i], NULL, churn, &b) == 0);
    for (int round = 0; round < 40; round++) {
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            alarm(30);
            void *p = NULL;
            check_refused(ss_arena_alloc(b.arena, 3000, 64, &p));
            check_refused(ss_arena_dealloc(b.arena, p));
            ss_arena_close(b.arena);
            _exit(0);
        }
        wait_child_ok(pid);
    }
    atomic_store(&b.stop, 1);
    for (int i = 0; i < 2; i++) CHECK(pthread_join(t[i], NULL) == 0);
    ss_arena_stats st;
    CHECK_OK(ss_arena_stats_get(b.arena, &st));
    CHECK(st.live_blocks == 0);
    void *p = NULL;
    CHECK_OK(ss_arena_alloc(b.arena, 3000, 64, &p));
    CHECK_OK(ss_arena_dealloc(b.arena, p));
    ss_arena_close(b.arena);
}

int main(void) {
    test_child_refuses(SS_ARENA_BY_FD);
    test_child_refuses(SS_ARENA_BY_NAME);
    test_fork_from_threaded_parent(SS_ARENA_BY_FD);
    test_fork_from_threaded_parent(SS_ARENA_BY_NAME);
    puts("test_arena_fork: ok");
    return 0;
}
