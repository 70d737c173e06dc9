//! How the library finds and starts the manager daemon: the path set by
//! set_manager_binary, else SS_SHM_MANAGER, else beside the library, else
//! PATH; and what a daemon that fails to start looks like. One test, run
//! in order, because it changes process-wide settings.

#[path = "../common/mod.rs"]
mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use storage_sharing::manager::spawn::{find_manager_binary, set_manager_binary, spawn_manager, MANAGER_ENV};
use storage_sharing::ErrorKind;

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[test]
fn lookup_order_and_start_failures() {
    let dir = std::env::temp_dir().join(format!("ss-spawn-lookup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // Nothing anywhere: a NotFound naming the variable to set.
    std::env::remove_var(MANAGER_ENV);
    std::env::set_var("PATH", &dir);
    let e = find_manager_binary().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.message().contains(MANAGER_ENV), "{e}");

    // On PATH.
    let on_path = dir.join("ss_shm_manager");
    std::os::unix::fs::symlink(common::manager_bin(), &on_path).unwrap();
    assert_eq!(find_manager_binary().unwrap(), on_path);
    let sock = spawn_manager().unwrap();
    assert!(sock.ends_with("/manager.sock"), "{sock}");

    // The environment variable wins over PATH.
    let missing = dir.join("missing");
    std::env::set_var(MANAGER_ENV, &missing);
    assert_eq!(find_manager_binary().unwrap(), missing);
    let e = spawn_manager().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.message().contains("could not start the shared memory manager"), "{e}");

    let failing = script(&dir, "failing", "echo 'ERROR: cannot bind the socket'; exit 1");
    std::env::set_var(MANAGER_ENV, &failing);
    let e = spawn_manager().unwrap_err();
    assert!(e.message().ends_with("cannot bind the socket"), "{e}");

    let silent = script(&dir, "silent", "exit 0");
    std::env::set_var(MANAGER_ENV, &silent);
    let e = spawn_manager().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone);
    assert!(e.message().contains("no response"), "{e}");

    // One that keeps its stdout open and never answers is stopped.
    let hanging = script(&dir, "hanging", "exec /bin/sleep 600");
    std::env::set_var(MANAGER_ENV, &hanging);
    let e = spawn_manager().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("printed no socket path"), "{e}");

    // An explicit path wins over everything.
    set_manager_binary(common::manager_bin().to_str().unwrap()).unwrap();
    assert_eq!(find_manager_binary().unwrap(), common::manager_bin());
    spawn_manager().unwrap();
    assert_eq!(set_manager_binary("").unwrap_err().kind(), ErrorKind::InvalidArgument);
    let _ = std::fs::remove_dir_all(&dir);
}
