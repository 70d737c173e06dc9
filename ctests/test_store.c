/* Stores through the C API: a store implemented here in C and used through
 * ss_store_callbacks_open (set, get with a value longer than the library's
 * first buffer, add, wait, timeouts, free_ctx once after the last
 * reference), the file store (and its lock timeout), and a TCPStore master
 * with a client thread. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

/* ---- a small thread-safe in-memory store (the "host framework's") ---- */

#define MAX_KEYS 64

struct entry {
    char *key;
    unsigned char *value;
    size_t len;
};

struct host_store {
    pthread_mutex_t mu;
    pthread_cond_t changed;
    struct entry entries[MAX_KEYS];
    size_t n;
    int frees; /* how often free_ctx ran */
    int get_calls;
};

static struct entry *find(struct host_store *h, const char *key) {
    for (size_t i = 0; i < h->n; i++)
        if (strcmp(h->entries[i].key, key) == 0) return &h->entries[i];
    return NULL;
}

static int put(struct host_store *h, const char *key, const void *value, size_t len) {
    struct entry *e = find(h, key);
    if (!e) {
        if (h->n == MAX_KEYS) return SS_ERR_NO_SPACE;
        e = &h->entries[h->n++];
        e->key = strdup(key);
        e->value = NULL;
    }
    free(e->value);
    e->value = malloc(len ? len : 1);
    if (len) memcpy(e->value, value, len);
    e->len = len;
    pthread_cond_broadcast(&h->changed);
    return SS_OK;
}

/* Waits on the condition until `ready` holds; timeout_ms 0 waits forever. */
static int wait_until(struct host_store *h, int64_t timeout_ms, int (*ready)(struct host_store *, const void *), const void *arg) {
    struct timespec end;
    clock_gettime(CLOCK_REALTIME, &end);
    end.tv_sec += (time_t)(timeout_ms / 1000);
    end.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (end.tv_nsec >= 1000000000L) {
        end.tv_sec++;
        end.tv_nsec -= 1000000000L;
    }
    while (!ready(h, arg)) {
        if (timeout_ms == 0) {
            pthread_cond_wait(&h->changed, &h->mu);
        } else if (pthread_cond_timedwait(&h->changed, &h->mu, &end) == ETIMEDOUT && !ready(h, arg)) {
            return SS_ERR_TIMEOUT;
        }
    }
    return SS_OK;
}

static int has_key(struct host_store *h, const void *key) { return find(h, (const char *)key) != NULL; }

struct key_list {
    const char *const *keys;
    size_t n;
};

static int has_all(struct host_store *h, const void *arg) {
    const struct key_list *l = arg;
    for (size_t i = 0; i < l->n; i++)
        if (!find(h, l->keys[i])) return 0;
    return 1;
}

