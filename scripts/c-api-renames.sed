# Moves C/C++/Go sources from the deprecated C API names to their
# replacements (docs/c-api.md): sed -i -f scripts/c-api-renames.sed FILES
# Then: SS_ARENA_OPTIONS_INIT / SS_STORE_CALLBACKS_INIT for the versioned
# structs, and const for the borrowed ss_map / ss_symm_mem pointers.
s/\bss_arena_free\b/ss_arena_dealloc/g
s/\bss_arena_open_remote\b/ss_arena_view_open/g
s/\bss_arena_trim_remote_cache\b/ss_arena_remote_cache_trim/g
s/\bss_content_write_storage\b/ss_content_writer_write_storage/g
s/\bss_content_write_tensor\b/ss_content_writer_write_tensor/g
s/\bss_content_read_tensor\b/ss_content_reader_read_tensor/g
s/\bss_content_read_storage\b/ss_content_reader_read_storage/g
s/\bss_content_list_tensors\b/ss_content_reader_list_tensors/g
s/\bss_content_list_storages\b/ss_content_reader_list_storages/g
s/\bss_content_verify\b/ss_content_reader_verify/g
s/\bss_hash_bytes\b/ss_content_hash_bytes/g
s/\bss_cuda_open\b/ss_cuda_received_open/g
s/\bss_cuda_release_ipc_counter\b/ss_cuda_ipc_counter_release/g
s/\bss_cuda_malloc\b/ss_cuda_alloc/g
s/\bss_send_fds\b/ss_fds_send/g
s/\bss_recv_fds\b/ss_fds_recv/g
s/\bss_refcounted_map_open\b/ss_map_open_refcounted/g
s/\bss_map_from_data\b/ss_map_lookup/g
s/\bss_new_process_wide_shm_handle\b/ss_shm_name_new/g
s/\bss_new_shm_fd_storage\b/ss_map_new_shm_fd/g
s/\bss_share_memory\b/ss_map_new_copy/g
s/\bss_store_from_callbacks\b/ss_store_callbacks_open/g
s/\bss_symm_rendezvous\b/ss_symm_mem_rendezvous/g
