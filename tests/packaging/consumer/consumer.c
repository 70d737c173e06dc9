/* A program outside the tree, built against an installed prefix (CMake
 * find_package, pkg-config, or the README's static link line). It shares a
 * buffer with a second process: the parent fills a refcounted segment, runs
 * itself again as the child, which opens the segment by name, checks the
 * bytes and writes an answer; the parent checks the answer, and the name
 * is gone once both have closed. Exit 0 means all of that held. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <storage_sharing.h>

#define SIZE (1u << 20)

static int fail(const char *what, ss_status s) {
    fprintf(stderr, "consumer: %s failed: %s: %s\n", what, ss_status_str((int)s), ss_last_error_message());
    return 1;
}

static unsigned char pattern(size_t i) { return (unsigned char)(i * 31 + 7); }

static int child(const char *name) {
    ss_map *m = NULL;
    ss_status s = ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, SIZE, &m);
    if (s != SS_OK) return fail("child: ss_map_open_refcounted", s);
    unsigned char *p = ss_map_data(m);
    for (size_t i = 0; i < SIZE / 2; i++) {
        if (p[i] != pattern(i)) {
            fprintf(stderr, "consumer: child read byte %zu = %u, wanted %u\n", i, p[i], pattern(i));
            return 1;
        }
    }
    for (size_t i = SIZE / 2; i < SIZE; i++) p[i] = (unsigned char)~pattern(i);
    ss_map_free(m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "child") == 0) return child(argv[2]);
    if (strcmp(ss_version(), SS_VERSION_STRING) != 0) {
        fprintf(stderr, "consumer: library %s, header %s\n", ss_version(), SS_VERSION_STRING);
        return 1;
    }
    char name[64];
    ss_status s = ss_shm_name_new(name, sizeof name);
    if (s != SS_OK) return fail("ss_shm_name_new", s);
    ss_map *m = NULL;
    s = ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, SIZE, &m);
    if (s != SS_OK) return fail("ss_map_open_refcounted", s);
    unsigned char *p = ss_map_data(m);
    for (size_t i = 0; i < SIZE / 2; i++) p[i] = pattern(i);

    pid_t pid = fork();
    if (pid < 0) return perror("fork"), 1;
    if (pid == 0) {
        execl("/proc/self/exe", argv[0], "child", name, (char *)NULL);
        perror("exec");
        _exit(127);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "consumer: child failed (status 0x%x)\n", status);
        ss_map_free(m);
        return 1;
    }
    for (size_t i = SIZE / 2; i < SIZE; i++) {
        if (p[i] != (unsigned char)~pattern(i)) {
            fprintf(stderr, "consumer: parent read byte %zu = %u after the child wrote\n", i, p[i]);
            return 1;
        }
    }
    int32_t count = 0;
    s = ss_map_refcount(m, &count);
    if (s != SS_OK) return fail("ss_map_refcount", s);
    if (count != 1) {
        fprintf(stderr, "consumer: refcount %d after the child closed, wanted 1\n", (int)count);
        return 1;
    }
    ss_map_free(m);
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd >= 0 || errno != ENOENT) {
        fprintf(stderr, "consumer: %s still exists after both processes closed it\n", name);
        return 1;
    }
    printf("consumer: storage-sharing %s, %u bytes shared with process %d through %s\n", ss_version(), SIZE, (int)pid,
           name);
    return 0;
}
