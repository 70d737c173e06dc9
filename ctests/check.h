/* Minimal assertion helpers for the C tests: print where and why, exit 1. */
#ifndef SS_CTEST_CHECK_H
#define SS_CTEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include "storage_sharing.h"

#define CHECK(cond)                                                               \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

/* Expects `call` to return `want`; prints the last error message if not. */
#define CHECK_STATUS(call, want)                                                  \
    do {                                                                          \
        ss_status got_ = (call);                                                  \
        if (got_ != (want)) {                                                     \
            fprintf(stderr, "%s:%d: %s returned %d (%s), wanted %d: %s\n", __FILE__, \
                    __LINE__, #call, (int)got_, ss_status_str((int)got_), (int)(want), \
                    ss_last_error_message());                                     \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, SS_OK)

#endif
