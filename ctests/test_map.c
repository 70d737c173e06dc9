/* MapAllocator and RefcountedMapAllocator through the C header: every
 * function, the flags, the error paths, and a second process. */
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

static int shm_exists(const char *name) {
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) return 0;
    close(fd);
    return 1;
}

static void new_name(char *buf, size_t len) { CHECK_OK(ss_shm_name_new(buf, len)); }

static void test_plain_create_open_close(void) {
    char name[64];
    new_name(name, sizeof name);
    CHECK(strncmp(name, "/torch_", 7) == 0);
    ss_map *a = NULL, *b = NULL;
    CHECK_OK(ss_map_open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 8192, &a));
    CHECK(ss_map_size(a) == 8192);
    CHECK(ss_map_fd(a) == -1);
    CHECK(strcmp(ss_map_filename(a), name) == 0);
    CHECK(ss_map_flags(a) == (SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE));
    CHECK(!ss_map_is_refcounted(a));
    unsigned char *pa = ss_map_data(a);
    CHECK(pa != NULL);
    for (int i = 0; i < 8192; i++) CHECK(pa[i] == 0);
    pa[100] = 0xab;

    CHECK_OK(ss_map_open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE | SS_MAPPED_KEEPFD, 8192, &b));
    CHECK(ss_map_fd(b) >= 0);
    CHECK(((unsigned char *)ss_map_data(b))[100] == 0xab);

    /* fromDataPtr: start and interior pointers find their own map. */
    CHECK(ss_map_lookup(pa) == a);
    CHECK(ss_map_lookup(pa + 8191) == a);
    CHECK(ss_map_lookup(ss_map_data(b)) == b);
    int local = 0;
    CHECK(ss_map_lookup(&local) == NULL);
    CHECK(ss_map_lookup(NULL) == NULL);

    /* Plain maps have no count. */
    int32_t count = 0;
    CHECK_STATUS(ss_map_incref(a), SS_ERR_UNSUPPORTED);
    CHECK_STATUS(ss_map_refcount(a, &count), SS_ERR_UNSUPPORTED);
    CHECK(strstr(ss_last_error_message(), name) != NULL);

    CHECK_OK(ss_map_close(a));
    CHECK_OK(ss_map_close(a)); /* idempotent */
    CHECK(ss_map_data(a) == NULL);
    CHECK(ss_map_lookup(pa) == NULL);
    CHECK(!shm_exists(name)); /* plain SHAREDMEM close unlinks, as ATen */
    ss_map_free(a);
    ss_map_free(b);
    ss_map_free(NULL);
}

static void test_fd_storage_and_open_fd(void) {
    ss_map *s = NULL, *r = NULL;
    CHECK_OK(ss_map_new_shm_fd(4096, &s));
    CHECK(ss_map_flags(s) == 86);
    CHECK(!shm_exists(ss_map_filename(s)));
    int fd = ss_map_fd(s);
    CHECK(fd >= 0);
    ((char *)ss_map_data(s))[0] = 'x';
    int dupfd = dup(fd);
    CHECK_OK(ss_map_open_fd(NULL, dupfd,
                            SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE | SS_MAPPED_KEEPFD | SS_MAPPED_FROMFD,
                            4096, &r));
    CHECK(ss_map_flags(r) == 58);
    CHECK(ss_map_fd(r) == dupfd);
    CHECK(strcmp(ss_map_filename(r), "filename not specified") == 0);
    CHECK(((char *)ss_map_data(r))[0] == 'x');
    /* Asking for more than the fd holds with NOCREATE: size mismatch, fd still ours. */
    int fd2 = dup(fd);
    ss_map *bad = NULL;
    CHECK_STATUS(ss_map_open_fd("", fd2, 58, 1 << 20, &bad), SS_ERR_SIZE_MISMATCH);
    CHECK(bad == NULL);
    CHECK(fcntl(fd2, F_GETFD) >= 0);
    close(fd2);
    /* FROMFD missing or bad fd. */
    CHECK_STATUS(ss_map_open_fd("", fd, SS_MAPPED_SHAREDMEM, 4096, &bad), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_map_open_fd("", -1, 58, 4096, &bad), SS_ERR_INVALID_ARGUMENT);
    ss_map_free(r);
    CHECK(fcntl(dupfd, F_GETFD) < 0); /* closed with the map */
    ss_map_free(s);
}

static void test_share_memory(void) {
    size_t n = (5u << 20) + 123;
    unsigned char *src = malloc(n);
    CHECK(src != NULL);
    for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 7);
    ss_map *m = NULL;
    CHECK_OK(ss_map_new_copy(src, n, &m));
    CHECK(ss_map_size(m) == n);
    CHECK(memcmp(ss_map_data(m), src, n) == 0);
    CHECK(ss_map_fd(m) >= 0);
    ss_map_free(m);
    CHECK_STATUS(ss_map_new_copy(NULL, 10, &m), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_map_new_copy(src, 0, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_map_new_copy(src, 10, NULL), SS_ERR_NULL_POINTER);
    free(src);
}

