//! Kernel calls made through syscall(2) instead of glibc's wrappers, so the
//! library and its programs link against glibc 2.17 (the manylinux2014
//! wheel, `scripts/build_wheel.sh`): glibc gained `getrandom` in 2.25 and
//! `memfd_create` in 2.27, while the kernel calls are older (3.17, 3.17).

use std::ffi::CStr;

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
    fn getrandom_fills_the_buffer() {
        let mut a = [0u8; 16];
        let mut b = [0u8; 16];
        assert_eq!(getrandom(&mut a), 16);
        assert_eq!(getrandom(&mut b), 16);
        assert_ne!(a, b);
    }
}
