//! A consumer maps a by-name arena segment only when the file at the name
//! is its own user's and nobody else may write it. Once a producer is
//! gone and its name removed, anyone may create a file at that name (the
//! shm folder is world-writable): before, a root consumer opened a file
//! that uid 65534 had put there with a forged trailer, read the
//! stranger's bytes, and died of SIGBUS when the stranger truncated it.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/nobody.rs"]
mod nobody;

use common::{child_command_of, my_role};
use nobody::{retry_while_busy, run_as_nobody, NobodyDir};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::process::Stdio;
use storage_sharing::arena::{open_remote, Arena, ArenaHandle, ArenaOptions, Strategy};
use storage_sharing::ErrorKind;

const FORGED: &[u8] = b"EVILEVIL";

/// The stranger: creates the file at the name given, readable and
/// writable by all, holding the bytes it reads from stdin.
#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    assert_eq!(role, "squat");
    let mut bytes = Vec::new();
    std::io::stdin().read_to_end(&mut bytes).unwrap();
    let path = format!("/dev/shm{}", args[0]);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o666).open(&path).unwrap();
    f.set_permissions(std::fs::Permissions::from_mode(0o666)).unwrap();
    f.write_all(&bytes).unwrap();
    println!("squatted");
}

/// A block shared by name, the bytes of its segment file with the block
/// overwritten by `FORGED` (a forger's copy: a trailer that matches the
/// handle, the share still in flight), and the name already removed, as
/// after a producer killed with -9.
fn gone_producers_block(arena: &Arena) -> (ArenaHandle, Vec<u8>) {
    let p = arena.alloc(4000, 64).unwrap();
    // SAFETY: the block is ours, 4000 bytes.
    unsafe { std::ptr::copy_nonoverlapping(b"GENUINE!".as_ptr(), p, 8) };
    let h = arena.share(p).unwrap();
    let path = format!("/dev/shm{}", h.name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[h.offset as usize..h.offset as usize + FORGED.len()].copy_from_slice(FORGED);
    std::fs::remove_file(&path).unwrap();
    (h, bytes)
}

fn name_arena() -> Arena {
    Arena::new(ArenaOptions { segment_size: 1 << 20, strategy: Strategy::Name, max_holds: 64, large_threshold: 256 << 10 }).unwrap()
}

fn opened_bytes(h: &ArenaHandle) -> Vec<u8> {
    let v = open_remote(h).unwrap();
    // SAFETY: the view maps at least FORGED.len() bytes at its address.
    unsafe { std::slice::from_raw_parts(v.data(), FORGED.len()) }.to_vec()
}

#[test]
fn a_file_another_user_put_at_the_name_is_refused_unmapped() {
    // SAFETY: geteuid has no side effects.
    if unsafe { libc::geteuid() } != 0 {
        println!("a_file_another_user_put_at_the_name_is_refused_unmapped: skipped: not root, cannot play uid 65534");
        return;
    }
    let arena = name_arena();
    let (h, forged) = gone_producers_block(&arena);
    let dir = NobodyDir::new("squat");
    let exe = dir.copy_of(&std::env::current_exe().unwrap());
    let mut cmd = child_command_of(&exe, "squat", &[&h.name]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    run_as_nobody(&mut cmd);
    let mut child = retry_while_busy(|| cmd.spawn());
    child.stdin.take().unwrap().write_all(&forged).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("squatted"), "{}", String::from_utf8_lossy(&out.stderr));
    let path = format!("/dev/shm{}", h.name);
    match open_remote(&h) {
        Ok(v) => {
            // SAFETY: the view maps at least FORGED.len() bytes.
            let read = unsafe { std::slice::from_raw_parts(v.data(), FORGED.len()) }.to_vec();
            let _ = std::fs::remove_file(&path);
            panic!("mapped the stranger's file and read {:?}", String::from_utf8_lossy(&read));
        }
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
            assert!(e.message().contains("uid 65534"), "{e}");
            assert!(e.message().contains("nothing was mapped"), "{e}");
        }
    }
}

#[test]
fn a_file_others_may_write_is_refused_and_a_private_one_opens() {
    let arena = name_arena();
    let (h, forged) = gone_producers_block(&arena);
    let path = format!("/dev/shm{}", h.name);
    // This user's file, but writable by everyone: anyone could truncate it.
    let f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).unwrap();
    (&f).write_all(&forged).unwrap();
    f.set_permissions(std::fs::Permissions::from_mode(0o666)).unwrap();
    let refused = open_remote(&h).map(|_| ());
    // Private again (what a producer makes): it opens.
    f.set_permissions(std::fs::Permissions::from_mode(0o600)).unwrap();
    let read = opened_bytes(&h);
    std::fs::remove_file(&path).unwrap();
    let e = refused.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Permission, "{e}");
    assert!(e.message().contains("0666"), "{e}");
    assert_eq!(read, FORGED);
}
