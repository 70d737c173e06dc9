//! Content store: three writer processes add tensors (and plain storages)
//! to one store at once, in the native or the PyTorch format, with or
//! without fsync; about a third of each batch has the same content in
//! every writer, so the same storage file is written concurrently. Each
//! batch is one step sent to every writer at once; one writer may be
//! SIGKILLed at any moment of it.
//!
//! After the round (every writer exited or killed): `verify` finds no
//! corrupt object; every tensor and storage a writer acknowledged reads
//! back with its exact metadata and bytes (the victim's acknowledged ones
//! too); with no kill no temporary file is left; `gc` removes the killed
//! writer's temporary files and the unreferenced storages (the plain
//! storages among them), keeps every acknowledged tensor readable, and a
//! second `gc` finds nothing more. The store's folder goes with the round.

use crate::rng::Rng;
use crate::round::{Reply, Round};
use crate::scenario::{err_reply, Cleanup, RoundDir, Scenario};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use storage_sharing::content_store::{gc, hash_hex, verify, Dtype, Format, Reader, Writer};

pub struct ContentStore;

const WRITERS: usize = 3;
const BATCHES: u32 = 4;

/// One tensor a writer writes: all but `content` is the same in every
/// writer for the same batch and index.
struct Spec {
    name: String,
    content: u64,
    dtype: Dtype,
    offset: i64,
    shape: Vec<i64>,
    stride: Vec<i64>,
    nbytes: usize,
}

fn spec(rank: usize, batch: u64, i: u64, bseed: u64) -> Spec {
    let mut g = Rng::new(bseed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xc0de);
    let shared = g.one_in(3);
    let base = g.next_u64();
    let content = if shared { base } else { base ^ (rank as u64 + 1).wrapping_mul(0xff51_afd7_ed55_8ccd) };
    let dtype = [Dtype::UInt8, Dtype::Float32, Dtype::Int64][g.below(3) as usize];
    let item = dtype.itemsize();
    // Now and then past 1 MiB, where the native hash is a tree.
    let numel = if g.one_in(8) { (1 << 20) / item as u64 + g.below(1 << 16) } else { 1 + g.below(16 << 10) } as i64;
    let offset = g.below(8) as i64;
    let (shape, stride) = if numel % 2 == 0 && g.one_in(2) { (vec![2, numel / 2], vec![numel / 2, 1]) } else { (vec![numel], vec![1]) };
    let nbytes = (offset + numel) as usize * item + g.below(item as u64 * 4) as usize;
    Spec { name: format!("w{rank}/b{batch}/t{i}"), content, dtype, offset, shape, stride, nbytes }
}

/// The content of a plain storage writer `rank` adds in `batch`.
fn plain(rank: usize, bseed: u64) -> (usize, u64) {
    let mut g = Rng::new(bseed ^ 0x5707 ^ (rank as u64 + 1) << 40);
    (1 + g.below(32 << 10) as usize, g.next_u64())
}

/// `len` bytes from the seeded generator: distinct seeds give distinct
/// contents (a short pattern would repeat every 256 seeds).
fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut g = Rng::new(seed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&g.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

fn format_of(s: &str) -> Format {
    if s == "torch" {
        Format::Torch
    } else {
        Format::Native
    }
}

/// Temporary files anywhere in the store.
fn temp_files(root: &Path) -> usize {
    let mut n = 0;
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(p);
            } else if e.file_name().to_string_lossy().starts_with(storage_sharing::content_store::names::TEMP_PREFIX) {
                n += 1;
            }
        }
    }
    n
}

impl ContentStore {
    fn check_store(&self, r: &mut Round, root: &Path, format: Format, tensors: &[Spec], plains: &[(usize, u64)]) -> Result<(), String> {
        let fail = |what: &str, e: storage_sharing::Error| format!("{what}: {}", err_reply(&e));
        if !r.fired() {
            let left = temp_files(root);
            if left != 0 {
                return Err(format!("{left} temporary files left in the store with no writer killed"));
            }
        }
        let reader = Reader::open(root).map_err(|e| fail("open the store", e))?;
        let report = verify(&reader, &mut |_, _| {}).map_err(|e| fail("verify", e))?;
        if !report.problems.is_empty() {
            return Err(format!("verify: {} corrupt objects: {:?}", report.problems.len(), report.problems));
        }
        r.count("objects_verified", report.storages + report.tensors);
        self.read_back(r, &reader, tensors)?;
        let mode = format.hash_mode();
        let mut plain_hashes = HashSet::new();
        for &(len, seed) in plains {
            let bytes = content(len, seed);
            let hash = hash_hex(&bytes, mode);
            let s = reader.read_storage(&hash).map_err(|e| fail("read an acknowledged storage", e))?;
            if s.bytes() != bytes.as_slice() {
                return Err(format!("storage {hash} reads back other bytes than were stored"));
            }
            plain_hashes.insert(hash);
            r.count("acked_read_back", 1);
        }
        drop(reader);
        let before = temp_files(root);
        let done = gc(root, false).map_err(|e| fail("gc", e))?;
        if done.temp_files.len() != before {
            return Err(format!("gc removed {} temporary files of the {before} there", done.temp_files.len()));
        }
        r.count("temp_files_removed", before as u64);
        let removed: HashSet<&str> = done.storages.iter().map(|(h, _)| h.as_str()).collect();
        if let Some(h) = plain_hashes.iter().find(|h| !removed.contains(h.as_str())) {
            return Err(format!("gc kept storage {h}, which no tensor names"));
        }
        r.count("unreferenced_storages_removed", done.storages.len() as u64);
        let again = gc(root, true).map_err(|e| fail("second gc", e))?;
        if !again.temp_files.is_empty() || !again.storages.is_empty() {
            return Err(format!(
                "a second gc still finds {} temporary files and {} storages",
                again.temp_files.len(),
                again.storages.len()
            ));
        }
        // gc removed nothing a tensor needs.
        let reader = Reader::open(root).map_err(|e| fail("reopen the store", e))?;
        let report = verify(&reader, &mut |_, _| {}).map_err(|e| fail("verify after gc", e))?;
        if !report.problems.is_empty() {
            return Err(format!("verify after gc: {:?}", report.problems));
        }
        self.read_back(r, &reader, tensors)
    }

