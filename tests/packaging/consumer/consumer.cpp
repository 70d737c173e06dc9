// The C++ side of the consumer: the RAII header from an installed prefix.
// The parent copies a buffer into an fd-backed segment (share_memory), runs
// itself again with the descriptor inherited, and the child maps the same
// pages with Map::open_fd, checks them and writes an answer.
#include <storage_sharing.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace ss = storage_sharing;

static constexpr std::size_t kSize = 256 * 1024;

static int child(int fd) {
    ss::Map m = ss::Map::open_fd(fd, SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE | SS_MAPPED_FROMFD, kSize);
    auto *p = m.data_as<unsigned char>();
    for (std::size_t i = 0; i < kSize; i++) {
        if (p[i] != static_cast<unsigned char>(i % 251)) {
            std::fprintf(stderr, "consumer_cpp: child byte %zu is %u\n", i, p[i]);
            return 1;
        }
    }
    std::memset(p, 0xee, 16);
    return 0;
}

int main(int argc, char **argv) {
    try {
        if (argc == 3 && std::strcmp(argv[1], "child") == 0) return child(std::atoi(argv[2]));
        std::vector<unsigned char> src(kSize);
        for (std::size_t i = 0; i < kSize; i++) src[i] = static_cast<unsigned char>(i % 251);
        ss::Map shared = ss::Map::share_memory(src.data(), src.size());
        pid_t pid = fork();
        if (pid < 0) return std::perror("fork"), 1;
        if (pid == 0) {
            // The library opens descriptors close-on-exec; dup() gives the
            // child one that survives exec.
            std::string fd = std::to_string(dup(shared.fd()));
            execl("/proc/self/exe", argv[0], "child", fd.c_str(), static_cast<char *>(nullptr));
            _exit(127);
        }
        int status = 0;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            std::fprintf(stderr, "consumer_cpp: child failed (status 0x%x)\n", status);
            return 1;
        }
        if (shared.data_as<unsigned char>()[15] != 0xee) {
            std::fprintf(stderr, "consumer_cpp: the child's answer did not arrive\n");
            return 1;
        }
        // Errors arrive as exceptions with the status and the message.
        try {
            ss::Map::open("/ss-consumer-does-not-exist", SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE, 10);
            std::fprintf(stderr, "consumer_cpp: opening a missing segment did not throw\n");
            return 1;
        } catch (const ss::Error &e) {
            if (e.status() != SS_ERR_NOT_FOUND) {
                std::fprintf(stderr, "consumer_cpp: wrong status: %s\n", e.what());
                return 1;
            }
        }
        std::printf("consumer_cpp: storage-sharing %s, %zu bytes shared by fd with process %d\n",
                    ss::version().c_str(), kSize, static_cast<int>(pid));
        return 0;
    } catch (const ss::Error &e) {
        std::fprintf(stderr, "consumer_cpp: %s (%s)\n", e.what(), e.status_text());
        return 1;
    }
}
