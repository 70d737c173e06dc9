//! `ss_status`: the result of every fallible C function.

use crate::error::ErrorKind;

/// Result of a fallible call. `SS_OK` is 0; every other value names a kind
/// of failure, and `ss_last_error_message()` gives the detail. Values are
/// never renumbered or reused.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ss_status {
    /// Success.
    SS_OK = 0,
    /// An argument has a value the call cannot accept.
    SS_ERR_INVALID_ARGUMENT = 1,
    /// A required pointer argument was NULL.
    SS_ERR_NULL_POINTER = 2,
    /// The named object does not exist.
    SS_ERR_NOT_FOUND = 3,
    /// An object that must be new already exists.
    SS_ERR_ALREADY_EXISTS = 4,
    /// The file system or memory cannot hold the requested bytes.
    SS_ERR_NO_SPACE = 5,
    /// The operating system refused access.
    SS_ERR_PERMISSION = 6,
    /// A size does not match what the object holds.
    SS_ERR_SIZE_MISMATCH = 7,
    /// Another operating-system failure.
    SS_ERR_IO = 8,
    /// Not supported with these flags or on this platform.
    SS_ERR_UNSUPPORTED = 9,
    /// CUDA cannot be used here (no driver, no device, driver too old).
    SS_ERR_CUDA_UNAVAILABLE = 10,
    /// A CUDA driver call failed.
    SS_ERR_CUDA = 11,
    /// A wait ran out of time.
    SS_ERR_TIMEOUT = 12,
    /// A peer broke the protocol.
    SS_ERR_PROTOCOL = 13,
    /// A Rust panic was caught at the C boundary (a bug: please report).
    SS_ERR_PANIC = 14,
    /// A name is longer than the format allows.
    SS_ERR_NAME_TOO_LONG = 15,
    /// A refcounted segment's header count is not positive.
    SS_ERR_BAD_REFCOUNT = 16,
    /// Out of file descriptors (raise `ulimit -n`).
    SS_ERR_TOO_MANY_FILES = 17,
    /// The object was already closed.
    SS_ERR_CLOSED = 18,
    /// A caller-provided output buffer is too small.
    SS_ERR_BUFFER_TOO_SMALL = 19,
    /// The peer process or connection is gone.
    SS_ERR_PEER_GONE = 20,
    /// The object is still in use.
    SS_ERR_BUSY = 21,
    /// Stored data does not match its name or format.
    SS_ERR_CORRUPT = 22,
}

impl From<ErrorKind> for ss_status {
    fn from(kind: ErrorKind) -> Self {
        use ss_status::*;
        match kind {
            ErrorKind::InvalidArgument => SS_ERR_INVALID_ARGUMENT,
            ErrorKind::NullPointer => SS_ERR_NULL_POINTER,
            ErrorKind::NotFound => SS_ERR_NOT_FOUND,
            ErrorKind::AlreadyExists => SS_ERR_ALREADY_EXISTS,
            ErrorKind::NoSpace => SS_ERR_NO_SPACE,
            ErrorKind::Permission => SS_ERR_PERMISSION,
            ErrorKind::SizeMismatch => SS_ERR_SIZE_MISMATCH,
            ErrorKind::Io => SS_ERR_IO,
            ErrorKind::Unsupported => SS_ERR_UNSUPPORTED,
            ErrorKind::CudaUnavailable => SS_ERR_CUDA_UNAVAILABLE,
            ErrorKind::CudaError => SS_ERR_CUDA,
            ErrorKind::Timeout => SS_ERR_TIMEOUT,
            ErrorKind::Protocol => SS_ERR_PROTOCOL,
            ErrorKind::Panic => SS_ERR_PANIC,
            ErrorKind::NameTooLong => SS_ERR_NAME_TOO_LONG,
            ErrorKind::BadRefcount => SS_ERR_BAD_REFCOUNT,
            ErrorKind::TooManyFiles => SS_ERR_TOO_MANY_FILES,
            ErrorKind::Closed => SS_ERR_CLOSED,
            ErrorKind::BufferTooSmall => SS_ERR_BUFFER_TOO_SMALL,
            ErrorKind::PeerGone => SS_ERR_PEER_GONE,
            ErrorKind::Busy => SS_ERR_BUSY,
            ErrorKind::Corrupt => SS_ERR_CORRUPT,
        }
    }
}

impl ss_status {
    /// A fixed description of the code.
    pub fn text(self) -> &'static std::ffi::CStr {
        use ss_status::*;
        match self {
            SS_OK => c"ok",
            SS_ERR_INVALID_ARGUMENT => c"invalid argument",
            SS_ERR_NULL_POINTER => c"null pointer argument",
            SS_ERR_NOT_FOUND => c"not found",
            SS_ERR_ALREADY_EXISTS => c"already exists",
            SS_ERR_NO_SPACE => c"no space",
            SS_ERR_PERMISSION => c"permission denied",
            SS_ERR_SIZE_MISMATCH => c"size mismatch",
            SS_ERR_IO => c"I/O error",
            SS_ERR_UNSUPPORTED => c"unsupported",
            SS_ERR_CUDA_UNAVAILABLE => c"CUDA unavailable",
            SS_ERR_CUDA => c"CUDA error",
            SS_ERR_TIMEOUT => c"timed out",
            SS_ERR_PROTOCOL => c"protocol error",
            SS_ERR_PANIC => c"internal panic",
            SS_ERR_NAME_TOO_LONG => c"name too long",
            SS_ERR_BAD_REFCOUNT => c"bad reference count",
            SS_ERR_TOO_MANY_FILES => c"too many open files",
            SS_ERR_CLOSED => c"closed",
            SS_ERR_BUFFER_TOO_SMALL => c"buffer too small",
            SS_ERR_PEER_GONE => c"peer gone",
            SS_ERR_BUSY => c"busy",
            SS_ERR_CORRUPT => c"corrupt data",
        }
    }

    /// The code for a raw integer, if it is one.
    pub fn from_raw(code: i32) -> Option<Self> {
        use ss_status::*;
        const ALL: [ss_status; 23] = [
            SS_OK,
            SS_ERR_INVALID_ARGUMENT,
            SS_ERR_NULL_POINTER,
            SS_ERR_NOT_FOUND,
            SS_ERR_ALREADY_EXISTS,
            SS_ERR_NO_SPACE,
            SS_ERR_PERMISSION,
            SS_ERR_SIZE_MISMATCH,
            SS_ERR_IO,
            SS_ERR_UNSUPPORTED,
            SS_ERR_CUDA_UNAVAILABLE,
            SS_ERR_CUDA,
            SS_ERR_TIMEOUT,
            SS_ERR_PROTOCOL,
            SS_ERR_PANIC,
            SS_ERR_NAME_TOO_LONG,
            SS_ERR_BAD_REFCOUNT,
            SS_ERR_TOO_MANY_FILES,
            SS_ERR_CLOSED,
            SS_ERR_BUFFER_TOO_SMALL,
            SS_ERR_PEER_GONE,
            SS_ERR_BUSY,
            SS_ERR_CORRUPT,
        ];
        ALL.into_iter().find(|s| *s as i32 == code)
    }
}