    fn read_back(&self, r: &mut Round, reader: &Reader, tensors: &[Spec]) -> Result<(), String> {
        for s in tensors {
            let t = reader.read_tensor(&s.name).map_err(|e| format!("acknowledged tensor {}: {}", s.name, err_reply(&e)))?;
            let m = &t.meta;
            if (m.dtype, m.offset, &m.shape, &m.stride) != (s.dtype, s.offset, &s.shape, &s.stride) {
                return Err(format!("tensor {} reads back as {m:?}", s.name));
            }
            if t.storage.bytes() != content(s.nbytes, s.content).as_slice() {
                return Err(format!("tensor {}: its storage reads back other bytes than were stored", s.name));
            }
            r.count("acked_read_back", 1);
        }
        Ok(())
    }
}

impl Scenario for ContentStore {
    fn name(&self) -> &'static str {
        "content_store"
    }
    fn max_steps(&self) -> u32 {
        // open + batches, and one more: about one round in six has no kill.
        1 + BATCHES + 1
    }
    fn cleanup(&self) -> Cleanup {
        Cleanup::Immediate
    }

    fn run(&self, r: &mut Round) -> Result<(), String> {
        let format = if r.rng.one_in(4) { "torch" } else { "native" };
        let durable = r.rng.one_in(2);
        let dir = RoundDir::new(self.name(), &r.tag)?;
        let root = dir.0.join("store");
        let root_arg = root.to_string_lossy().into_owned();
        let ws: Vec<usize> = (0..WRITERS).map(|w| r.spawn(self.name(), "writer", &[root_arg.clone(), w.to_string()], None)).collect();
        r.count(if durable { "rounds_durable" } else { "rounds_no_fsync" }, 1);
        r.count(if format == "torch" { "rounds_torch_format" } else { "rounds_native_format" }, 1);
        let ok_or_killed = |r: &Round, what: &str, replies: &[Reply]| -> Result<Vec<bool>, String> {
            replies
                .iter()
                .enumerate()
                .map(|(w, reply)| match reply {
                    Reply::Line(l) if l == "ok" => Ok(true),
                    Reply::Line(l) => {
                        Err(format!("writer {w}: {what} answered <{l}>{}", if r.fired() { " (a writer was killed)" } else { "" }))
                    }
                    Reply::Killed => Ok(false),
                })
                .collect()
        };
        let replies = r.collective(&ws, |_| format!("open {format} {}", u8::from(durable)))?;
        ok_or_killed(r, "open", &replies)?;
        let mut tensors = Vec::new();
        let mut plains = Vec::new();
        for batch in 0..BATCHES as u64 {
            let live: Vec<usize> = ws.iter().copied().filter(|&w| r.alive(w)).collect();
            let k = 2 + r.rng.below(5);
            let bseed = r.rng.next_u64();
            let replies = r.collective(&live, |_| format!("write {batch} {k} {bseed}"))?;
            for (n, acked) in ok_or_killed(r, "write", &replies)?.into_iter().enumerate() {
                if acked {
                    let w = live[n];
                    tensors.extend((0..k).map(|i| spec(w, batch, i, bseed)));
                    plains.push(plain(w, bseed));
                }
            }
        }
        r.finish()?;
        self.check_store(r, &root, format_of(format), &tensors, &plains)
    }

    fn participant(&self, _role: &str, args: &[String]) -> i32 {
        let root = PathBuf::from(&args[0]);
        let rank: usize = args[1].parse().unwrap();
        let mut writer: Option<Writer> = None;
        crate::round::serve(|w| match w {
            ["open", format, durable] => match Writer::open(&root, format_of(format)) {
                Ok(wr) => {
                    wr.set_durable(*durable == "1");
                    writer = Some(wr);
                    "ok".into()
                }
                Err(e) => err_reply(&e),
            },
            ["write", batch, k, bseed] => {
                let wr = writer.as_ref().unwrap();
                let (batch, k, bseed): (u64, u64, u64) = (batch.parse().unwrap(), k.parse().unwrap(), bseed.parse().unwrap());
                for i in 0..k {
                    let s = spec(rank, batch, i, bseed);
                    if let Err(e) = wr.write_tensor(&s.name, &content(s.nbytes, s.content), s.dtype, s.offset, &s.shape, &s.stride) {
                        return err_reply(&e);
                    }
                }
                let (len, seed) = plain(rank, bseed);
                wr.write_storage(&content(len, seed)).map_or_else(|e| err_reply(&e), |_| "ok".into())
            }
            _ => format!("unknown command {w:?}"),
        })
    }
}
