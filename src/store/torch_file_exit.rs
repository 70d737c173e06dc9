//! Counts FileStore members still open at process exit out of their files.
//!
//! PyTorch's stores count themselves out when C++ destroys them, which
//! includes the static destructors that run at exit; a Rust static is never
//! dropped, so a store kept by a process-wide table (a symmetric-memory
//! group) would otherwise never count itself out, and the file would never
//! be removed. An `atexit` hook does the same work for what is left.

use std::sync::{Mutex, Once, Weak};

/// Something that counts itself out of a shared file once.
pub trait Leave: Send + Sync {
    /// Counts out, unless already done (or not this process's to do).
    fn leave_once(&self);
}

static OPEN: Mutex<Vec<Weak<dyn Leave>>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();

/// Remembers `member` until it is dropped, to count it out at exit.
pub fn register(member: Weak<dyn Leave>) {
    HOOK.call_once(|| {
        // SAFETY: registers a plain function; it runs once, at exit.
        unsafe { libc::atexit(leave_all) };
    });
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    open.retain(|w| w.strong_count() > 0);
    open.push(member);
}

/// The atexit callback. A panic is caught because it must not unwind into
/// the C runtime that calls this.
extern "C" fn leave_all() {
    let _ = std::panic::catch_unwind(|| {
        let open = std::mem::take(&mut *OPEN.lock().unwrap_or_else(|p| p.into_inner()));
        for member in open.iter().filter_map(Weak::upgrade) {
            member.leave_once();
        }
    });
}
