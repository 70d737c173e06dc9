/* The deprecated ss_store_from_callbacks and callers of 0.1.0: a table
 * laid out as 0.1.0's (five function pointers, no struct_size) and a
 * table whose struct_size was left 0 are refused with
 * SS_ERR_INVALID_ARGUMENT and a message naming struct_size and
 * SS_STORE_CALLBACKS_INIT; ctx stays the caller's. The old table is
 * smaller than today's and ends where a page without access begins, so a
 * library reading past its end crashes the test. A table made with
 * SS_STORE_CALLBACKS_INIT still opens through the alias. */
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

/* This file calls the deprecated name on purpose. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

static int frees;

static int cb_set(void *ctx, const char *key, const void *value, size_t len) {
    (void)ctx, (void)key, (void)value, (void)len;
    return SS_OK;
}

static int cb_get(void *ctx, const char *key, int64_t timeout_ms, void *buf, size_t buf_len, size_t *out_len) {
    (void)ctx, (void)key, (void)timeout_ms, (void)buf, (void)buf_len;
    *out_len = 0;
    return SS_OK;
}

static int cb_add(void *ctx, const char *key, int64_t delta, int64_t *out_value) {
    (void)ctx, (void)key;
    *out_value = delta;
    return SS_OK;
}

static int cb_wait(void *ctx, const char *const *keys, size_t nkeys, int64_t timeout_ms) {
    (void)ctx, (void)keys, (void)nkeys, (void)timeout_ms;
    return SS_OK;
}

static void cb_free(void *ctx) {
    (void)ctx;
    frees++;
}

/* ss_store_callbacks as 0.1.0's header declared it. */
struct store_callbacks_0_1 {
    ss_store_set_fn set;
    ss_store_get_fn get;
    ss_store_add_fn add;
    ss_store_wait_fn wait;
    ss_store_free_ctx_fn free_ctx;
};

static void expect_refused(const ss_store_callbacks *table, const char *also) {
    ss_store *s = NULL;
    CHECK_STATUS(ss_store_from_callbacks(table, NULL, &s), SS_ERR_INVALID_ARGUMENT);
    const char *msg = ss_last_error_message();
    CHECK(strstr(msg, "struct_size") != NULL);
    CHECK(strstr(msg, "SS_STORE_CALLBACKS_INIT") != NULL);
    CHECK(strstr(msg, also) != NULL);
    CHECK(s == NULL && frees == 0);
}

int main(void) {
    /* A 0.1.0 binary: its table starts with `set`, and it is 8 bytes
     * shorter than today's. It ends at a page the process cannot read. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    unsigned char *pages = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(pages != MAP_FAILED);
    CHECK(mprotect(pages + page, page, PROT_NONE) == 0);
    struct store_callbacks_0_1 *old = (struct store_callbacks_0_1 *)(void *)(pages + page - sizeof *old);
    old->set = cb_set;
    old->get = cb_get;
    old->add = cb_add;
    old->wait = cb_wait;
    old->free_ctx = cb_free;
    expect_refused((const ss_store_callbacks *)(const void *)old, "0.1.0");
    CHECK(munmap(pages, 2 * page) == 0);

    /* Today's table, zeroed and filled by hand: struct_size 0. */
    ss_store_callbacks zeroed;
    memset(&zeroed, 0, sizeof zeroed);
    zeroed.set = cb_set;
    zeroed.get = cb_get;
    zeroed.add = cb_add;
    zeroed.wait = cb_wait;
    zeroed.free_ctx = cb_free;
    expect_refused(&zeroed, "is 0");

    /* Initialized as documented, the alias opens the store. */
    ss_store_callbacks cb = SS_STORE_CALLBACKS_INIT;
    cb.set = cb_set;
    cb.get = cb_get;
    cb.add = cb_add;
    cb.wait = cb_wait;
    cb.free_ctx = cb_free;
    ss_store *s = NULL;
    CHECK_OK(ss_store_from_callbacks(&cb, NULL, &s));
    int64_t value = 0;
    CHECK_OK(ss_store_add(s, "k", 5, &value));
    CHECK(value == 5);
    ss_store_free(s);
    CHECK(frees == 1);
    CHECK_STATUS(ss_store_from_callbacks(NULL, NULL, &s), SS_ERR_NULL_POINTER);

    printf("test_store_callbacks_0_1_table: ok\n");
    return 0;
}
