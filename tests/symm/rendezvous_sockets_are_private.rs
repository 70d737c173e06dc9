//! Every rendezvous has a descriptor socket of its own (an abstract name
//! with a random part), so a rendezvous that waits for its peers blocks
//! neither a child forked meanwhile nor another rendezvous of the same
//! process, and it still gives up at its own timeout.
//!
//! One test in its own binary: no other test of this process runs a
//! rendezvous meanwhile.

use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::store::{FileStore, StoreRef};
use storage_sharing::symm::cpu_backend::layout_for;
use storage_sharing::symm::request::RendezvousRequest;
use storage_sharing::symm::{self, group, registry, DeviceType};
use storage_sharing::ErrorKind;

/// Waits up to `limit` for child `pid`; kills it and returns None if it is
/// still running then.
fn wait_child(pid: libc::pid_t, limit: Duration) -> Option<i32> {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child, status on the stack.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -1 });
        }
        if start.elapsed() > limit {
            // SAFETY: kill and reap our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn waiting_rendezvous_neither_blocks_a_forked_child_nor_ignores_timeouts() {
    let dir = std::env::temp_dir().join(format!("ss-symm-busy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store: StoreRef = Arc::new(FileStore::open(dir.join("store")).unwrap());
    // Rank 0 of 2. "Rank 1" is a request published by hand for a live
    // process that never publishes its socket, so rank 0 keeps its own
    // descriptor socket open for its whole 4 s, waiting for it.
    let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let mut fake = RendezvousRequest::new(0, &layout_for(4096, registry::signal_pad_size()).unwrap());
    fake.pid = sleeper.id() as i32;
    store.set(b"symmetric_memory-waits/CPUSymmetricMemory/0/1", &fake.to_bytes()).unwrap();
    group::set_group_info("waits", 0, 2, store.clone()).unwrap();
    let p = symm::alloc(DeviceType::Cpu, 0, 4096, Some("waits")).unwrap();
    let pv = p as usize;
    let waiter = std::thread::spawn(move || symm::rendezvous(pv as *mut u8, None, Some(Duration::from_secs(4))));
    std::thread::sleep(Duration::from_millis(300));

    // A child forked now runs its own one-rank rendezvous.
    // SAFETY: the child only uses the library and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            group::set_group_info("child", 0, 1, store.clone()).ok()?;
            let q = symm::alloc(DeviceType::Cpu, 0, 4096, Some("child")).ok()?;
            symm::rendezvous(q, None, Some(Duration::from_millis(1000))).ok()
        })()
        .map_or(1, |_| 0);
        // SAFETY: leaves the child without running the parent's atexit hooks.
        unsafe { libc::_exit(code) };
    }
    let child = wait_child(pid, Duration::from_secs(3));

    // A second rendezvous in this process while the first one waits: it
    // has its own socket, so it runs.
    group::set_group_info("second", 0, 1, store.clone()).unwrap();
    let q = symm::alloc(DeviceType::Cpu, 0, 4096, Some("second")).unwrap();
    let second = symm::rendezvous(q, None, Some(Duration::from_millis(2000)));

    let first = waiter.join().unwrap().unwrap_err();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert_eq!(first.kind(), ErrorKind::Timeout, "{first}");
    assert!(first.message().contains("rank 1"), "{first}");
    assert_eq!(child, Some(0), "the forked child's rendezvous failed (1) or hung past its timeout (None)");
    second.unwrap();
    symm::free(q).unwrap();
    symm::free(p).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
