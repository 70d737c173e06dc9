//! One file per sharing path; see `scenario::all` for the table.

pub mod arena;
pub mod by_fd;
pub mod by_name;
pub mod content_store;
pub mod cuda_counters;
pub mod refcounted;
pub mod symm;
