//! `storage_sharing._native`: the library's safe Rust API as Python
//! classes. The pure-Python package around it adds the buffer protocol,
//! the exception classes and the torch integration.

use pyo3::prelude::*;

mod arena;
mod content_store;
mod errors;
mod fd_server;
mod manager;
mod maps;
mod reshare;
mod symm;
mod symm_collectives;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<arena::PyArena>()?;
    m.add_class::<arena::NativeBlock>()?;
    m.add_class::<arena::NativeView>()?;
    m.add_class::<arena::Handle>()?;
    m.add_function(wrap_pyfunction!(arena::open_remote, m)?)?;
    m.add_function(wrap_pyfunction!(arena::open_shared, m)?)?;
    m.add_function(wrap_pyfunction!(arena::reshare, m)?)?;
    m.add_function(wrap_pyfunction!(arena::import_segment_fd, m)?)?;
    m.add_function(wrap_pyfunction!(arena::has_segment, m)?)?;
    m.add_function(wrap_pyfunction!(arena::trim_remote_cache, m)?)?;
    m.add_function(wrap_pyfunction!(arena::remote_cache_size, m)?)?;
    m.add_function(wrap_pyfunction!(arena::send_block, m)?)?;
    m.add_function(wrap_pyfunction!(arena::recv_block, m)?)?;
    m.add_class::<maps::PyMapAllocator>()?;
    m.add_class::<maps::PyRefcountedMapAllocator>()?;
    m.add_class::<manager::PyManagerClient>()?;
    m.add_function(wrap_pyfunction!(manager::spawn_manager, m)?)?;
    m.add_function(wrap_pyfunction!(manager::set_manager_binary, m)?)?;
    m.add_function(wrap_pyfunction!(ss_version, m)?)?;
    m.add_class::<content_store::PyContentWriter>()?;
    m.add_class::<content_store::PyContentReader>()?;
    m.add_class::<content_store::StoredBytes>()?;
    m.add_function(wrap_pyfunction!(content_store::content_hash, m)?)?;
    m.add_class::<symm::SymmBlock>()?;
    m.add_class::<symm_collectives::SymmScratch>()?;
    m.add_function(wrap_pyfunction!(symm::symm_group_tcp, m)?)?;
    m.add_function(wrap_pyfunction!(symm::symm_group_store, m)?)?;
    m.add_function(wrap_pyfunction!(symm::symm_has_group, m)?)?;
    maps::add_flags(m)?;
    m.add("HANDLE_SIZE", storage_sharing::arena::handle::WIRE_SIZE)?;
    fd_server::install_fork_handler();
    Ok(())
}

/// The version of the storage-sharing library this module is built on
/// (its Cargo.toml's); `storage_sharing.__version__` must be the same.
#[pyfunction]
fn ss_version() -> &'static str {
    storage_sharing::VERSION
}
