//! The crate's error type: a kind (which becomes a C status code) and a
//! message that names what was wrong (name, size, errno text).

use std::fmt;

/// What went wrong, coarse enough for a caller to branch on.
///
/// Every kind maps to one stable C status code in `ffi::status`; kinds are
/// only ever added, never renumbered or reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An argument has a value the operation cannot accept.
    InvalidArgument,
    /// A required pointer was NULL (only produced at the C boundary).
    NullPointer,
    /// The named object (segment, file, mapping, key) does not exist.
    NotFound,
    /// An object that must be new already exists.
    AlreadyExists,
    /// The file system or memory cannot hold the requested bytes.
    NoSpace,
    /// The operating system refused access.
    Permission,
    /// A size does not match what the object holds or expects.
    SizeMismatch,
    /// Any other operating-system failure.
    Io,
    /// The operation is not supported with these flags or on this platform.
    Unsupported,
    /// CUDA cannot be used: no driver library, no device, or driver too old.
    CudaUnavailable,
    /// A CUDA driver call failed.
    CudaError,
    /// A wait ran out of time.
    Timeout,
    /// A peer sent bytes that do not follow the protocol.
    Protocol,
    /// A Rust panic was caught at the C boundary.
    Panic,
    /// A name is longer than the format allows.
    NameTooLong,
    /// A refcounted segment's header count is not positive.
    BadRefcount,
    /// The process or system is out of file descriptors.
    TooManyFiles,
    /// The object was already closed.
    Closed,
    /// A caller-provided output buffer is too small.
    BufferTooSmall,
    /// The peer process or connection is gone.
    PeerGone,
    /// The object is still in use and cannot be released or reused yet.
    Busy,
    /// Stored data does not match its name or format (hash mismatch,
    /// truncated or malformed record).
    Corrupt,
}

/// An error with its kind and a message naming the object and the cause.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
    }

    /// An error from an errno value, with `context` saying what was being
    /// done; the kind is derived from the errno.
    pub fn from_errno(errno: i32, context: impl fmt::Display) -> Self {
        let text = std::io::Error::from_raw_os_error(errno);
        Error::new(kind_of_errno(errno), format!("{context}: {text}"))
    }

    /// Like [`Error::from_errno`] with the calling thread's current errno.
    pub fn last_os_error(context: impl fmt::Display) -> Self {
        Error::from_errno(errno(), context)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `prefix: ` put before its message.
    pub fn context(self, prefix: impl fmt::Display) -> Self {
        Error { kind: self.kind, message: format!("{prefix}: {}", self.message) }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<nix::Error> for Error {
    fn from(e: nix::Error) -> Self {
        Error::from_errno(e as i32, "system call failed")
    }
}

/// The calling thread's errno.
pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Which kind an errno value belongs to.
pub fn kind_of_errno(errno: i32) -> ErrorKind {
    match errno {
        libc::ENOENT => ErrorKind::NotFound,
        libc::EEXIST => ErrorKind::AlreadyExists,
        libc::ENOSPC | libc::ENOMEM | libc::EFBIG | libc::EDQUOT => ErrorKind::NoSpace,
        libc::EACCES | libc::EPERM | libc::EROFS => ErrorKind::Permission,
        libc::EMFILE | libc::ENFILE => ErrorKind::TooManyFiles,
        libc::ENAMETOOLONG => ErrorKind::NameTooLong,
        libc::EINVAL => ErrorKind::InvalidArgument,
        libc::ETIMEDOUT => ErrorKind::Timeout,
        libc::EPIPE | libc::ECONNRESET | libc::ECONNREFUSED | libc::ESRCH => ErrorKind::PeerGone,
        libc::EOPNOTSUPP | libc::ENOSYS => ErrorKind::Unsupported,
        libc::EBADF => ErrorKind::Closed,
        libc::EBUSY => ErrorKind::Busy,
        _ => ErrorKind::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_kinds_and_messages() {
        let e = Error::from_errno(libc::ENOENT, "unable to open </x>");
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.message().starts_with("unable to open </x>: "), "{}", e.message());
        assert!(e.message().contains("No such file"), "{}", e.message());
        assert_eq!(kind_of_errno(libc::ENOSPC), ErrorKind::NoSpace);
        assert_eq!(kind_of_errno(libc::EMFILE), ErrorKind::TooManyFiles);
        assert_eq!(kind_of_errno(libc::EIO), ErrorKind::Io);
    }

    #[test]
    fn context_prefixes_and_keeps_kind() {
        let e = Error::new(ErrorKind::Timeout, "no answer").context("manager </s>");
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert_eq!(e.to_string(), "manager </s>: no answer");
    }
}
