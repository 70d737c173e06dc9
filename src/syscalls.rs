//! Kernel calls made through syscall(2) instead of glibc's wrappers, so the
//! library and its programs link against glibc 2.17 (the manylinux2014
//! wheel, `scripts/build_wheel.sh`): glibc gained `getrandom` in 2.25 and
//! `memfd_create` in 2.27, while the kernel calls are older (3.17, 3.17).
//! futex has no glibc wrapper at all.

use std::ffi::CStr;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// memfd_create(2): a new anonymous file, or -1 with errno set.
pub fn memfd_create(name: &CStr, flags: libc::c_uint) -> libc::c_int {
    // SAFETY: the kernel reads the NUL-terminated name only.
    unsafe { libc::syscall(libc::SYS_memfd_create, name.as_ptr(), flags) as libc::c_int }
}

/// getrandom(2) into `buf`: the number of bytes written, or -1 with errno set.
pub fn getrandom(buf: &mut [u8]) -> isize {
    // SAFETY: the kernel writes at most `buf.len()` bytes into the buffer we own.
    unsafe { libc::syscall(libc::SYS_getrandom, buf.as_mut_ptr(), buf.len(), 0u32) as isize }
}

/// futex(2) FUTEX_WAIT on a word that may be shared between processes:
/// sleeps while `word` holds `expected`, until a wake or `timeout`. Every
/// outcome (woken, EINTR, EAGAIN for a changed word, ETIMEDOUT) means "look
/// again", so none is reported.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout
        .map(|t| libc::timespec { tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t, tv_nsec: t.subsec_nanos() as libc::c_long });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: FUTEX_WAIT (the shared kind: the word may be in memory mapped
    // by several processes) reads the aligned u32 behind `word`, which the
    // borrow keeps mapped for the call; the timespec outlives it.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, ts_ptr, std::ptr::null::<u32>(), 0);
    }
}

/// futex(2) FUTEX_WAKE: wakes every waiter on `word`, in any process.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE (shared) only uses the address as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_create_gives_a_descriptor() {
        let fd = memfd_create(c"ss-syscalls-test", libc::MFD_CLOEXEC);
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: our own fresh descriptor.
        unsafe { libc::close(fd) };
    }

    #[test]
    fn futex_wait_returns_at_a_wake_or_a_changed_word() {
        use std::sync::atomic::Ordering::SeqCst;
        use std::sync::Arc;
        use std::time::Instant;
        let long = Duration::from_secs(60);
        let word = Arc::new(AtomicU32::new(7));
        let started = Instant::now();
        futex_wait(&word, 8, Some(long));
        assert!(started.elapsed() < long, "a word that differs from `expected` returns at once");
        let waiter = {
            let word = word.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                while word.load(SeqCst) == 7 {
                    futex_wait(&word, 7, Some(long));
                }
                started.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        word.store(9, SeqCst);
        futex_wake(&word);
        assert!(waiter.join().unwrap() < long, "the waiter was woken, not timed out");
    }

    #[test]
    fn getrandom_fills_the_buffer() {
        let mut a = [0u8; 16];
        let mut b = [0u8; 16];
        assert_eq!(getrandom(&mut a), 16);
        assert_eq!(getrandom(&mut b), 16);
        assert_ne!(a, b);
    }
}
