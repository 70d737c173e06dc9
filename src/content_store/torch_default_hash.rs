//! PyTorch's default (non-stable) content hash of a CPU storage, computed
//! natively: `torch.utils._content_store.hash_storage(s)` without
//! `stable_hash`.
//!
//! PyTorch reseeds the CPU generator with 0, views the bytes (zero-padded
//! to a multiple of 4) as little-endian int32 `x`, and runs a compiled
//! kernel five times. Each run draws two int64 seeds from the generator
//! and, for element `i`, takes Inductor's `randint64_cpu(seed, i, -2^31,
//! 2^31)`: the first word of Philox4x32-10 with key `(seed as u32, 0)`
//! and counter `(i, 0, 0, 0)`, minus 2^31. With `ra`, `rb` the values for
//! the run's two seeds, as int32:
//!
//! ```text
//! a = (|ra| mod (2^31 - 1)) + 1          int32 (|MIN| stays MIN; mod as Python's)
//! b = |rb|                                int32, widened to int64
//! run = XOR over i of int32(a * x_i + b)  products in int64
//! ```
//!
//! The digest is the five results packed as big-endian int32, in hex.
//! Because the generator is reseeded on every call, the ten seeds are
//! constants: the low words of the first ten `randint(-2^63, 2^63 - 1)`
//! draws after `manual_seed(0)` (the high words do not reach the kernel).
//! The elements are independent and XOR is associative, so big storages
//! are hashed on all cores.

use super::fork_aware::hash_pool;
use super::torch_hash_table;
use rayon::prelude::*;

/// The seeds of the five runs, `(a, b)` each.
const SEEDS: [(u32, u32); 5] = [
    (0x97c4_aa2f, 0xd821_ccc0),
    (0xdba2_52fb, 0xd8e5_7d67),
    (0x9fa1_ded3, 0x6266_d6f2),
    (0x4c2b_3a57, 0x0e84_bdd8),
    (0x45cc_cd8c, 0x7a48_42c1),
];

const PHILOX_A: u32 = 0x9E37_79B9;
const PHILOX_B: u32 = 0xBB67_AE85;
const PHILOX_SA: u32 = 0xD251_1F53;
const PHILOX_SB: u32 = 0xCD9E_8D57;

/// Elements per parallel task: a block of the table.
const TASK: usize = torch_hash_table::BLOCK;
/// Words converted at a time for the table's loop.
const WORDS: usize = 4096;

/// The first output word of Philox4x32-10 for counter `(i, 0, 0, 0)` and
/// key `(seed, 0)`.
#[inline(always)]
fn philox_first(seed: u32, i: u32) -> u32 {
    let (mut c0, mut c1, mut c2, mut c3) = (i, 0u32, 0u32, 0u32);
    let (mut k0, mut k1) = (seed, 0u32);
    for round in 0..10 {
        let p0 = u64::from(PHILOX_SA) * u64::from(c0);
        let p1 = u64::from(PHILOX_SB) * u64::from(c2);
        let next0 = ((p1 >> 32) as u32) ^ c1 ^ k0;
        let next2 = ((p0 >> 32) as u32) ^ c3 ^ k1;
        c1 = p1 as u32;
        c3 = p0 as u32;
        c0 = next0;
        c2 = next2;
        if round < 9 {
            k0 = k0.wrapping_add(PHILOX_A);
            k1 = k1.wrapping_add(PHILOX_B);
        }
    }
    c0
}

/// `randint(-2^31, 2^31)` as int32, then `abs` in int32.
#[inline(always)]
fn drawn_abs(seed: u32, i: u32) -> i32 {
    ((philox_first(seed, i) ^ 0x8000_0000) as i32).wrapping_abs()
}

#[inline(always)]
fn mix(seeds: (u32, u32), i: u32, x: i32) -> i32 {
    let a = i64::from(drawn_abs(seeds.0, i).rem_euclid(i32::MAX) + 1);
    let b = i64::from(drawn_abs(seeds.1, i));
    (a * i64::from(x) + b) as i32
}

/// The element `i` of the padded int32 view.
#[inline(always)]
fn element(data: &[u8], i: usize) -> i32 {
    let start = i * 4;
    let mut word = [0u8; 4];
    let end = (start + 4).min(data.len());
    word[..end - start].copy_from_slice(&data[start..end]);
    i32::from_le_bytes(word)
}

/// Elements computed side by side (lanes the compiler vectorizes).
const LANES: usize = 16;

