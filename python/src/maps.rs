//! ATen's shared-memory allocators: `MapAllocator` (a named file or shm
//! object, mapped) and `RefcountedMapAllocator` (the same with the
//! cross-process count in its first 64 bytes), opened by name and flags.

use crate::errors::{closed, OrRaise};
use pyo3::prelude::*;
use std::sync::Mutex;
use storage_sharing::shm::{flags, MapAllocator, RefcountedMapAllocator};

pub fn add_flags(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ALLOCATOR_MAPPED_SHARED", flags::SHARED)?;
    m.add("ALLOCATOR_MAPPED_SHAREDMEM", flags::SHAREDMEM)?;
    m.add("ALLOCATOR_MAPPED_EXCLUSIVE", flags::EXCLUSIVE)?;
    m.add("ALLOCATOR_MAPPED_NOCREATE", flags::NOCREATE)?;
    m.add("ALLOCATOR_MAPPED_KEEPFD", flags::KEEPFD)?;
    m.add("ALLOCATOR_MAPPED_FROMFD", flags::FROMFD)?;
    m.add("ALLOCATOR_MAPPED_UNLINK", flags::UNLINK)?;
    Ok(())
}

/// What both allocators show: where the bytes are, how many, which name.
struct Mapped {
    address: usize,
    size: usize,
    filename: String,
    flags: i32,
}

/// One Python class over one of the allocators: the constructor, the
/// getters and `close` both have, then the methods given in braces.
macro_rules! map_class {
    ($py_type:ident, $inner:ty, $name:literal, { $($methods:tt)* }) => {
        #[pyclass(frozen, module = "storage_sharing._native", name = $name)]
        pub struct $py_type {
            map: Mutex<Option<$inner>>,
            info: Mapped,
        }

        impl $py_type {
            fn with<T>(&self, f: impl FnOnce(&$inner) -> storage_sharing::Result<T>) -> PyResult<T> {
                let g = self.map.lock().unwrap_or_else(|p| p.into_inner());
                let m = g.as_ref().ok_or_else(|| closed("map"))?;
                f(m).or_raise()
            }
        }

        #[pymethods]
        impl $py_type {
            #[new]
            fn new(py: Python<'_>, name: &str, flags: i32, size: usize) -> PyResult<Self> {
                let name = name.to_string();
                let map = py.allow_threads(|| <$inner>::open(&name, flags, size)).or_raise()?;
                let info = Mapped { address: map.data() as usize, size: map.len(), filename: map.filename().to_string(), flags: map.flags() };
                Ok($py_type { map: Mutex::new(Some(map)), info })
            }

            #[getter]
            fn address(&self) -> usize {
                self.info.address
            }
            #[getter]
            fn size(&self) -> usize {
                self.info.size
            }
            #[getter]
            fn filename(&self) -> &str {
                &self.info.filename
            }
            #[getter]
            fn flags(&self) -> i32 {
                self.info.flags
            }
            #[getter]
            fn closed(&self) -> bool {
                self.map.lock().unwrap_or_else(|p| p.into_inner()).is_none()
            }

            /// Unmaps; a refcounted map also drops this process's count (the
            /// last one out removes the name). Later calls are no-ops.
            fn close(&self, py: Python<'_>) -> PyResult<()> {
                let taken = self.map.lock().unwrap_or_else(|p| p.into_inner()).take();
                match taken {
                    Some(mut m) => py.allow_threads(move || m.close()).or_raise(),
                    None => Ok(()),
                }
            }

            $($methods)*
        }
    };
}

map_class!(PyMapAllocator, MapAllocator, "MapAllocator", {
    /// The descriptor kept with KEEPFD (-1 otherwise).
    fn fd(&self) -> PyResult<i32> {
        self.with(|m| Ok(m.fd()))
    }
});

map_class!(PyRefcountedMapAllocator, RefcountedMapAllocator, "RefcountedMapAllocator", {
    fn refcount(&self) -> PyResult<i32> {
        self.with(|m| m.refcount())
    }
    fn incref(&self) -> PyResult<()> {
        self.with(|m| m.incref())
    }
    /// Returns True when the count reached zero.
    fn decref(&self) -> PyResult<bool> {
        self.with(|m| m.decref())
    }
});
