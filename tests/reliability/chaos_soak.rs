//! A bounded chaos soak in CI (`ss_soak`, see src/bin/ss_soak): 40 rounds
//! over every sharing path, then a few rounds of each of the paths whose
//! rounds are slow enough that a random pick could miss them (symmetric
//! memory, the content store, the arena), each round with a SIGKILL at a
//! random step. Fails on any leaked segment, live daemon, leaked
//! descriptor, wrong count, changed byte, corrupt store object, hang or
//! untyped error; the output names the seed and round to replay.

use std::process::Command;

/// Runs `ss_soak` with `args` plus `--rounds rounds` and checks its summary.
fn soak(args: &[&str], rounds: u32) {
    // A fixed seed would hide nothing new and make failures random in CI
    // anyway; a fresh seed each run widens coverage and the output replays it.
    let out = Command::new(env!("CARGO_BIN_EXE_ss_soak"))
        .args(args)
        .args(["--rounds", &rounds.to_string()])
        .env("SS_SHM_MANAGER", env!("CARGO_BIN_EXE_ss_shm_manager"))
        .output()
        .expect("run ss_soak");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    let summary = text.lines().find(|l| l.starts_with("ss_soak: rounds")).expect("a summary line");
    assert!(out.status.success(), "soak {args:?} failed:\n{text}");
    for field in ["segments_left 0", "daemons_left 0", "failures 0"] {
        assert!(summary.contains(field), "{field} missing in: {summary}");
    }
    assert!(summary.contains(&format!("rounds {rounds} ")), "{summary}");
}

#[test]
fn bounded_chaos_soak_leaves_nothing() {
    soak(&[], 40);
}

#[test]
fn symmetric_memory_survivors_get_typed_errors_in_time() {
    soak(&["--only", "symm"], 8);
}

#[test]
fn content_store_writers_killed_leave_no_corrupt_object() {
    soak(&["--only", "content_store"], 8);
}

#[test]
fn arena_rounds_leave_no_segment_and_exact_counts() {
    soak(&["--only", "arena"], 30);
}
