// C++ test helpers beside check.h: /dev/shm presence and expected errors.
#ifndef SS_CTEST_CHECK_HPP
#define SS_CTEST_CHECK_HPP

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "check.h"
#include "storage_sharing.hpp"

static inline bool shm_exists(const std::string &name) {
    int fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (fd < 0) return false;
    close(fd);
    return true;
}

// Runs `f`, which must throw storage_sharing::Error with `want`; returns it.
template <class F>
static storage_sharing::Error expect_error(F f, ss_status want) {
    try {
        f();
    } catch (const storage_sharing::Error &e) {
        if (e.status() != want) {
            std::fprintf(stderr, "wrong status %d (%s), wanted %d\n", static_cast<int>(e.status()), e.what(),
                         static_cast<int>(want));
            std::exit(1);
        }
        return e;
    }
    std::fprintf(stderr, "no exception, wanted status %d\n", static_cast<int>(want));
    std::exit(1);
}

#endif