static int cb_set(void *ctx, const char *key, const void *value, size_t len) {
    struct host_store *h = ctx;
    pthread_mutex_lock(&h->mu);
    int rc = put(h, key, value, len);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

static int cb_get(void *ctx, const char *key, int64_t timeout_ms, void *buf, size_t buf_len, size_t *out_len) {
    struct host_store *h = ctx;
    pthread_mutex_lock(&h->mu);
    h->get_calls++;
    int rc = wait_until(h, timeout_ms, has_key, key);
    if (rc == SS_OK) {
        struct entry *e = find(h, key);
        *out_len = e->len;
        if (e->len > buf_len) rc = SS_ERR_BUFFER_TOO_SMALL;
        else if (e->len) memcpy(buf, e->value, e->len);
    }
    pthread_mutex_unlock(&h->mu);
    return rc;
}

static int cb_add(void *ctx, const char *key, int64_t delta, int64_t *out_value) {
    struct host_store *h = ctx;
    pthread_mutex_lock(&h->mu);
    struct entry *e = find(h, key);
    long long v = 0;
    if (e) {
        char text[32] = {0};
        memcpy(text, e->value, e->len < 31 ? e->len : 31);
        v = strtoll(text, NULL, 10);
    }
    v += delta;
    char text[32];
    int n = snprintf(text, sizeof text, "%lld", v);
    int rc = put(h, key, text, (size_t)n);
    pthread_mutex_unlock(&h->mu);
    *out_value = v;
    return rc;
}

static int cb_wait(void *ctx, const char *const *keys, size_t nkeys, int64_t timeout_ms) {
    struct host_store *h = ctx;
    struct key_list l = {keys, nkeys};
    pthread_mutex_lock(&h->mu);
    int rc = wait_until(h, timeout_ms, has_all, &l);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

static void cb_free(void *ctx) {
    struct host_store *h = ctx;
    for (size_t i = 0; i < h->n; i++) {
        free(h->entries[i].key);
        free(h->entries[i].value);
    }
    h->n = 0;
    h->frees++;
}

static void *late_setter(void *arg) {
    usleep(50 * 1000);
    CHECK_OK(ss_store_set((const ss_store *)arg, "late", "on time", 7));
    return NULL;
}

/* The same checks on any store. */
static void exercise(const ss_store *s) {
    char big[1000];
    for (size_t i = 0; i < sizeof big; i++) big[i] = (char)('a' + i % 26);
    CHECK_OK(ss_store_set(s, "grp/0/0", big, sizeof big));
    char buf[1024];
    size_t len = 0;
    CHECK_STATUS(ss_store_get(s, "grp/0/0", 1000, buf, 10, &len), SS_ERR_BUFFER_TOO_SMALL);
    CHECK(len == sizeof big);
    CHECK_OK(ss_store_get(s, "grp/0/0", 1000, buf, sizeof buf, &len));
    CHECK(len == sizeof big && memcmp(buf, big, len) == 0);

    int64_t v = 0;
    CHECK_OK(ss_store_add(s, "count", 3, &v));
    CHECK(v == 3);
    CHECK_OK(ss_store_add(s, "count", -5, &v));
    CHECK(v == -2);

    const char *keys[] = {"grp/0/0", "count", "missing/1"};
    CHECK_OK(ss_store_wait(s, keys, 2, 1000));
    CHECK_STATUS(ss_store_wait(s, keys, 3, 50), SS_ERR_TIMEOUT);
    CHECK(strstr(ss_last_error_message(), "\"missing/1\"") != NULL);
    CHECK_STATUS(ss_store_get(s, "missing/2", 30, buf, sizeof buf, &len), SS_ERR_TIMEOUT);
    CHECK(strstr(ss_last_error_message(), "\"missing/2\"") != NULL);
    CHECK_STATUS(ss_store_wait(s, keys, 1, -1), SS_ERR_INVALID_ARGUMENT);

    pthread_t t;
    CHECK(pthread_create(&t, NULL, late_setter, (void *)s) == 0);
    CHECK_OK(ss_store_get(s, "late", 0, buf, sizeof buf, &len)); /* 0: waits forever */
    CHECK(len == 7 && memcmp(buf, "on time", 7) == 0);
    pthread_join(t, NULL);
}

/* check, compare_set, delete_key, num_keys: the same answers from the file
 * store and the TCPStore (c10d's semantics). `base` keys exist already. */
static void exercise_more(const ss_store *s, int64_t base) {
    bool all = false;
    const char *keys[] = {"grp/0/0", "count", "cas"};
    CHECK_OK(ss_store_check(s, keys, 2, &all));
    CHECK(all);
    CHECK_OK(ss_store_check(s, keys, 3, &all));
    CHECK(!all);
    CHECK_OK(ss_store_check(s, NULL, 0, &all));
    CHECK(all);
    CHECK_STATUS(ss_store_check(s, keys, 1, NULL), SS_ERR_NULL_POINTER);

    char buf[16];
    size_t len = 0;
    /* Missing key, expected not empty: the answer is expected, nothing made. */
    CHECK_OK(ss_store_compare_set(s, "cas", "x", 1, "first", 5, buf, sizeof buf, &len));
    CHECK(len == 1 && buf[0] == 'x');
    CHECK_OK(ss_store_check(s, keys + 2, 1, &all));
    CHECK(!all);
    /* Missing key, expected empty: created. */
    CHECK_OK(ss_store_compare_set(s, "cas", NULL, 0, "first", 5, buf, sizeof buf, &len));
    CHECK(len == 5 && memcmp(buf, "first", 5) == 0);
    /* Wrong expected: the current value, unchanged. */
    CHECK_OK(ss_store_compare_set(s, "cas", "nope", 4, "second", 6, buf, sizeof buf, &len));
    CHECK(len == 5 && memcmp(buf, "first", 5) == 0);
    /* Right expected, buffer too small: swapped all the same, length told. */
    CHECK_STATUS(ss_store_compare_set(s, "cas", "first", 5, "second", 6, buf, 2, &len), SS_ERR_BUFFER_TOO_SMALL);
    CHECK(len == 6);
    CHECK_OK(ss_store_get(s, "cas", 1000, buf, sizeof buf, &len));
    CHECK(len == 6 && memcmp(buf, "second", 6) == 0);

    int64_t n = 0;
    CHECK_OK(ss_store_num_keys(s, &n));
    CHECK(n == base + 1);
    bool existed = false;
    CHECK_OK(ss_store_delete_key(s, "cas", &existed));
    CHECK(existed);
    CHECK_OK(ss_store_delete_key(s, "cas", &existed));
    CHECK(!existed);
    CHECK_OK(ss_store_delete_key(s, "cas", NULL));
    CHECK_OK(ss_store_num_keys(s, &n));
    CHECK(n == base);
    CHECK_STATUS(ss_store_num_keys(s, NULL), SS_ERR_NULL_POINTER);
}

static void test_callbacks(void) {
    static struct host_store h = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {{0}}, 0, 0, 0};
    ss_store_callbacks cb = SS_STORE_CALLBACKS_INIT;
    cb.set = cb_set;
    cb.get = cb_get;
    cb.add = cb_add;
    cb.wait = cb_wait;
    cb.free_ctx = cb_free;
    ss_store *s = NULL;
    CHECK_OK(ss_store_callbacks_open(&cb, &h, &s));
    exercise(s);
    /* The 1000-byte value did not fit the first buffer: asked again. */
    CHECK(h.get_calls >= 2);

    /* A second reference keeps the context alive; free_ctx runs once. */
    ss_store *s2 = NULL;
    CHECK_OK(ss_store_ref(s, &s2));
    ss_store_free(s);
    CHECK(h.frees == 0);
    size_t len = 0;
    char buf[8];
    CHECK_OK(ss_store_get(s2, "late", 10, buf, sizeof buf, &len));
    ss_store_free(s2);
    CHECK(h.frees == 1);

    /* Callbacks cover set/get/add/wait only: the rest is refused by name. */
    CHECK_OK(ss_store_callbacks_open(&cb, &h, &s));
    bool all = false;
    CHECK_STATUS(ss_store_check(s, NULL, 0, &all), SS_ERR_UNSUPPORTED);
    CHECK(strstr(ss_last_error_message(), "check") != NULL);
    CHECK_STATUS(ss_store_compare_set(s, "k", NULL, 0, "v", 1, NULL, 0, &len), SS_ERR_UNSUPPORTED);
    CHECK_STATUS(ss_store_delete_key(s, "k", NULL), SS_ERR_UNSUPPORTED);
    int64_t n = 0;
    CHECK_STATUS(ss_store_num_keys(s, &n), SS_ERR_UNSUPPORTED);
    ss_store_free(s);
    CHECK(h.frees == 2);

    /* A table without a required function is refused, ctx untouched. */
    ss_store_callbacks partial = cb;
    partial.get = NULL;
    s = NULL;
    CHECK_STATUS(ss_store_callbacks_open(&partial, &h, &s), SS_ERR_NULL_POINTER);
    CHECK(s == NULL && h.frees == 2);
    CHECK(strstr(ss_last_error_message(), "cb->get") != NULL);
    CHECK_STATUS(ss_store_callbacks_open(NULL, &h, &s), SS_ERR_NULL_POINTER);

    /* A table whose struct_size was never set, or comes from a newer
     * header, is refused by name; ctx stays the caller's. */
    ss_store_callbacks unsized = cb;
    unsized.struct_size = 0;
    CHECK_STATUS(ss_store_callbacks_open(&unsized, &h, &s), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "SS_STORE_CALLBACKS_INIT") != NULL);
    unsized.struct_size = sizeof cb + 8;
    CHECK_STATUS(ss_store_callbacks_open(&unsized, &h, &s), SS_ERR_UNSUPPORTED);
    CHECK(s == NULL && h.frees == 2);
}

