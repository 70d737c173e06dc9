/* Storages through the C header: strong and weak references, sharing by
 * fd (SCM_RIGHTS to a forked child) and by name (through the manager),
 * shared_incref/decref as torch.multiprocessing uses them, error paths. */
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "forks.h"

static int shm_exists(const char *name) {
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    struct stat st;
    return stat(path, &st) == 0;
}

/* Bytes 1..n-1 follow the pattern (byte 0 is the peers' marker). */
static int matches(const unsigned char *p, size_t n, unsigned seed) {
    return matches_from(p, 1, n, seed);
}

static void test_refs_and_resize(void) {
    ss_storage *s = NULL, *s2 = NULL, *up = NULL;
    ss_weak *w = NULL;
    CHECK_OK(ss_storage_new(100, &s));
    CHECK(ss_storage_nbytes(s) == 100);
    unsigned char *p = ss_storage_data(s);
    CHECK(p != NULL && ((uintptr_t)p % 64) == 0);
    for (int i = 0; i < 100; i++) CHECK(p[i] == 0);
    CHECK(!ss_storage_is_shared(s));
    p[0] = 9;
    CHECK_OK(ss_storage_resize(s, 200));
    CHECK(ss_storage_nbytes(s) == 200);
    CHECK(((unsigned char *)ss_storage_data(s))[0] == 9);

    CHECK_OK(ss_storage_weak_ref(s, &w));
    CHECK(!ss_weak_expired(w));
    CHECK_OK(ss_storage_ref(s, &s2));
    ss_storage_free(s);
    CHECK(!ss_weak_expired(w));
    CHECK_OK(ss_weak_upgrade(w, &up));
    CHECK(ss_storage_data(up) == ss_storage_data(s2));
    ss_storage_free(up);
    ss_storage_free(s2);
    CHECK(ss_weak_expired(w));
    up = NULL;
    CHECK_STATUS(ss_weak_upgrade(w, &up), SS_ERR_NOT_FOUND);
    CHECK(up == NULL);
    CHECK(strstr(ss_last_error_message(), "expired") != NULL);
    ss_weak_free(w);
    ss_weak_free(NULL);
    ss_storage_free(NULL);
    CHECK(ss_weak_expired(NULL));

    /* A 0-byte storage exists but cannot be shared. */
    int fd = -1;
    size_t n = 0;
    CHECK_OK(ss_storage_new(0, &s));
    CHECK(ss_storage_data(s) == NULL);
    CHECK_STATUS(ss_storage_share_fd(s, &fd, &n), SS_ERR_INVALID_ARGUMENT);
    CHECK(fd == -1);
    ss_storage_free(s);
}

static void test_null_and_bad_arguments(void) {
    ss_storage *s = NULL;
    int fd;
    size_t n;
    CHECK_STATUS(ss_storage_new(1, NULL), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_storage_share_fd(NULL, &fd, &n), SS_ERR_NULL_POINTER);
    CHECK(strstr(ss_last_error_message(), "storage") != NULL);
    CHECK_STATUS(ss_storage_new_shared_fd(-1, 10, &s), SS_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ss_storage_new_shared_filename(NULL, "/x", 10, &s), SS_ERR_NULL_POINTER);
    CHECK_STATUS(ss_storage_new_shared_filename("/nonexistent/manager.sock", "/torch_1_2_3", 10, &s), SS_ERR_NOT_FOUND);
    CHECK(strstr(ss_last_error_message(), "/nonexistent/manager.sock") != NULL);
    CHECK(s == NULL);
    CHECK_STATUS(ss_fds_send(-1, "x", 1, NULL, 0), SS_ERR_CLOSED);
    CHECK_STATUS(ss_fds_send(0, NULL, 1, NULL, 0), SS_ERR_NULL_POINTER);

    CHECK_OK(ss_storage_new(10, &s));
    CHECK_STATUS(ss_storage_shared_incref(s), SS_ERR_UNSUPPORTED);
    CHECK_STATUS(ss_storage_get_shared_fd(s, &fd), SS_ERR_NOT_FOUND);
    ss_storage_free(s);
}

/* Child: receives (nbytes, fd), maps it, checks, writes 0xEE, acks. */
static void fd_child(int sock) {
    char buf[32] = {0};
    int fds[2];
    size_t len = 0, nfds = 0;
    CHECK_OK(ss_fds_recv(sock, buf, sizeof buf - 1, &len, fds, 2, &nfds));
    CHECK(nfds == 1);
    size_t nbytes = (size_t)strtoull(buf, NULL, 10);
    ss_storage *s = NULL;
    CHECK_OK(ss_storage_new_shared_fd(fds[0], nbytes, &s));
    close(fds[0]);
    CHECK(ss_storage_is_shared(s));
    CHECK_STATUS(ss_storage_resize(s, 1), SS_ERR_UNSUPPORTED);
    unsigned char *p = ss_storage_data(s);
    CHECK(matches(p, nbytes, 5));
    p[0] = 0xEE;
    ss_storage_free(s);
    CHECK(write(sock, "k", 1) == 1);
}

