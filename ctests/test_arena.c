/* The shareable arena through the C header: blocks sent to a forked child
 * by ss_arena_send (fd once per segment) and by hand (share + segment fd +
 * import + open_remote), by name, a held block not reused, double free,
 * foreign pointers and bad handles as statuses. */
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "forks.h"

static int matches(const unsigned char *p, size_t n, unsigned seed) {
    return matches_from(p, 0, n, seed);
}

/* Ten blocks by ss_arena_send, then one by hand; the child checks each and
 * answers one byte; it keeps the last block until told to let go. */
static void test_send_to_child(uint32_t strategy) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        for (unsigned i = 0; i < 10; i++) {
            ss_arena_view *v = NULL;
            CHECK_OK(ss_arena_recv(sv[1], &v));
            CHECK(ss_arena_view_size(v) >= 5000);
            CHECK(matches(ss_arena_view_data(v), 5000, i));
            ss_arena_view_free(v);
        }
        ss_arena_handle h;
        CHECK(read(sv[1], &h, sizeof h) == (ssize_t)sizeof h);
        if (h.strategy == SS_ARENA_BY_FD) {
            /* This segment came with the ss_arena_send messages already. */
            ss_arena_view *v = NULL;
            CHECK_OK(ss_arena_view_open(&h, &v));
            CHECK(matches(ss_arena_view_data(v), 100, 77));
            CHECK(write(sv[1], "k", 1) == 1);
            char c;
            CHECK(read(sv[1], &c, 1) == 1);
            ss_arena_view_free(v);
        } else {
            ss_arena_view *v = NULL;
            CHECK_OK(ss_arena_view_open(&h, &v));
            CHECK(matches(ss_arena_view_data(v), 100, 77));
            CHECK_STATUS(ss_arena_view_open(&h, &v), SS_ERR_INVALID_ARGUMENT);
            CHECK(write(sv[1], "k", 1) == 1);
            char c;
            CHECK(read(sv[1], &c, 1) == 1);
            ss_arena_view_free(v);
        }
        CHECK(write(sv[1], "r", 1) == 1);
        _exit(0);
    }
    close(sv[1]);
    ss_arena *a = open_arena(strategy);
    for (unsigned i = 0; i < 10; i++) {
        void *p = NULL;
        CHECK_OK(ss_arena_alloc(a, 5000, 64, &p));
        fill(p, 5000, i);
        CHECK_OK(ss_arena_send(a, sv[0], p));
        CHECK_OK(ss_arena_dealloc(a, p));
    }
    void *p = NULL;
    CHECK_OK(ss_arena_alloc(a, 100, 8, &p));
    fill(p, 100, 77);
    ss_arena_handle h;
    CHECK_OK(ss_arena_share(a, p, &h));
    CHECK(h.strategy == strategy && h.size >= 100 && h.producer_pid == getpid());
    if (strategy == SS_ARENA_BY_NAME) {
        CHECK(strncmp(h.segment_name, "/ss_arena_", 10) == 0);
        int fd = -1;
        CHECK_STATUS(ss_arena_segment_fd(a, h.segment_id, &fd), SS_ERR_UNSUPPORTED);
    } else {
        int fd = -1;
        CHECK_OK(ss_arena_segment_fd(a, h.segment_id, &fd));
        CHECK(fd >= 0);
    }
    CHECK(write(sv[0], &h, sizeof h) == (ssize_t)sizeof h);
    char c;
    CHECK(read(sv[0], &c, 1) == 1 && c == 'k');
    /* The ten sent blocks are released by now: reuse them. */
    CHECK_OK(ss_arena_collect(a, NULL, NULL));
    /* Held by the child: freed here, not reused. */
    CHECK_OK(ss_arena_dealloc(a, p));
    ss_arena_stats st;
    CHECK_OK(ss_arena_stats_get(a, &st));
    CHECK(st.deferred_blocks == 1);
    void *q = NULL;
    CHECK_OK(ss_arena_alloc(a, 100, 8, &q));
    CHECK(q != p);
    CHECK(write(sv[0], "g", 1) == 1);
    CHECK(read(sv[0], &c, 1) == 1 && c == 'r');
    wait_child_ok(pid);
    size_t reclaimed = 9, recycled = 9;
    CHECK_OK(ss_arena_collect(a, &reclaimed, &recycled));
    CHECK(reclaimed == 0 && recycled == 1);
    void *r = NULL;
    CHECK_OK(ss_arena_alloc(a, 100, 8, &r));
    CHECK(r == p);
    close(sv[0]);
    ss_arena_close(a);
}

