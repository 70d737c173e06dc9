/* Content store from C: the README's example (main's first half), then
 * the bad inputs. Writes a 3x4 float32 tensor and its transpose (one
 * storage, stored once), reads them back mapped, verifies the store. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "check.h"
#include "storage_sharing.h"

static void example(const char *dir) {
    float values[12];
    for (int i = 0; i < 12; i++) values[i] = (float)i * 0.5f;
    int64_t shape[2] = {3, 4}, stride[2] = {4, 1};
    int64_t shape_t[2] = {4, 3}, stride_t[2] = {1, 4};

    ss_content_writer *w = NULL;
    CHECK_OK(ss_content_writer_open(dir, SS_CONTENT_FORMAT_NATIVE, &w));
    CHECK_OK(ss_content_writer_write_tensor(w, "layer0/weight", values, sizeof values, SS_DTYPE_FLOAT32, 0, 2, shape, stride));
    CHECK_OK(ss_content_writer_write_tensor(w, "layer0/weight_t", values, sizeof values, SS_DTYPE_FLOAT32, 0, 2, shape_t, stride_t));
    uint64_t written = 0, deduplicated = 0, tensors = 0;
    CHECK_OK(ss_content_writer_counts(w, &written, &deduplicated, &tensors));
    printf("wrote %llu tensors, %llu storage(s), %llu deduplicated\n", (unsigned long long)tensors,
           (unsigned long long)written, (unsigned long long)deduplicated);
    CHECK(written == 1 && deduplicated == 1 && tensors == 2);
    ss_content_writer_free(w);

    ss_content_reader *r = NULL;
    CHECK_OK(ss_content_reader_open(dir, &r));
    CHECK_OK(ss_content_reader_set_verify(r, true));
    ss_content_tensor *t = NULL, *tt = NULL;
    CHECK_OK(ss_content_reader_read_tensor(r, "layer0/weight_t", &t));
    CHECK_OK(ss_content_reader_read_tensor(r, "layer0/weight", &tt));
    CHECK(ss_content_tensor_dtype(t) == SS_DTYPE_FLOAT32);
    CHECK(ss_content_tensor_ndim(t) == 2);
    const int64_t *sh = ss_content_tensor_shape(t), *st = ss_content_tensor_stride(t);
    CHECK(sh[0] == 4 && sh[1] == 3 && st[0] == 1 && st[1] == 4);
    CHECK(ss_content_tensor_offset(t) == 0 && ss_content_tensor_nbytes(t) == sizeof values);
    const float *data = ss_content_tensor_data(t);
    /* element [i][j] of the transposed view sits at i*stride[0] + j*stride[1] */
    CHECK(data[2 * st[0] + 1 * st[1]] == values[1 * 4 + 2]);
    /* one storage, one read-only mapping shared by both tensors */
    CHECK(ss_content_tensor_data(tt) == ss_content_tensor_data(t));
    printf("read %s: storage %s, mapped at %p\n", "layer0/weight_t", ss_content_tensor_storage_hash(t), (const void *)data);

    ss_content_list *names = NULL, *problems = NULL;
    CHECK_OK(ss_content_reader_list_tensors(r, &names));
    CHECK(ss_content_list_len(names) == 2);
    CHECK(strcmp(ss_content_list_get(names, 0), "layer0/weight") == 0);
    CHECK(ss_content_list_get(names, 2) == NULL);
    uint64_t checked = 0;
    CHECK_OK(ss_content_reader_verify(r, &checked, &problems));
    CHECK(checked == 3 && ss_content_list_len(problems) == 0);

    char hash[SS_HASH_HEX_MAX];
    CHECK_OK(ss_content_hash_bytes(values, sizeof values, SS_HASH_FAST, hash, sizeof hash));
    CHECK(strcmp(hash, ss_content_tensor_storage_hash(t)) == 0);
    ss_content_storage *s = NULL;
    CHECK_OK(ss_content_reader_read_storage(r, hash, &s));
    CHECK(ss_content_storage_nbytes(s) == sizeof values && memcmp(ss_content_storage_data(s), values, sizeof values) == 0);

    ss_content_storage_free(s);
    ss_content_list_free(problems);
    ss_content_list_free(names);
    ss_content_tensor_free(tt);
    ss_content_reader_free(r);
    /* the tensor outlives its reader */
    CHECK(((const float *)ss_content_tensor_data(t))[5] == values[5]);
    ss_content_tensor_free(t);
}

