//! The CPU collectives across real processes when the ranks disagree:
//! different sizes, dtypes, ops, roots or calls, or a rank that refuses its
//! own arguments. Every rank must fail with an error naming the ranks and
//! what each passed, before any data moves, and the next matched call must
//! work. Each rank is this test binary run again (`child_role`), meeting
//! through a file store in the test's own folder.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/symm_ranks.rs"]
mod symm_ranks;

use common::my_role;
use std::path::Path;
use std::process::Output;
use std::time::Duration;
use storage_sharing::symm::cpu_collectives::{CpuCollectives, Items};
use storage_sharing::symm::reduce::{Elem, ReduceOp};
use storage_sharing::symm::{self, DeviceType};
use storage_sharing::{Error, ErrorKind};
use symm_ranks::{finish, rank_command, sockets_left, test_dir, Rank};

/// Hang guard only: a healthy call takes microseconds.
const WAIT: Option<Duration> = Some(Duration::from_secs(30));

fn run_ranks(role: &str, ws: usize) -> Vec<(usize, Output)> {
    let dir = test_dir("ss-symm-coll", &format!("{role}{ws}"));
    let children = (0..ws).map(|r| (r, rank_command(role, &dir, r, ws, &[]).spawn().expect("spawn rank"))).collect();
    let outs = finish(children);
    for (r, o) in &outs {
        assert!(
            o.status.success(),
            "rank {r} failed: {}\nstdout:\n{}\nstderr:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let said = String::from_utf8_lossy(&o.stdout);
        assert!(said.contains(&format!("rank {r} ok")), "rank {r} did not run its role:\n{said}");
    }
    assert!(sockets_left(&dir).is_empty(), "sockets left in {}", dir.display());
    remove(&dir);
    outs
}

fn remove(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------- children

/// The collectives over a fresh scratch block of group `name`.
fn collectives(name: &str) -> CpuCollectives {
    let p = symm::alloc(DeviceType::Cpu, 0, CpuCollectives::block_size_for(4096), Some(name)).unwrap();
    CpuCollectives::new(symm::rendezvous(p, None, WAIT).unwrap())
}

fn bytes_of<T>(v: &mut [T]) -> *mut u8 {
    v.as_mut_ptr() as *mut u8
}

/// A matched all_reduce, broadcast and all_gather after a failed call:
/// the group is still in step and the data is right.
fn still_works(c: &CpuCollectives, me: &Rank, after: &str) {
    let (r, ws) = (me.rank, me.ws);
    let mut v = vec![r as i32 + 1; 5];
    // SAFETY (every call in this file): the pointers are this rank's own
    // vectors, of the sizes passed, alive for the call.
    unsafe { c.all_reduce(bytes_of(&mut v), bytes_of(&mut v), 5, Elem::I32, ReduceOp::Sum, WAIT) }.unwrap();
    assert_eq!(v, vec![(ws * (ws + 1) / 2) as i32; 5], "all_reduce after {after}");
    let mut b = vec![r as u16; 3];
    unsafe { c.broadcast(ws - 1, bytes_of(&mut b), Items { dtype: "int16", numel: 3, itemsize: 2 }, WAIT) }.unwrap();
    assert_eq!(b, vec![ws as u16 - 1; 3], "broadcast after {after}");
    let mut input = [r as f64; 2];
    let mut outs: Vec<[f64; 2]> = vec![[-1.0; 2]; ws];
    let ptrs: Vec<*mut u8> = outs.iter_mut().map(|o| o.as_mut_ptr() as *mut u8).collect();
    unsafe { c.all_gather(bytes_of(&mut input), Items { dtype: "float64", numel: 2, itemsize: 8 }, &ptrs, None, WAIT) }.unwrap();
    assert_eq!(outs, (0..ws).map(|p| [p as f64; 2]).collect::<Vec<_>>(), "all_gather after {after}");
}

/// Asserts the error of a mismatched call names what it must.
fn assert_names(e: &Error, kind: ErrorKind, parts: &[&str]) {
    assert_eq!(e.kind(), kind, "{}", e.message());
    for p in parts {
        assert!(e.message().contains(p), "{:?} not in: {}", p, e.message());
    }
}

/// all_reduce where the last rank passes another size, dtype or op, or
/// makes another call: every rank fails alike, its tensor untouched.
fn role_reduce_mismatches(me: Rank) {
    me.join("world");
    let c = collectives("world");
    let last = me.ws - 1;
    let odd = me.rank == last;
    let other = format!("rank {last} passed");

    let mut v = vec![1.0f32; 6];
    let n = if odd { 6 } else { 4 };
    let e = unsafe { c.all_reduce(bytes_of(&mut v), bytes_of(&mut v), n, Elem::F32, ReduceOp::Sum, WAIT) }.unwrap_err();
    assert_names(
        &e,
        ErrorKind::SizeMismatch,
        &["rank 0 passed all_reduce of 4 float32 elements (4 bytes each) with op sum", &format!("{other} all_reduce of 6 float32")],
    );
    assert_eq!(v, vec![1.0; 6], "no data moved");
    still_works(&c, &me, "a size mismatch");

    let mut w = vec![1.0f64; 4];
    let e = if odd {
        unsafe { c.all_reduce(bytes_of(&mut w), bytes_of(&mut w), 4, Elem::F64, ReduceOp::Sum, WAIT) }
    } else {
        unsafe { c.all_reduce(bytes_of(&mut v), bytes_of(&mut v), 4, Elem::F32, ReduceOp::Sum, WAIT) }
    }
    .unwrap_err();
    assert_names(
        &e,
        ErrorKind::SizeMismatch,
        &["4 float32 elements (4 bytes each)", &format!("{other} all_reduce of 4 float64 elements (8 bytes each)")],
    );
    assert_eq!((v.clone(), w.clone()), (vec![1.0; 6], vec![1.0; 4]), "no data moved");
    still_works(&c, &me, "a dtype mismatch");

    let op = if odd { ReduceOp::Max } else { ReduceOp::Sum };
    let e = unsafe { c.all_reduce(bytes_of(&mut v), bytes_of(&mut v), 4, Elem::F32, op, WAIT) }.unwrap_err();
    assert_names(&e, ErrorKind::InvalidArgument, &["with op sum but", "with op max"]);
    still_works(&c, &me, "an op mismatch");

    // A call that does not fit the scratch is refused on its rank and
    // fails every other rank too.
    let big = c.capacity() / 4 + 1;
    let mut huge = vec![0.0f32; big];
    let e = if odd {
        unsafe { c.all_reduce(bytes_of(&mut huge), bytes_of(&mut huge), big, Elem::F32, ReduceOp::Sum, WAIT) }
    } else {
        unsafe { c.all_reduce(bytes_of(&mut v), bytes_of(&mut v), 4, Elem::F32, ReduceOp::Sum, WAIT) }
    }
    .unwrap_err();
    if odd {
        assert_names(&e, ErrorKind::InvalidArgument, &["does not fit the"]);
    } else {
        assert_names(&e, ErrorKind::InvalidArgument, &[&format!("rank(s) {last} refused their own arguments")]);
    }
    still_works(&c, &me, "a refusal");
    println!("rank {} ok", me.rank);
}

/// broadcast and all_gather mismatches, and calls of different kinds.
fn role_copy_mismatches(me: Rank) {
    me.join("world");
    let c = collectives("world");
    let last = me.ws - 1;
    let odd = me.rank == last;
    let f32s = |numel| Items { dtype: "float32", numel, itemsize: 4 };

    let mut v = vec![me.rank as f32; 6];
    let e = unsafe { c.broadcast(0, bytes_of(&mut v), f32s(if odd { 6 } else { 4 }), WAIT) }.unwrap_err();
    assert_names(
        &e,
        ErrorKind::SizeMismatch,
        &["rank 0 passed broadcast of 4 float32", &format!("rank {last} passed broadcast of 6 float32")],
    );
    assert_eq!(v, vec![me.rank as f32; 6], "no data moved");
    still_works(&c, &me, "a broadcast size mismatch");

    let e = unsafe { c.broadcast(if odd { 1 } else { 0 }, bytes_of(&mut v), f32s(4), WAIT) }.unwrap_err();
    assert_names(&e, ErrorKind::InvalidArgument, &["from rank 0 but", "from rank 1"]);
    assert_eq!(v, vec![me.rank as f32; 6], "no data moved");
    still_works(&c, &me, "a root mismatch");

    let mut input = vec![me.rank as u8; 6];
    let mut outs = vec![vec![99u8; 6]; me.ws];
    let ptrs: Vec<*mut u8> = outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
    let items = Items { dtype: if odd { "int8" } else { "uint8" }, numel: 6, itemsize: 1 };
    let e = unsafe { c.all_gather(bytes_of(&mut input), items, &ptrs, None, WAIT) }.unwrap_err();
    assert_names(
        &e,
        ErrorKind::SizeMismatch,
        &["rank 0 passed all_gather of 6 uint8", &format!("rank {last} passed all_gather of 6 int8")],
    );
    for (p, o) in outs.iter().enumerate().filter(|&(p, _)| p != me.rank) {
        assert_eq!(o, &vec![99u8; 6], "output {p} untouched");
    }
    still_works(&c, &me, "a dtype mismatch");

    let e = unsafe {
        c.all_gather(bytes_of(&mut input), Items { dtype: "uint8", numel: if odd { 4 } else { 6 }, itemsize: 1 }, &ptrs, None, WAIT)
    }
    .unwrap_err();
    assert_names(&e, ErrorKind::SizeMismatch, &["all_gather of 6 uint8", &format!("rank {last} passed all_gather of 4 uint8")]);
    still_works(&c, &me, "a gather size mismatch");

    // The last rank calls another collective.
    let e = if odd {
        unsafe { c.broadcast(0, bytes_of(&mut v), f32s(4), WAIT) }
    } else {
        unsafe { c.all_reduce(bytes_of(&mut v), bytes_of(&mut v), 4, Elem::F32, ReduceOp::Sum, WAIT) }
    }
    .unwrap_err();
    assert_names(
        &e,
        ErrorKind::InvalidArgument,
        &["rank 0 passed all_reduce of 4 float32", &format!("rank {last} passed broadcast of 4 float32")],
    );
    still_works(&c, &me, "another call");
    let e = if odd {
        c.barrier(WAIT)
    } else {
        unsafe { c.all_gather(bytes_of(&mut input), Items { dtype: "uint8", numel: 6, itemsize: 1 }, &ptrs, None, WAIT) }.map(drop)
    }
    .unwrap_err();
    assert_names(&e, ErrorKind::InvalidArgument, &[&format!("rank {last} passed barrier")]);
    still_works(&c, &me, "a barrier among gathers");

    // The last rank refuses its own arguments: a root outside the group,
    // then too few outputs.
    let e = unsafe { c.broadcast(if odd { me.ws } else { 0 }, bytes_of(&mut v), f32s(4), WAIT) }.unwrap_err();
    let refused = format!("rank(s) {last} refused their own arguments");
    assert_names(&e, ErrorKind::InvalidArgument, &[if odd { "is not in a group of" } else { &refused }]);
    let e = unsafe {
        c.all_gather(
            bytes_of(&mut input),
            Items { dtype: "uint8", numel: 6, itemsize: 1 },
            &ptrs[..if odd { 1 } else { me.ws }],
            None,
            WAIT,
        )
    }
    .unwrap_err();
    assert_names(&e, ErrorKind::InvalidArgument, &[if odd { "outputs for" } else { &refused }]);
    still_works(&c, &me, "refusals");
    println!("rank {} ok", me.rank);
}

/// Through the C API, a rendezvous of blocks of different sizes is a
/// status on every rank, with a message naming both ranks' sizes.
fn role_c_api_size_mismatch(me: Rank) {
    use std::ffi::{c_void, CStr, CString};
    use storage_sharing::ffi::ss_status::*;
    use storage_sharing::ffi::symm::*;
    let dir = CString::new(me.dir.join("store").to_str().unwrap()).unwrap();
    let mut store = std::ptr::null_mut();
    // SAFETY: valid strings and out-pointers to locals.
    unsafe {
        assert_eq!(storage_sharing::ffi::store::ss_store_file_open(dir.as_ptr(), &mut store), SS_OK);
        assert_eq!(ss_symm_set_group_info(c"capi".as_ptr(), me.rank as i32, me.ws as i32, store), SS_OK);
        storage_sharing::ffi::store::ss_store_free(store);
        let mut p: *mut c_void = std::ptr::null_mut();
        assert_eq!(ss_symm_alloc(SS_DEVICE_CPU, 0, 4096 * (me.rank + 1), c"capi".as_ptr(), &mut p), SS_OK);
        let mut h = std::ptr::null();
        assert_eq!(ss_symm_mem_rendezvous(p, std::ptr::null(), 30_000, &mut h), SS_ERR_SIZE_MISMATCH);
        let msg = CStr::from_ptr(storage_sharing::ffi::errors::ss_last_error_message()).to_string_lossy().into_owned();
        assert!(msg.contains("rank 1 allocated 8192 bytes") && msg.contains("rank 0 allocated 4096 bytes"), "{msg}");
        assert!(h.is_null());
        assert_eq!(ss_symm_free(p), SS_OK);
    }
    println!("rank {} ok", me.rank);
}

#[test]
#[ignore]
fn child_role() {
    let Some((role, args)) = my_role() else { return };
    let me = Rank::from_args(args);
    match role.as_str() {
        "reduce_mismatches" => role_reduce_mismatches(me),
        "copy_mismatches" => role_copy_mismatches(me),
        "c_api_size_mismatch" => role_c_api_size_mismatch(me),
        other => panic!("unknown role {other}"),
    }
}

// ------------------------------------------------------------------- tests

#[test]
fn all_reduce_mismatches_fail_every_rank_and_the_group_goes_on() {
    run_ranks("reduce_mismatches", 2);
}

#[test]
fn all_reduce_mismatches_on_one_of_three_ranks_fail_all_three() {
    run_ranks("reduce_mismatches", 3);
}

#[test]
fn broadcast_and_all_gather_mismatches_fail_every_rank_and_the_group_goes_on() {
    run_ranks("copy_mismatches", 2);
}

#[test]
fn broadcast_and_all_gather_mismatches_on_one_of_three_ranks_fail_all_three() {
    run_ranks("copy_mismatches", 3);
}

#[test]
fn c_api_rendezvous_of_different_sizes_is_a_size_mismatch_status() {
    run_ranks("c_api_size_mismatch", 2);
}
