//! A consumer maps a received arena segment descriptor only when nobody
//! can shrink it under the mapping: the arena seals every memfd segment
//! it makes (F_SEAL_SHRINK), and `import_segment_fd` / `recv_block` refuse
//! a descriptor without that seal, or one too small for the segment, with
//! a typed error, mapping nothing. (Before, a sender could hand over a
//! memfd of its own, then truncate it: the consumer died of SIGBUS.)

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use storage_sharing::arena::remote::has_segment;
use storage_sharing::arena::transport::recv_block;
use storage_sharing::arena::{import_segment_fd, open_remote, Arena, ArenaHandle, ArenaOptions, Strategy};
use storage_sharing::storage::send_fds;
use storage_sharing::ErrorKind;

fn fd_arena() -> Arena {
    Arena::new(ArenaOptions { segment_size: 1 << 20, strategy: Strategy::Fd, max_holds: 64, large_threshold: 256 << 10 }).unwrap()
}

fn size_of(fd: RawFd) -> usize {
    // SAFETY: plain data filled by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is valid for the call.
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
    st.st_size as usize
}

fn seals_of(fd: RawFd) -> i32 {
    // SAFETY: F_GET_SEALS only reads.
    unsafe { libc::fcntl(fd, libc::F_GET_SEALS) }
}

/// A memfd holding the first `len` bytes of `fd` (a forger's copy: the
/// same header, so only the seal tells it apart), sealed against
/// shrinking if `sealed`.
fn copy_of(fd: RawFd, len: usize, sealed: bool) -> OwnedFd {
    let mut bytes = vec![0u8; len];
    // SAFETY: pread into our buffer of `len` bytes.
    assert_eq!(unsafe { libc::pread(fd, bytes.as_mut_ptr().cast(), len, 0) }, len as isize);
    // SAFETY: memfd_create with a NUL-terminated name.
    let raw = unsafe { libc::memfd_create(c"forged-segment".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(raw >= 0);
    // SAFETY: a descriptor memfd_create just gave us.
    let copy = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: pwrite from our buffer.
    assert_eq!(unsafe { libc::pwrite(copy.as_raw_fd(), bytes.as_ptr().cast(), len, 0) }, len as isize);
    if sealed {
        // SAFETY: fcntl on our memfd.
        assert_eq!(unsafe { libc::fcntl(copy.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
    }
    copy
}

/// A block shared by the arena: its handle and its segment's descriptor.
fn shared_block(arena: &Arena, size: usize) -> (ArenaHandle, RawFd) {
    let p = arena.alloc(size, 64).unwrap();
    let h = arena.share(p).unwrap();
    let fd = arena.segment_fd(h.key.segment_id).unwrap();
    (h, fd)
}

fn dup(fd: RawFd) -> OwnedFd {
    // SAFETY: dup of a descriptor the arena keeps open.
    let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    assert!(d >= 0);
    // SAFETY: a fresh descriptor.
    unsafe { OwnedFd::from_raw_fd(d) }
}

#[test]
fn the_arena_seals_every_segment_it_makes() {
    let arena = fd_arena();
    // A small block (a shared segment) and a large one (a segment of its own).
    for size in [100, 600 << 10] {
        let (_, fd) = shared_block(&arena, size);
        let seals = seals_of(fd);
        assert!(seals >= 0 && seals & libc::F_SEAL_SHRINK != 0, "segment of a {size}-byte block: seals {seals:#x}");
        assert!(seals & libc::F_SEAL_SEAL != 0, "nobody may add seals after the arena: {seals:#x}");
        // SAFETY: ftruncate on the arena's memfd: the seal refuses it.
        assert_ne!(unsafe { libc::ftruncate(fd, 0) }, 0, "a sealed segment shrank");
        assert!(size_of(fd) > size);
    }
}

#[test]
fn an_unsealed_copy_of_a_segment_is_refused_and_nothing_is_mapped() {
    let arena = fd_arena();
    let (h, fd) = shared_block(&arena, 4000);
    let forged = copy_of(fd, size_of(fd), false);
    let e = import_segment_fd(&h, forged).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(e.message().contains("not sealed against shrinking"), "{e}");
    assert!(!has_segment(&h), "the refused descriptor was mapped");
    assert_eq!(open_remote(&h).unwrap_err().kind(), ErrorKind::NotFound);
    // The arena's own descriptor is accepted, and the block opens.
    import_segment_fd(&h, dup(fd)).unwrap();
    let v = open_remote(&h).unwrap();
    assert_eq!(v.size(), h.size as usize);
}

#[test]
fn a_sealed_descriptor_too_small_for_the_segment_is_refused() {
    let arena = fd_arena();
    let (h, fd) = shared_block(&arena, 4000);
    // The data without the header and hold slots behind it.
    let short = copy_of(fd, h.segment_data_size as usize, true);
    let e = import_segment_fd(&h, short).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::SizeMismatch, "{e}");
    assert!(!has_segment(&h));
}

#[test]
fn recv_block_refuses_an_unsealed_segment_descriptor() {
    let arena = fd_arena();
    let (h, fd) = shared_block(&arena, 4000);
    let forged = copy_of(fd, size_of(fd), false);
    let (a, b) = UnixStream::pair().unwrap();
    // What `send_block` sends: the descriptor count, the handle, the fd.
    let mut msg = vec![1u8];
    msg.extend_from_slice(&h.encode());
    assert_eq!(send_fds(a.as_raw_fd(), &msg, &[forged.as_raw_fd()]).unwrap(), msg.len());
    drop(forged);
    let e = recv_block(b.as_raw_fd()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(!has_segment(&h), "the refused descriptor was mapped");
}

#[test]
fn a_sealed_hugetlb_descriptor_is_refused_before_it_is_mapped() {
    // A hugetlbfs memfd sealed against shrinking can still have holes
    // punched in it by its sender; a hole with no free huge page left is
    // SIGBUS for whoever maps it. So it is refused unmapped, whatever the
    // huge page pool holds.
    let arena = fd_arena();
    let (h, fd) = shared_block(&arena, 4000);
    // SAFETY: memfd_create with a NUL-terminated name.
    let raw = unsafe { libc::memfd_create(c"forged-huge".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB) };
    if raw < 0 {
        println!(
            "a_sealed_hugetlb_descriptor_is_refused_before_it_is_mapped: skipped: no hugetlbfs memfd here ({})",
            std::io::Error::last_os_error()
        );
        return;
    }
    // SAFETY: a descriptor memfd_create just gave us.
    let huge = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = size_of(fd).div_ceil(1 << 30) << 30;
    // SAFETY: ftruncate and fcntl on our memfd.
    unsafe {
        assert_eq!(libc::ftruncate(huge.as_raw_fd(), len as libc::off_t), 0, "{}", std::io::Error::last_os_error());
        assert_eq!(libc::fcntl(huge.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
    }
    let e = import_segment_fd(&h, huge).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(e.message().contains("hugetlbfs"), "{e}");
    assert!(!has_segment(&h), "the refused descriptor was mapped");
}