static void test_file_store(void) {
    char dir[] = "/tmp/ss-ctest-store-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    ss_store *s = NULL;
    CHECK_OK(ss_store_file_open(dir, &s));
    exercise(s);
    exercise_more(s, 3); /* grp/0/0, count, late */
    int port = 0;
    CHECK_STATUS(ss_store_tcp_port(s, &port), SS_ERR_UNSUPPORTED);
    ss_store_free(s);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

/* A stuck holder of the folder's lock (here this test, through a second
 * open file description): writes give up after the lock timeout given. */
static void test_file_store_lock_timeout(void) {
    char dir[] = "/tmp/ss-ctest-lock-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    ss_store *s = NULL;
    CHECK_STATUS(ss_store_file_open_with_lock_timeout(dir, -1, &s), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "timeout_ms") != NULL && s == NULL);
    CHECK_OK(ss_store_file_open_with_lock_timeout(dir, 200, &s));
    CHECK_OK(ss_store_set(s, "k", "v", 1));
    char lock[64];
    snprintf(lock, sizeof lock, "%s/.lock", dir);
    int held = open(lock, O_RDONLY | O_CLOEXEC);
    CHECK(held >= 0 && flock(held, LOCK_EX) == 0);
    CHECK_STATUS(ss_store_set(s, "k", "w", 1), SS_ERR_TIMEOUT);
    CHECK(strstr(ss_last_error_message(), "lock") != NULL);
    int64_t value = 0;
    CHECK_STATUS(ss_store_add(s, "n", 1, &value), SS_ERR_TIMEOUT);
    close(held);
    CHECK_OK(ss_store_set(s, "k", "w", 1));
    ss_store_free(s);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

static void *tcp_rank1(void *arg) {
    int port = *(int *)arg;
    ss_store *c = NULL;
    CHECK_OK(ss_store_tcp_open("127.0.0.1", port, false, 2, 10000, &c));
    CHECK_OK(ss_store_set(c, "from/1", "one", 3));
    ss_store_free(c);
    return NULL;
}

static void test_tcp_store(void) {
    /* Rank 0 serves on a free port with no join wait, rank 1 joins. */
    ss_store *m = NULL;
    CHECK_OK(ss_store_tcp_open("127.0.0.1", 0, true, 0, 10000, &m));
    int port = 0;
    CHECK_OK(ss_store_tcp_port(m, &port));
    CHECK(port > 0 && port < 65536);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, tcp_rank1, &port) == 0);
    char buf[8];
    size_t len = 0;
    CHECK_OK(ss_store_get(m, "from/1", 10000, buf, sizeof buf, &len));
    CHECK(len == 3 && memcmp(buf, "one", 3) == 0);
    pthread_join(t, NULL);
    exercise(m);
    exercise_more(m, 5); /* init/, from/1, grp/0/0, count, late */

    /* The port is taken now: a second master is refused, naming it. */
    ss_store *again = NULL;
    CHECK_STATUS(ss_store_tcp_open("127.0.0.1", port, true, 0, 1000, &again), SS_ERR_BUSY);
    char want[32];
    snprintf(want, sizeof want, "127.0.0.1:%d", port);
    CHECK(strstr(ss_last_error_message(), want) != NULL);
    CHECK_STATUS(ss_store_tcp_open("127.0.0.1", 70000, false, 0, 1000, &again), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_store_tcp_open("127.0.0.1", 0, false, 0, 1000, &again), SS_ERR_INVALID_ARGUMENT);
    ss_store_free(m);
}

int main(void) {
    test_callbacks();
    test_file_store();
    test_file_store_lock_timeout();
    test_tcp_store();
    ss_store_free(NULL);
    printf("test_store: ok\n");
    return 0;
}
