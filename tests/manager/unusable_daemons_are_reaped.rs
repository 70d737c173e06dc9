//! A started manager that prints a socket path nobody can
//! use (missing, not a socket, 108 bytes or more) is killed and reaped by
//! the failed start, never left running. Fake managers are shell scripts
//! that write their pid to a file and then keep running.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use storage_sharing::manager::spawn::spawn_manager_at;
use storage_sharing::ErrorKind;

fn fake_manager(dir: &Path, name: &str, prints: &str) -> PathBuf {
    let p = dir.join(name);
    let pid_file = dir.join(format!("{name}.pid"));
    let body = format!("#!/bin/sh\necho $$ > '{}'\necho '{prints}'\nexec /bin/sleep 600\n", pid_file.display());
    std::fs::write(&p, body).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// Whether `pid` is still a process of ours (running or an unreaped zombie).
fn still_there(pid: &str) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_manager_printing_an_unusable_path_is_stopped() {
    let dir = std::env::temp_dir().join(format!("ss-spawn-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let not_socket = dir.join("plain-file");
    std::fs::write(&not_socket, b"").unwrap();
    let long = format!("/tmp/{}/manager.sock", "x".repeat(110));
    let cases = [
        ("missing", dir.join("no-such-dir/manager.sock").display().to_string(), ErrorKind::NotFound),
        ("not-a-socket", not_socket.display().to_string(), ErrorKind::Protocol),
        ("too-long", long, ErrorKind::NameTooLong),
    ];
    for (name, prints, kind) in cases {
        let script = fake_manager(&dir, name, &prints);
        let e = spawn_manager_at(&script).unwrap_err();
        assert_eq!(e.kind(), kind, "{name}: {e}");
        assert!(e.message().contains("it was stopped"), "{name}: {e}");
        let pid = std::fs::read_to_string(dir.join(format!("{name}.pid"))).unwrap();
        let pid = pid.trim();
        assert!(!still_there(pid), "{name}: the fake manager {pid} is still running or unreaped");
    }
    // The same through a managed allocation, which spawns on first use.
    let script = fake_manager(&dir, "via-open", &dir.join("gone.sock").display().to_string());
    std::env::set_var(storage_sharing::manager::spawn::MANAGER_ENV, &script);
    let e = storage_sharing::manager::default_client().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let pid = std::fs::read_to_string(dir.join("via-open.pid")).unwrap();
    assert!(!still_there(pid.trim()), "the fake manager {} is still running or unreaped", pid.trim());
    std::fs::remove_dir_all(&dir).unwrap();
}
