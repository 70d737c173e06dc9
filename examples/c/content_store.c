#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <storage_sharing.h>

#define TRY(call)                                                              \
    do {                                                                       \
        if ((call) != SS_OK) {                                                 \
            fprintf(stderr, "%s: %s\n", #call, ss_last_error_message());       \
            return 1;                                                          \
        }                                                                      \
    } while (0)

int main(void) {
    char dir[] = "/tmp/content-store-example-XXXXXX";
    if (!mkdtemp(dir)) return 1;

    /* A 3x4 float32 tensor and its transpose: two entries, one storage. */
    float values[12];
    for (int i = 0; i < 12; i++) values[i] = (float)i;
    int64_t shape[2] = {3, 4}, stride[2] = {4, 1};
    int64_t shape_t[2] = {4, 3}, stride_t[2] = {1, 4};
    ss_content_writer *w = NULL;
    TRY(ss_content_writer_open(dir, SS_CONTENT_FORMAT_NATIVE, &w));
    TRY(ss_content_writer_write_tensor(w, "layer0/weight", values, sizeof values, SS_DTYPE_FLOAT32, 0, 2, shape, stride));
    TRY(ss_content_writer_write_tensor(w, "layer0/weight_t", values, sizeof values, SS_DTYPE_FLOAT32, 0, 2, shape_t, stride_t));
    uint64_t stored = 0, deduplicated = 0;
    TRY(ss_content_writer_counts(w, &stored, &deduplicated, NULL));
    ss_content_writer_free(w);

    /* Read it back: the storage is mapped read-only, not copied. */
    ss_content_reader *r = NULL;
    ss_content_tensor *t = NULL;
    TRY(ss_content_reader_open(dir, &r));
    TRY(ss_content_reader_read_tensor(r, "layer0/weight_t", &t));
    const float *data = ss_content_tensor_data(t);
    const int64_t *st = ss_content_tensor_stride(t);
    float x = data[ss_content_tensor_offset(t) + 2 * st[0] + 1 * st[1]]; /* element [2][1] */
    printf("%s: %zu-d, element [2][1] = %g; %llu storage stored, %llu deduplicated\n",
           ss_content_tensor_storage_hash(t), ss_content_tensor_ndim(t), (double)x,
           (unsigned long long)stored, (unsigned long long)deduplicated);

    ss_content_list *problems = NULL;
    TRY(ss_content_reader_verify(r, NULL, &problems));
    int ok = ss_content_list_len(problems) == 0 && x == values[1 * 4 + 2];
    ss_content_list_free(problems);
    ss_content_tensor_free(t);
    ss_content_reader_free(r);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 && ok ? 0 : 1;
}
