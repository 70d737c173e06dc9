//! A process whose library finds no `ss_shm_manager` (none beside it, none
//! in `../bin`, none on PATH, no SS_SHM_MANAGER) still makes by-name arena
//! segments, but without the manager a kill -9 leaves their `ss_arena_*`
//! names behind. It is told so once, through the log hook, with the fix.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/nobody.rs"]
mod nobody;

use common::{child_command_of, manager_bin, my_role};
use nobody::retry_while_busy;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use storage_sharing::arena::{Arena, ArenaOptions, Strategy};

#[test]
#[ignore = "entry point of the child process"]
fn child_role() {
    let Some((role, _)) = my_role() else { return };
    assert_eq!(role, "by-name-arenas");
    let warnings: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = warnings.clone();
    storage_sharing::log::set_sink(Some(Arc::new(move |level, text: &str| {
        if level == storage_sharing::log::Level::Warning {
            seen.lock().unwrap().push(text.to_string());
        }
    })));
    // Several segments in two arenas: small blocks, and large ones (a
    // segment each).
    let opts = ArenaOptions { segment_size: 1 << 20, strategy: Strategy::Name, max_holds: 64, large_threshold: 256 << 10 };
    let arenas = [Arena::new(opts.clone()).unwrap(), Arena::new(opts).unwrap()];
    for arena in &arenas {
        let blocks: Vec<*mut u8> = (0..3).map(|_| arena.alloc(300 << 10, 64).unwrap()).chain([arena.alloc(4096, 64).unwrap()]).collect();
        for p in blocks {
            // SAFETY: a fresh block of at least one byte.
            unsafe { p.write(1) };
            arena.free(p).unwrap();
        }
    }
    drop(arenas);
    storage_sharing::log::set_sink(None);
    let warnings = warnings.lock().unwrap();
    println!("\nwarnings={}", warnings.len());
    for w in warnings.iter() {
        println!("warning: {w}");
    }
}

/// Runs the child from a copy of this test binary in a fresh folder (no
/// manager beside it or in `../bin`), with `manager` as SS_SHM_MANAGER
/// (None: unset) and an empty PATH. Returns its stdout.
fn run_child(manager: Option<&std::path::Path>) -> String {
    let root = std::env::temp_dir().join(format!("ss-no-manager-{}-{}", std::process::id(), manager.is_some()));
    let lib = root.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    let exe = lib.join("arena_child");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = child_command_of(&exe, "by-name-arenas", &[]);
    cmd.env("PATH", &root).env_remove("SS_SHM_MANAGER");
    if let Some(m) = manager {
        cmd.env("SS_SHM_MANAGER", m);
    }
    let out = retry_while_busy(|| cmd.output());
    let _ = std::fs::remove_dir_all(&root);
    assert!(out.status.success(), "child failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn without_a_manager_binary_by_name_segments_warn_once() {
    let text = run_child(None);
    assert!(text.contains("warnings=1\n"), "expected exactly one warning:\n{text}");
    let warning = text.lines().find_map(|l| l.strip_prefix("warning: ")).unwrap();
    for what in ["kill -9", "ss_arena_", "ss_shm_manager", "SS_SHM_MANAGER", "ssctl gc"] {
        assert!(warning.contains(what), "the warning does not mention {what}: {warning}");
    }
}

#[test]
fn with_a_manager_binary_nothing_is_said() {
    let text = run_child(Some(&manager_bin()));
    assert!(text.contains("warnings=0\n"), "a warning with a manager at hand:\n{text}");
}
