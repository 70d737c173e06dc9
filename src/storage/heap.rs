//! A zero-filled, 64-byte aligned heap buffer: a storage's bytes before it
//! is shared (ATen's CPU allocator aligns to 64 too).

use crate::error::{Error, ErrorKind, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};

const ALIGN: usize = 64;

#[derive(Debug)]
pub struct HeapBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned memory with no thread affinity.
unsafe impl Send for HeapBuf {}
// SAFETY: &self methods only hand out the pointer.
unsafe impl Sync for HeapBuf {}

impl HeapBuf {
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(HeapBuf { ptr: std::ptr::null_mut(), len: 0 });
        }
        let layout = Layout::from_size_align(len, ALIGN)
            .map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("storage size {len} is too large")))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::new(ErrorKind::NoSpace, format!("out of memory allocating a storage of {len} bytes")));
        }
        Ok(HeapBuf { ptr, len })
    }

    pub fn data(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr holds len initialised (zeroed or written) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for HeapBuf {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated above with exactly this layout.
            unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, ALIGN)) };
        }
    }
}