static void test_errors(void) {
    ss_arena *a = open_arena(SS_ARENA_BY_FD);
    void *p = NULL;
    CHECK_OK(ss_arena_alloc(a, 64, 8, &p));
    CHECK_STATUS(ss_arena_alloc(a, 0, 8, &p), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_arena_alloc(a, 64, 3, &p), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_arena_alloc(NULL, 64, 8, &p), SS_ERR_NULL_POINTER);
    ss_arena_handle h;
    CHECK_OK(ss_arena_share(a, p, &h));
    ss_arena_handle bad = h;
    bad.strategy = 9;
    ss_arena_view *v = NULL;
    CHECK_STATUS(ss_arena_view_open(&bad, &v), SS_ERR_INVALID_ARGUMENT);
    bad = h;
    bad.offset = bad.segment_size;
    CHECK_STATUS(ss_arena_view_open(&bad, &v), SS_ERR_INVALID_ARGUMENT);
    /* By fd, the segment must be imported first. */
    CHECK_STATUS(ss_arena_view_open(&h, &v), SS_ERR_NOT_FOUND);
    CHECK_STATUS(ss_arena_import_segment_fd(&h, -1), SS_ERR_INVALID_ARGUMENT);
    CHECK_OK(ss_arena_unshare(a, &h));
    CHECK_STATUS(ss_arena_unshare(a, &h), SS_ERR_INVALID_ARGUMENT);
    CHECK_OK(ss_arena_dealloc(a, p));
    CHECK_STATUS(ss_arena_dealloc(a, p), SS_ERR_INVALID_ARGUMENT);
    int local = 0;
    CHECK_STATUS(ss_arena_dealloc(a, &local), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "foreign") != NULL);
    ss_storage *s = NULL;
    CHECK_OK(ss_storage_new_in_arena(a, (size_t)2 << 20, &s));
    memset(ss_storage_data(s), 5, (size_t)2 << 20);
    int fd = -1;
    size_t n = 0;
    void *before = ss_storage_data(s);
    CHECK_OK(ss_storage_share_fd(s, &fd, &n));
    CHECK(n == (size_t)2 << 20 && ss_storage_data(s) == before);
    ss_storage *o = NULL;
    CHECK_OK(ss_storage_new_shared_fd(fd, n, &o));
    CHECK(((unsigned char *)ss_storage_data(o))[n - 1] == 5);
    ss_storage_free(o);
    ss_storage_free(s);
    ss_arena_close(a);
    ss_arena_close(NULL);
    ss_arena_view_free(NULL);
}

/* A handle whose block (offset, size), hold (slot, generation) or segment
 * differs from what the segment records for the share opens nothing and
 * cancels nothing; the real handle still opens, with its own size. */
