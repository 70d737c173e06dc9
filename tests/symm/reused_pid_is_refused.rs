//! The descriptor ring of a rendezvous knows each peer by pid and start
//! time. A process that got the pid of a rank that exited, and listens at
//! (or connects to) the ring's sockets, is a stranger: before, it passed
//! the pid and uid check, received this rank's block descriptor and could
//! hand over a block of its own. Needs root to choose a pid
//! (`/proc/sys/kernel/ns_last_pid`); elsewhere it says it skipped.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/pid_reuse.rs"]
mod pid_reuse;

use common::{child_command, my_role};
use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use storage_sharing::fdpass::{abstract_socket, recv_fds, send_fds};
use storage_sharing::symm::ipc_channel::{IpcChannel, PeerSocket};
use storage_sharing::ErrorKind;

fn memfd() -> OwnedFd {
    // SAFETY: memfd_create with a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"reused-pid-block".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a descriptor memfd_create just gave us.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The stranger with the dead rank's pid. "listen NAME": listens where
/// the rank did and reports what arrives. "send NAME": sends a descriptor
/// of its own to NAME as rank 1.
#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    match role.as_str() {
        "listen" => {
            let l = abstract_socket::listen(&args[0]).unwrap();
            println!("listening");
            let mut p = libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one pollfd on the stack.
            assert_eq!(unsafe { libc::poll(&mut p, 1, 20_000) }, 1);
            let conn = abstract_socket::accept(l.as_raw_fd()).unwrap();
            let mut buf = [0u8; 4];
            let (_, fds) = recv_fds(conn.as_raw_fd(), &mut buf, 1).unwrap();
            println!("received {} descriptors", fds.len());
        }
        "send" => {
            let conn = abstract_socket::connect(&args[0]).unwrap();
            let fd = memfd();
            send_fds(conn.as_raw_fd(), &1u32.to_ne_bytes(), &[fd.as_raw_fd()]).unwrap();
            println!("sent");
            std::thread::sleep(Duration::from_secs(20));
        }
        other => panic!("unknown role {other}"),
    }
}

/// Runs `role` as the process of the freed `pid`; waits until it says `word`.
fn stranger_at(pid: i32, role: &str, name: &str, word: &str) -> Option<Child> {
    let spawned = pid_reuse::spawn_as_pid(pid, || {
        let mut c = child_command(role, &[name]);
        c.stdout(Stdio::piped()).stderr(Stdio::null());
        c
    });
    let mut child = match spawned {
        Ok(c) => c,
        Err(why) => {
            println!("reused_pid_is_refused: skipped: {why}");
            return None;
        }
    };
    // The role's word comes after the test harness's own lines.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let said = lines.find(|l| l.as_ref().map_or(true, |l| l.contains(word))).and_then(|l| l.ok());
    assert!(said.is_some(), "the stranger ({role}) never said {word:?}");
    Some(child)
}

fn finish(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_process_with_a_gone_ranks_pid_neither_gets_nor_gives_a_descriptor() {
    let me = storage_sharing::proc_identity::me();
    let channel = IpcChannel::open().unwrap();
    let mine = PeerSocket { pid: me.0, start: me.1, name: channel.name().to_string() };

    // Sending: rank 1 exited; the process now at its pid listens at its name.
    let (pid, start) = pid_reuse::freed_pid();
    let name = abstract_socket::unique_name_with("symm_mem-gone-rank");
    let Some(stranger) = stranger_at(pid, "listen", &name, "listening") else { return };
    let gone = PeerSocket { pid, start, name: name.clone() };
    let block = memfd();
    let deadline = Some(Instant::now() + Duration::from_secs(10));
    let sent = channel.all_gather(block.as_raw_fd(), 0, &[mine.clone(), gone], deadline);
    finish(stranger);
    let e = sent.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(e.message().contains("was not sent"), "{e}");

    // Receiving: the process at the gone rank's pid connects and sends.
    let (pid, start) = pid_reuse::freed_pid();
    let Some(stranger) = stranger_at(pid, "send", channel.name(), "sent") else { return };
    let gone = PeerSocket { pid, start, name: abstract_socket::unique_name_with("symm_mem-gone-rank") };
    let got = channel.broadcast(None, 1, 0, &[mine, gone], Some(Instant::now() + Duration::from_secs(10)));
    finish(stranger);
    let e = got.map(|fd| fd.is_some()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    assert!(e.message().contains(&format!("a connection of pid {pid}")) && e.message().contains("was refused"), "{e}");
}
