//! C API of fork safety: what the pthread_atfork handlers do that keep the
//! library's process-wide locks from being inherited held by a child (see
//! `fork_safe`, which installs those handlers itself on first use). Exported
//! for programs that fork with a raw clone(2), which runs no atfork handlers.

use crate::fork_safe;

/// Takes every process-wide lock of the library, waiting for threads that
/// are inside the library to leave it. Installed as pthread_atfork's
/// "prepare" handler on first use of the library; call it yourself only
/// right before a fork done without fork(3), then call
/// `ss_atfork_parent` in the parent and `ss_atfork_child` in the child.
#[no_mangle]
pub extern "C" fn ss_atfork_prepare() {
    ffi_value!("ss_atfork_prepare", (), { fork_safe::before_fork() })
}

/// Releases what `ss_atfork_prepare` took, in the parent after the fork.
#[no_mangle]
pub extern "C" fn ss_atfork_parent() {
    ffi_value!("ss_atfork_parent", (), { fork_safe::after_fork() })
}

/// Releases what `ss_atfork_prepare` took, in the child after the fork,
/// and tells the library it runs in a new process (so a TCPStore handle
/// opens its own connection instead of sharing its parent's).
#[no_mangle]
pub extern "C" fn ss_atfork_child() {
    ffi_value!("ss_atfork_child", (), { fork_safe::after_fork_in_child() })
}
