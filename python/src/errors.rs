//! The library's errors as Python exceptions: the class is chosen by
//! `storage_sharing._errors.from_native` from the error's kind, and the
//! message is the library's.

use pyo3::prelude::*;
use storage_sharing::{Error, ErrorKind};

pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let made = (|| -> PyResult<PyErr> {
            let from_native = py.import("storage_sharing._errors")?.getattr("from_native")?;
            let exc = from_native.call1((format!("{:?}", e.kind()), e.message()))?;
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|failed| failed)
    })
}

/// `result.or_raise()?`: a library result into a Python one.
pub trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for Result<T, Error> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

pub fn closed(what: &str) -> PyErr {
    to_py(Error::new(ErrorKind::Closed, format!("{what} is closed")))
}

pub fn invalid(message: String) -> PyErr {
    to_py(Error::new(ErrorKind::InvalidArgument, message))
}