static void test_altered_handles(uint32_t strategy) {
    ss_arena *a = open_arena(strategy);
    void *p = NULL, *q = NULL;
    CHECK_OK(ss_arena_alloc(a, 4096, 4096, &p));
    CHECK_OK(ss_arena_alloc(a, 4096, 4096, &q));
    CHECK((char *)q == (char *)p + 4096);
    memset(p, 1, 4096);
    memset(q, 2, 4096);
    ss_arena_handle good, neighbour;
    CHECK_OK(ss_arena_share(a, p, &good));
    CHECK_OK(ss_arena_share(a, q, &neighbour));
    if (strategy == SS_ARENA_BY_FD) {
        int fd = -1;
        CHECK_OK(ss_arena_segment_fd(a, good.segment_id, &fd));
        CHECK_OK(ss_arena_import_segment_fd(&good, dup(fd)));
    }
    for (int i = 0; i < 10; i++) {
        ss_arena_handle h = good;
        switch (i) {
        case 0: h.size = 1; break;
        case 1: h.size = 8192; break; /* would reach the neighbour */
        case 2: h.size = 4095; break;
        case 3: h.size = 4097; break;
        case 4: h.offset += 4096; break;
        case 5: h.offset += 4096; h.size = 4096; h.hold_slot = neighbour.hold_slot + 1; break;
        case 6: h.hold_slot = neighbour.hold_slot; break;
        case 7: h.hold_generation += 1; break;
        case 8: h.segment_size *= 2; break;
        default: h.producer_start += 1; break;
        }
        ss_arena_view *v = NULL;
        ss_status st = ss_arena_view_open(&h, &v);
        if (st == SS_OK) {
            fprintf(stderr, "altered handle %d (offset %llu, size %llu, slot %u) opened\n", i,
                    (unsigned long long)h.offset, (unsigned long long)h.size, h.hold_slot);
            exit(1);
        }
        if (i < 4) {
            CHECK(st == SS_ERR_INVALID_ARGUMENT);
            CHECK(strstr(ss_last_error_message(), "size") != NULL);
        }
        CHECK(ss_arena_unshare(a, &h) != SS_OK);
    }
    ss_arena_view *v = NULL, *w = NULL;
    CHECK_OK(ss_arena_view_open(&good, &v));
    CHECK_OK(ss_arena_view_open(&neighbour, &w));
    CHECK(ss_arena_view_size(v) == 4096);
    CHECK(*(unsigned char *)ss_arena_view_data(v) == 1 && *(unsigned char *)ss_arena_view_data(w) == 2);
    ss_arena_view_free(v);
    ss_arena_view_free(w);
    ss_arena_close(a);
}

/* Only segment_size set (below 4 MiB): the default large threshold
 * follows it, a quarter of the segment. */
static void test_segment_size_alone(void) {
    ss_arena_options o;
    CHECK_OK(ss_arena_options_default(&o));
    o.segment_size = (size_t)1 << 20;
    ss_arena *a = NULL;
    CHECK_OK(ss_arena_open(&o, &a));
    void *small = NULL, *large = NULL;
    CHECK_OK(ss_arena_alloc(a, (size_t)200 << 10, 64, &small));
    CHECK_OK(ss_arena_alloc(a, (size_t)300 << 10, 64, &large));
    ss_arena_stats st;
    CHECK_OK(ss_arena_stats_get(a, &st));
    CHECK(st.segments == 2);
    ss_arena_close(a);
    o.large_threshold = (size_t)512 << 10;
    CHECK_STATUS(ss_arena_open(&o, &a), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "large_threshold") != NULL);
}

/* The initializer macro gives the defaults; an options struct whose
 * struct_size was never set, or is larger than this library knows, is
 * refused by name. */
static void test_options_struct_size(void) {
    ss_arena_options init = SS_ARENA_OPTIONS_INIT, def;
    CHECK_OK(ss_arena_options_default(&def));
    CHECK(init.struct_size == sizeof(ss_arena_options) && def.struct_size == sizeof(ss_arena_options));
    CHECK(init.segment_size == def.segment_size && init.strategy == def.strategy);
    CHECK(init.max_holds == def.max_holds && init.large_threshold == def.large_threshold);
    ss_arena *a = NULL;
    CHECK_OK(ss_arena_open(&init, &a));
    ss_arena_close(a);
    a = NULL;
    ss_arena_options bad = init;
    bad.struct_size = 0;
    CHECK_STATUS(ss_arena_open(&bad, &a), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "SS_ARENA_OPTIONS_INIT") != NULL);
    bad.struct_size = sizeof bad + 8;
    CHECK_STATUS(ss_arena_open(&bad, &a), SS_ERR_UNSUPPORTED);
    CHECK(a == NULL);
}

int main(void) {
    test_send_to_child(SS_ARENA_BY_FD);
    test_send_to_child(SS_ARENA_BY_NAME);
    test_errors();
    test_altered_handles(SS_ARENA_BY_FD);
    test_altered_handles(SS_ARENA_BY_NAME);
    test_segment_size_alone();
    test_options_struct_size();
    puts("test_arena: ok");
    return 0;
}
