#include <stdio.h>
#include <string.h>
#include <storage_sharing.h>

int main(void) {
    char name[64];
    ss_map *map = NULL;
    if (ss_shm_name_new(name, sizeof name) != SS_OK ||
        ss_map_open_refcounted(name, SS_MAPPED_SHAREDMEM | SS_MAPPED_EXCLUSIVE, 4096, &map) != SS_OK) {
        fprintf(stderr, "storage-sharing: %s\n", ss_last_error_message());
        return 1;
    }
    strcpy(ss_map_data(map), "hello");
    /* Others open it with SS_MAPPED_SHAREDMEM | SS_MAPPED_NOCREATE while this map is open. */
    printf("%s: %zu bytes, removed at exit\n", name, ss_map_size(map));
    ss_map_free(map); /* the last holder removes the name */
    return 0;
}
