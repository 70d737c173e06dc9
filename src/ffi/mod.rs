//! The C ABI: every `extern "C"` function of the library, one file per
//! area. Each body runs through `ffi_status!` or `ffi_value!`, so no panic
//! crosses the boundary (checked by `tests/api/exports_run_through_the_guard.rs`).
#![allow(non_camel_case_types)]

#[macro_use]
pub mod guard;
pub mod arena;
pub mod args;
pub mod content_store;
pub mod cuda;
pub mod cuda_pool;
pub mod cuda_pool_handle;
pub mod deprecated;
pub mod errors;
pub mod fd_passing;
pub mod fork;
pub mod log;
pub mod manager;
pub mod map;
pub mod status;
pub mod storage;
pub mod storage_utils;
pub mod store;
pub mod store_callbacks;
pub mod struct_size;
pub mod symm;

pub use status::ss_status;