static void bad_inputs(const char *dir) {
    char hash[SS_HASH_HEX_MAX];
    CHECK_OK(ss_content_hash_bytes("abc", 3, SS_HASH_STABLE, hash, sizeof hash));
    CHECK(strcmp(hash, "a9993e364706816aba3e25717850c26c9cd0d89d") == 0);
    CHECK_OK(ss_content_hash_bytes(NULL, 0, SS_HASH_FAST, hash, sizeof hash));
    CHECK_STATUS(ss_content_hash_bytes("abc", 3, 7, hash, sizeof hash), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_content_hash_bytes("abc", 3, SS_HASH_STABLE, hash, 40), SS_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(ss_content_hash_bytes(NULL, 3, SS_HASH_STABLE, hash, sizeof hash), SS_ERR_NULL_POINTER);

    ss_content_writer *w = NULL;
    CHECK_STATUS(ss_content_writer_open(dir, 5, &w), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_content_writer_open(NULL, SS_CONTENT_FORMAT_NATIVE, &w), SS_ERR_NULL_POINTER);
    CHECK_OK(ss_content_writer_open(dir, SS_CONTENT_FORMAT_NATIVE, &w));
    int32_t v[4] = {1, 2, 3, 4};
    int64_t shape[1] = {4}, stride[1] = {1}, too_long[1] = {5}, negative[1] = {-1};
    const char *bad_names[] = {"", "/abs", "../up", "a/../b", "a//b", "a/"};
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++)
        CHECK_STATUS(ss_content_writer_write_tensor(w, bad_names[i], v, sizeof v, SS_DTYPE_INT32, 0, 1, shape, stride),
                     SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_content_writer_write_tensor(w, "x", v, sizeof v, 12, 0, 1, shape, stride), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "dtype code 12") != NULL);
    CHECK_STATUS(ss_content_writer_write_tensor(w, "x", v, sizeof v, SS_DTYPE_INT32, 0, 1, too_long, stride), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "needs 20 bytes") != NULL);
    CHECK_STATUS(ss_content_writer_write_tensor(w, "x", v, sizeof v, SS_DTYPE_INT32, 1, 1, shape, stride), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_content_writer_write_tensor(w, "x", v, sizeof v, SS_DTYPE_INT32, 0, 1, shape, negative), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_content_writer_write_tensor(w, "x", v, sizeof v, SS_DTYPE_INT32, 0, 1, NULL, stride), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_content_writer_write_tensor(w, "x", v, sizeof v, SS_DTYPE_INT32, 0, 65, shape, stride), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_content_writer_write_tensor(NULL, "x", v, sizeof v, SS_DTYPE_INT32, 0, 1, shape, stride), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_content_writer_write_storage(w, v, sizeof v, hash, 8), SS_ERR_BUFFER_TOO_SMALL);
    CHECK_OK(ss_content_writer_write_storage(w, v, sizeof v, NULL, 0));
    ss_content_writer_free(w);
    ss_content_writer_free(NULL);

    ss_content_reader *r = NULL;
    CHECK_STATUS(ss_content_reader_open("/nonexistent/ss-content", &r), SS_ERR_NOT_FOUND);
    CHECK_OK(ss_content_reader_open(dir, &r));
    ss_content_tensor *t = NULL;
    CHECK_STATUS(ss_content_reader_read_tensor(r, "../ss-content-store", &t), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_content_reader_read_tensor(r, "missing", &t), SS_ERR_NOT_FOUND);
    CHECK_STATUS(ss_content_reader_read_tensor(r, "layer0/weight", NULL), SS_ERR_NULL_POINTER);
    ss_content_storage *s = NULL;
    CHECK_STATUS(ss_content_reader_read_storage(r, "../tensors/x", &s), SS_ERR_INVALID_ARGUMENT);
    CHECK(t == NULL && s == NULL);
    CHECK(ss_content_tensor_dtype(NULL) == -1 && ss_content_tensor_data(NULL) == NULL);
    ss_content_tensor_free(NULL);
    ss_content_reader_free(r);
}

/* The PyTorch format: SHA-1 names, read back mapped, format detected. */
static void torch_format(const char *parent) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s/torch", parent);
    int16_t v[6] = {1, -2, 3, -4, 5, -6};
    int64_t shape[2] = {2, 2}, stride[2] = {1, 2};
    ss_content_writer *w = NULL;
    CHECK_OK(ss_content_writer_open(dir, SS_CONTENT_FORMAT_TORCH, &w));
    CHECK_OK(ss_content_writer_write_tensor(w, "deep/er/t", v, sizeof v, SS_DTYPE_INT16, 1, 2, shape, stride));
    ss_content_writer_free(w);
    /* a native writer refuses a PyTorch store */
    CHECK_STATUS(ss_content_writer_open(dir, SS_CONTENT_FORMAT_NATIVE, &w), SS_ERR_INVALID_ARGUMENT);

    ss_content_reader *r = NULL;
    CHECK_OK(ss_content_reader_open(dir, &r));
    CHECK(ss_content_reader_format(r) == SS_CONTENT_FORMAT_TORCH);
    CHECK_OK(ss_content_reader_set_verify(r, true));
    ss_content_tensor *t = NULL;
    CHECK_OK(ss_content_reader_read_tensor(r, "deep/er/t", &t));
    char sha1[SS_HASH_HEX_MAX];
    CHECK_OK(ss_content_hash_bytes(v, sizeof v, SS_HASH_STABLE, sha1, sizeof sha1));
    CHECK(strcmp(ss_content_tensor_storage_hash(t), sha1) == 0);
    CHECK(ss_content_tensor_dtype(t) == SS_DTYPE_INT16 && ss_content_tensor_offset(t) == 1);
    CHECK(ss_content_tensor_nbytes(t) == sizeof v && memcmp(ss_content_tensor_data(t), v, sizeof v) == 0);
    CHECK(ss_content_tensor_stride(t)[1] == 2);
    ss_content_list *problems = NULL;
    CHECK_OK(ss_content_reader_verify(r, NULL, &problems));
    CHECK(ss_content_list_len(problems) == 0);
    ss_content_list_free(problems);
    ss_content_tensor_free(t);
    ss_content_reader_free(r);
}

int main(void) {
    char dir[] = "/tmp/ss-content-ctest-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    example(dir);
    bad_inputs(dir);
    torch_format(dir);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    printf("content store C test passed\n");
    return 0;
}
