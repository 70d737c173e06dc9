//! Key-value stores for rendezvous (c10d's "Store"): what the ranks of a
//! symmetric-memory group use to find each other.
//!
//! Every store implements [`Store`]; groups and callers share one through
//! [`StoreRef`] (an `Arc`, so a group keeps its own reference).

pub mod bounded_read;
pub mod deadline;
pub mod dir_watch;
pub mod file;
pub mod file_key;
pub mod shared_watch;
pub mod tcp;
pub mod torch_file;
pub mod torch_file_exit;
pub mod torch_file_lock;
pub mod torch_file_log;

pub use file::FileStore;
pub use tcp::TcpStore;
pub use torch_file::TorchFileStore;

use crate::error::Result;
use std::sync::Arc;
use std::time::Duration;

/// How long a waiting call may wait. `None` waits forever.
pub type Timeout = Option<Duration>;

/// A key-value store shared by the ranks of a job.
///
/// Keys and values are bytes: a key may hold any byte (through the C API,
/// any but NUL), as PyTorch's stores allow. Every method may be called
/// from several threads at once; the calls one thread makes take effect in
/// the order it made them (it reads its own writes).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing an earlier value; wakes its waiters.
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting until it is set. Expiry is
    /// `ErrorKind::Timeout` with a message naming the key.
    fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>>;

    /// Adds `delta` to the integer stored under `key` (a missing key counts
    /// as 0; stored as decimal text, as c10d does) and returns the new value.
    /// The sum wraps in two's complement past either end of `i64`
    /// (`i64::MAX + 1` is `i64::MIN`), as PyTorch's TCPStore servers do.
    fn add(&self, key: &[u8], delta: i64) -> Result<i64>;

    /// Waits until every key in `keys` is set. Expiry is
    /// `ErrorKind::Timeout` with a message naming the keys still missing.
    fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()>;

    /// Whether every key in `keys` is set now (no waiting).
    fn check(&self, _keys: &[&[u8]]) -> Result<bool> {
        Err(unsupported(self, "check"))
    }

    /// c10d's compare-and-set, atomic against every other writer: when
    /// `key` holds `expected` (or is missing and `expected` is empty), sets
    /// it to `desired` and returns `desired`; otherwise changes nothing and
    /// returns the current value (`expected` itself when the key is missing).
    fn compare_set(&self, _key: &[u8], _expected: &[u8], _desired: &[u8]) -> Result<Vec<u8>> {
        Err(unsupported(self, "compare_set"))
    }

    /// Deletes `key`; true when it existed.
    fn delete_key(&self, _key: &[u8]) -> Result<bool> {
        Err(unsupported(self, "delete_key"))
    }

    /// How many keys are set (a TCPStore counts its join counter `init/` too,
    /// as PyTorch's does).
    fn num_keys(&self) -> Result<i64> {
        Err(unsupported(self, "num_keys"))
    }

    /// Where the store lives, for messages (a path, or `host:port`).
    fn describe(&self) -> String;

    /// The TCP port of a TCPStore (the one its server picked when asked
    /// for port 0); `None` for other stores.
    fn tcp_port(&self) -> Option<u16> {
        None
    }
}

/// The error of an operation a store cannot do (a host-callback store
/// has callbacks for set/get/add/wait only, and a `check` through `wait`
/// could not tell "not set" from "slow").
fn unsupported(store: &(impl Store + ?Sized), op: &str) -> crate::error::Error {
    crate::error::Error::new(crate::error::ErrorKind::Unsupported, format!("{} does not support {op}", store.describe()))
}

/// A key for messages: in quotes, bytes that are not printable ASCII
/// escaped (`"rank/\xff"`), so any key can be named.
pub fn show_key(key: &[u8]) -> String {
    format!("\"{}\"", key.escape_ascii())
}

/// A shared reference to a store.
pub type StoreRef = Arc<dyn Store>;
