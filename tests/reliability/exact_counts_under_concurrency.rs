//! Concurrency: processes × threads on one segment, one name, one manager
//! and one CUDA-IPC counter file, with exact final counts; and a
//! model-based property test of open/close/incref/decref sequences
//! (count and existence after every step, the name removed exactly when
//! the last holder closes).

#[path = "../common/mod.rs"]
mod common;

use common::*;
use proptest::prelude::*;
use std::sync::atomic::Ordering;
use storage_sharing::cuda::counters::{release_slot, CounterFile};
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, RefcountedMapAllocator};
use storage_sharing::storage::Storage;
use storage_sharing::ErrorKind;

const PROCS: usize = 4;
const THREADS: usize = 4;
const ROUNDS: usize = 300;

#[test]
#[ignore = "entry point of the child processes"]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (role, args) = (role.clone(), args.clone());
            std::thread::spawn(move || work(&role, &args, t))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// One thread's share of a child's job.
fn work(role: &str, args: &[String], t: usize) {
    match role {
        // Open and close the same name, incref/decref in between.
        "segment" => {
            for i in 0..ROUNDS {
                let m = RefcountedMapAllocator::open(&args[0], SHAREDMEM | NOCREATE, 4096).unwrap();
                for _ in 0..(i + t) % 3 {
                    m.incref().unwrap();
                }
                for _ in 0..(i + t) % 3 {
                    m.decref().unwrap();
                }
                assert!(m.refcount().unwrap() >= 2, "the parent's reference is always there");
            }
        }
        // Register with the one manager, map, unregister.
        "manager" => {
            for _ in 0..ROUNDS / 10 {
                let s = Storage::new_shared_filename(&args[0], &args[1], 4096).unwrap();
                assert_eq!(s.to_vec()[0], 42);
            }
        }
        // Release one slot of the same counter file.
        "counter" => {
            for _ in 0..ROUNDS {
                release_slot(&args[0], 7).unwrap();
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn run_children(role: &str, args: &[&str]) {
    let children: Vec<_> = (0..PROCS).map(|_| child_command(role, args).spawn().unwrap()).collect();
    for mut c in children {
        assert!(c.wait().unwrap().success(), "a {role} child failed");
    }
}

#[test]
fn processes_and_threads_on_one_segment_leave_the_exact_count() {
    let name = new_process_wide_shm_handle();
    let m = RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 4096).unwrap();
    run_children("segment", &[&name]);
    assert_eq!(m.refcount().unwrap(), 1, "{PROCS}×{THREADS}×{ROUNDS} opens and closes");
    drop(m);
    assert!(!shm_exists(&name));
}

#[test]
fn processes_and_threads_register_with_one_manager() {
    use_built_manager();
    let s = Storage::from_bytes(&[42u8; 4096]).unwrap();
    let h = s.share_filename().unwrap();
    run_children("manager", &[&h.manager_handle, &h.filename]);
    assert_eq!(s.shared_refcount().unwrap(), 1);
    drop(s);
    assert!(!shm_exists(&h.filename));
}

#[test]
fn processes_and_threads_release_one_counter_slot_to_exactly_zero() {
    let f = CounterFile::create().unwrap();
    let total = (PROCS * THREADS * ROUNDS) as i64;
    f.slot(7).store(total, Ordering::SeqCst);
    run_children("counter", &[f.name()]);
    assert_eq!(f.slot(7).load(Ordering::SeqCst), 0);
    assert_eq!(release_slot(f.name(), 7).unwrap_err().kind(), ErrorKind::BadRefcount, "never below 0");
    assert_eq!(f.mappers().unwrap(), 1, "every consumer mapping was closed");
    let name = f.name().to_string();
    drop(f);
    assert!(!shm_exists(&name));
}

/// One step of the model test, on holder `i` of a few.
#[derive(Clone, Debug)]
enum Op {
    Open(usize),
    Close(usize),
    Incref(usize),
    Decref(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..4usize).prop_map(Op::Open),
        (0..4usize).prop_map(Op::Close),
        (0..4usize).prop_map(Op::Incref),
        (0..4usize).prop_map(Op::Decref),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn refcount_follows_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        let name = new_process_wide_shm_handle();
        let mut holders: Vec<Option<RefcountedMapAllocator>> = (0..4).map(|_| None).collect();
        holders[0] = Some(RefcountedMapAllocator::open(&name, SHAREDMEM | EXCLUSIVE, 64).unwrap());
        // The model: the header count and whether the name exists.
        let (mut count, mut exists) = (1i32, true);
        for op in ops {
            match op {
                Op::Open(i) if holders[i].is_none() => {
                    let r = RefcountedMapAllocator::open(&name, SHAREDMEM | NOCREATE, 64);
                    match (exists, count > 0) {
                        (true, true) => {
                            holders[i] = Some(r.unwrap());
                            count += 1;
                        }
                        (true, false) => prop_assert_eq!(r.unwrap_err().kind(), ErrorKind::BadRefcount),
                        (false, _) => prop_assert_eq!(r.unwrap_err().kind(), ErrorKind::NotFound),
                    }
                }
                Op::Close(i) if holders[i].is_some() => {
                    holders[i].take().unwrap().close().unwrap();
                    count -= 1;
                    if count == 0 {
                        exists = false;
                    }
                }
                Op::Incref(i) if holders[i].is_some() => {
                    holders[i].as_ref().unwrap().incref().unwrap();
                    count += 1;
                }
                // Decref only what this test took beyond the opens, so
                // the count stays at or above the holders' opens.
                Op::Decref(i) if holders[i].is_some() && count > holders.iter().flatten().count() as i32 => {
                    let zero = holders[i].as_ref().unwrap().decref().unwrap();
                    count -= 1;
                    prop_assert_eq!(zero, count == 0);
                }
                _ => {}
            }
            if let Some(h) = holders.iter().flatten().next() {
                prop_assert_eq!(h.refcount().unwrap(), count);
            }
            prop_assert_eq!(shm_exists(&name), exists, "name existence after the step");
        }
        // Dropping the holders closes them: the name goes exactly when the
        // count reaches 0; increfs never given back keep it (as in ATen).
        let left = holders.iter().flatten().count() as i32;
        drop(holders);
        let stays = exists && count - left > 0;
        prop_assert_eq!(shm_exists(&name), stays);
        if stays {
            std::fs::remove_file(format!("/dev/shm{name}")).unwrap();
        }
    }
}