/// The first Philox word for counters `first..first + LANES`, lane by lane.
#[inline(always)]
fn philox_lanes(seed: u32, first: u32) -> [u32; LANES] {
    let mut c0: [u32; LANES] = std::array::from_fn(|l| first.wrapping_add(l as u32));
    let mut c1 = [0u32; LANES];
    let mut c2 = [0u32; LANES];
    let mut c3 = [0u32; LANES];
    let (mut k0, mut k1) = (seed, 0u32);
    for round in 0..10 {
        for l in 0..LANES {
            let p0 = u64::from(PHILOX_SA) * u64::from(c0[l]);
            let p1 = u64::from(PHILOX_SB) * u64::from(c2[l]);
            let next0 = ((p1 >> 32) as u32) ^ c1[l] ^ k0;
            let next2 = ((p0 >> 32) as u32) ^ c3[l] ^ k1;
            c1[l] = p1 as u32;
            c3[l] = p0 as u32;
            c0[l] = next0;
            c2[l] = next2;
        }
        if round < 9 {
            k0 = k0.wrapping_add(PHILOX_A);
            k1 = k1.wrapping_add(PHILOX_B);
        }
    }
    c0
}

#[inline(always)]
fn lanes_body(data: &[u8], first: usize, acc: &mut [i32; 5]) {
    let x: [i64; LANES] = std::array::from_fn(|l| i64::from(element(data, first + l)));
    // The kernel's offset is the index as int32, read as uint32.
    let offset = first as u32;
    for (run, seeds) in SEEDS.iter().enumerate() {
        let ra = philox_lanes(seeds.0, offset);
        let rb = philox_lanes(seeds.1, offset);
        let mut folded = 0i32;
        for l in 0..LANES {
            let a = i64::from(((ra[l] ^ 0x8000_0000) as i32).wrapping_abs().rem_euclid(i32::MAX) + 1);
            let b = i64::from(((rb[l] ^ 0x8000_0000) as i32).wrapping_abs());
            folded ^= (a * x[l] + b) as i32;
        }
        acc[run] ^= folded;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lanes_avx2(data: &[u8], first: usize, count: usize, acc: &mut [i32; 5]) {
    let mut i = first;
    while i + LANES <= first + count {
        lanes_body(data, i, acc);
        i += LANES;
    }
}

fn lanes_plain(data: &[u8], first: usize, count: usize, acc: &mut [i32; 5]) {
    let mut i = first;
    while i + LANES <= first + count {
        lanes_body(data, i, acc);
        i += LANES;
    }
}

/// XOR of the five runs over elements `first..first + count`.
fn runs_over(data: &[u8], first: usize, count: usize) -> [i32; 5] {
    let mut acc = [0i32; 5];
    let whole = count / LANES * LANES;
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            unsafe { lanes_avx2(data, first, whole, &mut acc) };
        } else {
            lanes_plain(data, first, whole, &mut acc);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    lanes_plain(data, first, whole, &mut acc);
    for i in first + whole..first + count {
        let x = element(data, i);
        for (run, seeds) in SEEDS.iter().enumerate() {
            acc[run] ^= mix(*seeds, i as u32, x);
        }
    }
    acc
}

/// The run's multipliers and addends for elements `first..first + LANES`:
/// the low 32 bits of `a` and `b` above.
#[inline(always)]
fn coefficient_lanes(seeds: (u32, u32), first: u32) -> ([u32; LANES], [u32; LANES]) {
    let ra = philox_lanes(seeds.0, first);
    let rb = philox_lanes(seeds.1, first);
    let a = std::array::from_fn(|l| (((ra[l] ^ 0x8000_0000) as i32).wrapping_abs().rem_euclid(i32::MAX) + 1) as u32);
    let b = std::array::from_fn(|l| ((rb[l] ^ 0x8000_0000) as i32).wrapping_abs() as u32);
    (a, b)
}

/// Fills a table block's multipliers `a` and addends `b` of `run` for the
/// elements from `first`.
fn fill_coefficients(first: usize, run: usize, a: &mut [u32], b: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { fill_avx2(first, run, a, b) };
        }
    }
    fill_plain(first, run, a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fill_avx2(first: usize, run: usize, a: &mut [u32], b: &mut [u32]) {
    fill_plain(first, run, a, b)
}

#[inline(always)]
fn fill_plain(first: usize, run: usize, a: &mut [u32], b: &mut [u32]) {
    for (j, (a, b)) in a.chunks_exact_mut(LANES).zip(b.chunks_exact_mut(LANES)).enumerate() {
        // The kernel's offset is the index as int32, read as uint32.
        let (ca, cb) = coefficient_lanes(SEEDS[run], (first + j * LANES) as u32);
        a.copy_from_slice(&ca);
        b.copy_from_slice(&cb);
    }
}

/// [`runs_over`] with the table block of these elements.
fn runs_from_table(data: &[u8], table: &[u32], first: usize, count: usize) -> [i32; 5] {
    let mut acc = [0i32; 5];
    let mut words = [0u32; WORDS];
    let mut done = 0;
    while done < count {
        let k = WORDS.min(count - done);
        let start = (first + done) * 4;
        if start + 4 * k <= data.len() {
            for (w, b) in words[..k].iter_mut().zip(data[start..start + 4 * k].chunks_exact(4)) {
                *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        } else {
            // The last word, zero-padded.
            for (j, w) in words[..k].iter_mut().enumerate() {
                *w = element(data, first + done + j) as u32;
            }
        }
        acc = xor_runs(acc, torch_hash_table::runs_with(table, done, &words[..k]));
        done += k;
    }
    acc
}

fn xor_runs(mut a: [i32; 5], b: [i32; 5]) -> [i32; 5] {
    for (x, y) in a.iter_mut().zip(b) {
        *x ^= y;
    }
    a
}

/// PyTorch's default `hash_storage` of `data`: 40 lowercase hex digits.
pub fn torch_default_hash_hex(data: &[u8]) -> String {
    let n = data.len().div_ceil(4);
    let tasks = n.div_ceil(TASK);
    let task = |t: usize| {
        let (first, count) = (t * TASK, TASK.min(n - t * TASK));
        match torch_hash_table::block(t, fill_coefficients) {
            Some(table) => runs_from_table(data, table, first, count),
            None => runs_over(data, first, count),
        }
    };
    // The content store's own pool (fork-aware): in a forked child, or
    // for one task, the calling thread does it all.
    let pool = if tasks > 1 { hash_pool() } else { None };
    let runs = match pool {
        Some(pool) => pool.install(|| (0..tasks).into_par_iter().map(task).reduce(|| [0i32; 5], xor_runs)),
        None => (0..tasks).map(task).fold([0i32; 5], xor_runs),
    };
    let mut out = String::with_capacity(40);
    for r in runs {
        for byte in r.to_be_bytes() {
            out.push_str(&format!("{byte:02x}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of `torch.utils._content_store.hash_storage` (torch 2.15, CPU).
    #[test]
    fn matches_pytorch() {
        let floats: Vec<u8> = (0..10).flat_map(|v| (v as f32).to_le_bytes()).collect();
        assert_eq!(torch_default_hash_hex(&floats), "cd771c3fc5d83224dbb2cb6b306299cf88bade7f");
        assert_eq!(torch_default_hash_hex(&2i64.to_le_bytes()), "251bcb7d2b3c46c15a4f1ed8baa41a7186845fdb");
    }

    /// Past the table's blocks the values are computed: the digest is
    /// the same either way.
    #[test]
    fn table_and_computed_values_agree_across_the_table_end() {
        let words = torch_hash_table::TABLE_BLOCKS * TASK + 2 * TASK + 1;
        let data: Vec<u8> = (0..words * 4 - 1).map(|i| (i * 13 + i / 1013) as u8).collect();
        let n = data.len().div_ceil(4);
        let serial = (0..n.div_ceil(TASK)).map(|t| runs_over(&data, t * TASK, TASK.min(n - t * TASK))).fold([0i32; 5], xor_runs);
        let want: String = serial.iter().flat_map(|r| r.to_be_bytes()).map(|b| format!("{b:02x}")).collect();
        assert_eq!(torch_default_hash_hex(&data), want);
        // Again, now that the table is filled.
        assert_eq!(torch_default_hash_hex(&data), want);
    }

    #[test]
    fn parallel_split_does_not_change_the_digest() {
        let data: Vec<u8> = (0..(3 * TASK * 4 + 3)).map(|i| (i * 31 + i / 977) as u8).collect();
        let n = data.len().div_ceil(4);
        let serial = runs_over(&data, 0, n);
        let mut want = String::new();
        for r in serial {
            for byte in r.to_be_bytes() {
                want.push_str(&format!("{byte:02x}"));
            }
        }
        assert_eq!(torch_default_hash_hex(&data), want);
    }
}
