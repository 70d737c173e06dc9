//! The shared-memory manager daemon: start one, connect to one, register
//! and free segment names with it (it removes the names of clients that
//! die without freeing them).

use crate::errors::OrRaise;
use pyo3::prelude::*;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use storage_sharing::manager::client::Client;
use storage_sharing::manager::spawn;

/// Starts a daemon (the binary named, or the library's lookup:
/// `SS_SHM_MANAGER`, next to the library, then PATH)
/// and returns its socket path.
#[pyfunction]
#[pyo3(signature = (binary=None))]
pub fn spawn_manager(py: Python<'_>, binary: Option<String>) -> PyResult<String> {
    py.allow_threads(|| match binary {
        Some(b) => spawn::spawn_manager_at(Path::new(&b)),
        None => spawn::spawn_manager(),
    })
    .or_raise()
}

/// Uses `path` as the daemon binary from now on (before `SS_SHM_MANAGER`
/// and the library's lookup).
#[pyfunction]
pub fn set_manager_binary(path: String) -> PyResult<()> {
    spawn::set_manager_binary(&path).or_raise()
}

#[pyclass(frozen, module = "storage_sharing._native", name = "ManagerClient")]
pub struct PyManagerClient {
    client: Arc<Client>,
}

#[pymethods]
impl PyManagerClient {
    /// Connects to the daemon listening at `path`.
    #[new]
    #[pyo3(signature = (path, timeout=None))]
    fn new(py: Python<'_>, path: String, timeout: Option<f64>) -> PyResult<Self> {
        let client = py
            .allow_threads(|| match timeout {
                Some(t) if t > 0.0 && t.is_finite() => Client::connect_with_timeout(&path, Duration::from_secs_f64(t)),
                Some(t) => Err(storage_sharing::Error::new(
                    storage_sharing::ErrorKind::InvalidArgument,
                    format!("timeout must be a positive number of seconds, got {t}"),
                )),
                None => Client::connect(&path),
            })
            .or_raise()?;
        Ok(PyManagerClient { client: Arc::new(client) })
    }

    #[getter]
    fn path(&self) -> String {
        self.client.path().to_string()
    }

    fn register(&self, py: Python<'_>, filename: String) -> PyResult<()> {
        let c = self.client.clone();
        py.allow_threads(move || c.register(&filename)).or_raise()
    }

    fn free(&self, py: Python<'_>, filename: String) -> PyResult<()> {
        let c = self.client.clone();
        py.allow_threads(move || c.free(&filename)).or_raise()
    }

    /// Waits until the daemon has answered every registration sent.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.client.clone();
        py.allow_threads(move || c.sync()).or_raise()
    }
}
