//! Helpers shared by the multi-process integration tests: each test binary
//! re-runs itself as a child through an ignored `child_role` test that
//! reads its job from the environment.

#![allow(dead_code)]

use std::process::{Command, Output};

pub const ROLE_VAR: &str = "SS_TEST_CHILD_ROLE";

/// A command that runs this test binary's `child_role` entry with `role`.
pub fn child_command(role: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env(ROLE_VAR, role)
        .env("SS_TEST_CHILD_ARGS", args.join("\u{1f}"));
    cmd
}

/// The role and arguments of this process, if it is a child.
pub fn my_role() -> Option<(String, Vec<String>)> {
    let role = std::env::var(ROLE_VAR).ok()?;
    let args = std::env::var("SS_TEST_CHILD_ARGS").unwrap_or_default();
    let args = if args.is_empty() { Vec::new() } else { args.split('\u{1f}').map(str::to_string).collect() };
    Some((role, args))
}

/// Runs a child and panics with its output unless it succeeded.
pub fn run_ok(mut cmd: Command) -> Output {
    let out = cmd.output().expect("spawn child");
    assert!(
        out.status.success(),
        "child failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn shm_exists(name: &str) -> bool {
    std::path::Path::new(&format!("/dev/shm{name}")).exists()
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The Python that interop tests use: $SS_TEST_PYTHON, else python3.
pub fn python() -> String {
    std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Whether that Python can import torch; prints the skip line when not.
pub fn torch_available(test: &str) -> bool {
    let ok = Command::new(python())
        .args(["-c", "import torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        println!("{test}: skipped: torch not installed (set SS_TEST_PYTHON to a Python with torch)");
    }
    ok
}
