/* Helpers of the C tests that fork children and check bytes they share:
 * a byte pattern, waiting for a child, a small test arena. */
#ifndef SS_CTEST_FORKS_H
#define SS_CTEST_FORKS_H

#include <sys/types.h>
#include <sys/wait.h>

#include "check.h"

/* Byte `i` of the pattern of `seed`. */
static inline unsigned char pattern_byte(size_t i, unsigned seed) {
    return (unsigned char)(i * 31u + seed);
}

static inline void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = pattern_byte(i, seed);
}

/* Whether bytes `from`..n-1 of `p` follow the pattern of `seed`. */
static inline int matches_from(const unsigned char *p, size_t from, size_t n, unsigned seed) {
    for (size_t i = from; i < n; i++)
        if (p[i] != pattern_byte(i, seed)) return 0;
    return 1;
}

/* Waits for `pid`, which must exit 0; says how it ended otherwise. */
static inline void wait_child_ok(pid_t pid) {
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
        fprintf(stderr, "child %d: %s %d\n", (int)pid, WIFSIGNALED(st) ? "killed by signal" : "exit status",
                WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    }
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* An arena of `strategy` with 4 MiB segments. */
static inline ss_arena *open_arena(uint32_t strategy) {
    ss_arena_options o;
    CHECK_OK(ss_arena_options_default(&o));
    o.strategy = strategy;
    o.segment_size = (size_t)4 << 20;
    ss_arena *a = NULL;
    CHECK_OK(ss_arena_open(&o, &a));
    return a;
}

#endif