static void test_refcounted_across_processes(void) {
    char name[64];
    new_name(name, sizeof name);
    ss_map *a = NULL;
    CHECK_OK(ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 1000, &a));
    CHECK(ss_map_is_refcounted(a));
    CHECK(ss_map_size(a) == 1000);
    struct stat st;
    int fd = shm_open(name, O_RDONLY, 0);
    CHECK(fd >= 0 && fstat(fd, &st) == 0 && st.st_size == 1000 + SS_REFCOUNT_HEADER_SIZE);
    close(fd);
    int32_t count = 0;
    CHECK_OK(ss_map_refcount(a, &count));
    CHECK(count == 1);
    memset(ss_map_data(a), 0x5a, 1000);

    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        ss_map *b = NULL;
        if (ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 1000, &b) != SS_OK) _exit(2);
        unsigned char *p = ss_map_data(b);
        if (p[999] != 0x5a) _exit(3);
        p[0] = 0x77;
        if (ss_map_incref(b) != SS_OK) _exit(4); /* leaves +1 for the parent to see */
        ss_map_free(b);                          /* -1 for its own open */
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(((unsigned char *)ss_map_data(a))[0] == 0x77);
    CHECK_OK(ss_map_refcount(a, &count));
    CHECK(count == 2);
    bool zero = true;
    CHECK_OK(ss_map_decref(a, &zero));
    CHECK(!zero);
    CHECK_OK(ss_map_decref(a, NULL) == SS_OK ? ss_map_incref(a) : SS_ERR_IO);
    CHECK(shm_exists(name));
    CHECK_OK(ss_map_close(a));
    CHECK(!shm_exists(name)); /* last holder removed the name */
    CHECK_STATUS(ss_map_refcount(a, &count), SS_ERR_CLOSED);
    CHECK_STATUS(ss_map_incref(a), SS_ERR_CLOSED);
    ss_map_free(a);
}

static void test_refcount_bad_header(void) {
    char name[64];
    new_name(name, sizeof name);
    ss_map *a = NULL, *b = NULL;
    CHECK_OK(ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 10, &a));
    bool zero = false;
    CHECK_OK(ss_map_decref(a, &zero));
    CHECK(zero);
    CHECK_STATUS(ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 10, &b), SS_ERR_BAD_REFCOUNT);
    CHECK(strstr(ss_last_error_message(), "count 0") != NULL);
    CHECK_OK(ss_map_incref(a));
    ss_map_free(a);
    CHECK(!shm_exists(name));
}

static void test_errors(void) {
    char name[64];
    new_name(name, sizeof name);
    ss_map *m = NULL;
    CHECK_STATUS(ss_map_open(NULL, SS_MAPPED_SHAREDMEM, 10, &m), SS_ERR_NULL_POINTER);
    CHECK(strstr(ss_last_error_message(), "name") != NULL);
    CHECK_STATUS(ss_map_open(name, SS_MAPPED_SHAREDMEM, 10, NULL), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_map_open(name, SS_MAPPED_SHAREDMEM, 0, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "size 0") != NULL);
    CHECK_STATUS(ss_map_open("no_slash", SS_MAPPED_SHAREDMEM, 10, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "must start with '/'") != NULL);
    char longname[400] = "/";
    memset(longname + 1, 'a', 300);
    CHECK_STATUS(ss_map_open(longname, SS_MAPPED_SHAREDMEM, 10, &m), SS_ERR_NAME_TOO_LONG);
    CHECK_STATUS(ss_map_open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 10, &m), SS_ERR_NOT_FOUND);
    CHECK(strstr(ss_last_error_message(), name) != NULL);
    CHECK_STATUS(ss_map_open(name, SS_MAPPED_EXCLUSIVE, 10, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_map_open(name, 1 << 10, 10, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_map_open(name, SS_MAPPED_SHAREDMEM, SIZE_MAX, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM, SIZE_MAX - 8, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ss_last_error_message(), "header") != NULL);
    CHECK_STATUS(ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_KEEPFD, 10, &m), SS_ERR_UNSUPPORTED);
    CHECK_STATUS(ss_map_open_refcounted(name, SS_MAPPED_SHARED, 10, &m), SS_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    /* A file smaller than asked with NOCREATE. */
    CHECK_OK(ss_map_open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 100, &m));
    ss_map *big = NULL;
    CHECK_STATUS(ss_map_open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 200, &big), SS_ERR_SIZE_MISMATCH);
    CHECK(strstr(ss_last_error_message(), "smaller than the required mapping size") != NULL);
    CHECK_STATUS(ss_map_open(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 100, &big), SS_ERR_ALREADY_EXISTS);
    ss_map_free(m);
    /* NULL handles. */
    CHECK(ss_map_data(NULL) == NULL && ss_map_size(NULL) == 0 && ss_map_fd(NULL) == -1);
    CHECK(ss_map_filename(NULL) == NULL && ss_map_flags(NULL) == 0);
    CHECK_STATUS(ss_map_close(NULL), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_map_incref(NULL), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_map_decref(NULL, NULL), SS_ERR_NULL_POINTER);
    int32_t c;
    CHECK_STATUS(ss_map_refcount(NULL, &c), SS_ERR_NULL_POINTER);
    char tiny[8];
    CHECK_STATUS(ss_shm_name_new(tiny, sizeof tiny), SS_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(ss_shm_name_new(NULL, 64), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_map_new_shm_fd(0, &m), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_map_new_shm_fd(10, NULL), SS_ERR_NULL_POINTER);
    CHECK(strcmp(ss_status_str(SS_OK), "ok") == 0);
    CHECK(strcmp(ss_status_str(SS_ERR_NO_SPACE), "no space") == 0);
    CHECK(strcmp(ss_status_str(9999), "unknown status") == 0);
    CHECK(strcmp(ss_version(), SS_VERSION_STRING) == 0);
}

int main(void) {
    test_plain_create_open_close();
    test_fd_storage_and_open_fd();
    test_share_memory();
    test_refcounted_across_processes();
    test_refcount_bad_header();
    test_errors();
    printf("test_map: all checks passed\n");
    return 0;
}