static void test_share_fd_to_child(void) {
    const size_t n = 1 << 20;
    ss_storage *s = NULL;
    CHECK_OK(ss_storage_new(n, &s));
    fill(ss_storage_data(s), n, 5);
    int fd = -1, fd2 = -1, getfd = -1;
    size_t nb = 0;
    CHECK_OK(ss_storage_share_fd(s, &fd, &nb));
    CHECK(fd >= 0 && nb == n && ss_storage_is_shared(s));
    CHECK_OK(ss_storage_share_fd(s, &fd2, &nb));
    CHECK(fd2 == fd);
    CHECK_OK(ss_storage_get_shared_fd(s, &getfd));
    CHECK(getfd == fd);
    CHECK(matches(ss_storage_data(s), n, 5));

    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        fd_child(sv[1]);
        _exit(0);
    }
    close(sv[1]);
    char msg[32];
    int len = snprintf(msg, sizeof msg, "%zu", n);
    CHECK_OK(ss_fds_send(sv[0], msg, (size_t)len, &fd, 1));
    char ack;
    CHECK(read(sv[0], &ack, 1) == 1);
    wait_child_ok(pid);
    CHECK(((unsigned char *)ss_storage_data(s))[0] == 0xEE);
    close(sv[0]);
    ss_storage_free(s);
}

/* Child: opens (manager, name, n), cancels the sender's +1, writes, exits. */
static void name_child(const char *manager, const char *name, size_t n) {
    ss_storage *s = NULL;
    CHECK_OK(ss_storage_new_shared_filename(manager, name, n, &s));
    CHECK_OK(ss_storage_shared_decref(s));
    int32_t count = 0;
    CHECK_OK(ss_storage_shared_refcount(s, &count));
    CHECK(count == 2);
    unsigned char *p = ss_storage_data(s);
    CHECK(matches(p, n, 3));
    p[0] = 0xEE;
    ss_storage_free(s);
}

static void test_share_filename_to_child(void) {
    const size_t n = 70000;
    ss_storage *s = NULL;
    CHECK_OK(ss_storage_new(n, &s));
    fill(ss_storage_data(s), n, 3);
    char manager[108], name[64], tiny[4];
    size_t nb = 0;
    CHECK_STATUS(ss_storage_share_filename(s, tiny, sizeof tiny, name, sizeof name, &nb), SS_ERR_BUFFER_TOO_SMALL);
    /* A too small name buffer: the manager buffer is not written either. */
    memset(manager, 'x', sizeof manager);
    CHECK_STATUS(ss_storage_share_filename(s, manager, sizeof manager, tiny, sizeof tiny, &nb), SS_ERR_BUFFER_TOO_SMALL);
    CHECK(manager[0] == 'x' && nb == 0);
    CHECK_OK(ss_storage_share_filename(s, manager, sizeof manager, name, sizeof name, &nb));
    CHECK(nb == n);
    CHECK(strncmp(name, "/torch_", 7) == 0 && shm_exists(name));
    CHECK(strstr(manager, "manager.sock") != NULL);
    int32_t count = 0;
    CHECK_OK(ss_storage_shared_refcount(s, &count));
    CHECK(count == 1);
    CHECK_OK(ss_storage_shared_incref(s)); /* in flight */

    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        name_child(manager, name, n);
        _exit(0);
    }
    wait_child_ok(pid);
    CHECK(((unsigned char *)ss_storage_data(s))[0] == 0xEE);
    CHECK_OK(ss_storage_shared_refcount(s, &count));
    CHECK(count == 1); /* child's +1 gone, in-flight +1 cancelled */
    ss_storage_free(s);
    CHECK(!shm_exists(name));
}

static void test_new_using(void) {
    ss_storage *a = NULL, *b = NULL;
    int fd = -1;
    CHECK_OK(ss_storage_new_using_fd(5000, &a));
    CHECK(ss_storage_is_shared(a));
    CHECK_OK(ss_storage_get_shared_fd(a, &fd));
    CHECK(fd >= 0);
    CHECK_OK(ss_storage_new_using_filename(5000, &b));
    char manager[108], name[64];
    size_t nb;
    CHECK_OK(ss_storage_share_filename(b, manager, sizeof manager, name, sizeof name, &nb));
    CHECK(nb == 5000 && shm_exists(name));
    ss_storage_free(a);
    ss_storage_free(b);
    CHECK(!shm_exists(name));
}

static void test_manager_spawn(void) {
    char path[108], tiny[8];
    CHECK_STATUS(ss_shm_manager_spawn(tiny, sizeof tiny), SS_ERR_BUFFER_TOO_SMALL);
    CHECK_OK(ss_shm_manager_spawn(path, sizeof path));
    struct stat st;
    CHECK(stat(path, &st) == 0 && S_ISSOCK(st.st_mode));
    CHECK_STATUS(ss_shm_manager_set_binary(NULL), SS_ERR_NULL_POINTER);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_refs_and_resize();
    test_null_and_bad_arguments();
    test_share_fd_to_child();
    test_share_filename_to_child();
    test_new_using();
    test_manager_spawn();
    printf("test_storage: ok\n");
    return 0;
}
