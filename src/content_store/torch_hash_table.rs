//! The multipliers and addends of PyTorch's default hash, kept after
//! their first use. They depend on the element's index only (the
//! generator is reseeded on every call), so every storage reuses them:
//! with the table, an element costs five multiply-adds instead of ten
//! Philox evaluations.
//!
//! The table covers the first [`TABLE_BLOCKS`] blocks of elements and is
//! filled block by block as storages reach them (40 bytes an element:
//! 160 MiB when a storage of 16 MiB or more has been hashed). In a child
//! made by fork(), blocks the parent had filled are used and no block is
//! filled (a parent thread may have been filling one at the fork).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// Blocks of [`BLOCK`] elements the table may hold.
pub const TABLE_BLOCKS: usize = 64;
/// Elements a block: one parallel task of the hash.
pub const BLOCK: usize = 1 << 16;
/// Runs of the hash; each has a multiplier and an addend an element.
const RUNS: usize = 5;

/// Block `t`: for run `r`, the multipliers at `[2r * BLOCK ..]` and the
/// addends at `[(2r + 1) * BLOCK ..]`, as the low 32 bits (all the int32
/// result keeps).
static TABLE: [OnceLock<Box<[u32]>>; TABLE_BLOCKS] = [const { OnceLock::new() }; TABLE_BLOCKS];
/// The process that fills the table; 0 before any.
static OWNER: AtomicU32 = AtomicU32::new(0);

/// Block `t` of the table, filled by `fill(first_index, run, a, b)` (one
/// call a run, `a` and `b` [`BLOCK`] long) if this process may fill it;
/// `None` past the table or in a forked child without the block.
pub fn block(t: usize, fill: impl Fn(usize, usize, &mut [u32], &mut [u32])) -> Option<&'static [u32]> {
    let cell = TABLE.get(t)?;
    let me = std::process::id();
    let owner = match OWNER.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => me,
        Err(owner) => owner,
    };
    if owner != me {
        return cell.get().map(|b| &b[..]);
    }
    Some(cell.get_or_init(|| {
        let mut table = vec![0u32; 2 * RUNS * BLOCK].into_boxed_slice();
        for (run, pair) in table.chunks_exact_mut(2 * BLOCK).enumerate() {
            let (a, b) = pair.split_at_mut(BLOCK);
            fill(t * BLOCK, run, a, b);
        }
        table
    }))
}

/// XOR over the words of `x` of `a * x + b` (wrapping, 32 bits) for
/// each run, with the table block's values from index `at` in the block.
pub fn runs_with(table: &[u32], at: usize, x: &[u32]) -> [i32; RUNS] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { runs_with_avx2(table, at, x) };
        }
    }
    runs_with_plain(table, at, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn runs_with_avx2(table: &[u32], at: usize, x: &[u32]) -> [i32; RUNS] {
    runs_with_plain(table, at, x)
}

#[inline(always)]
fn runs_with_plain(table: &[u32], at: usize, x: &[u32]) -> [i32; RUNS] {
    std::array::from_fn(|run| {
        let a = &table[2 * run * BLOCK + at..][..x.len()];
        let b = &table[(2 * run + 1) * BLOCK + at..][..x.len()];
        let mut folded = 0u32;
        for ((a, b), x) in a.iter().zip(b).zip(x) {
            folded ^= a.wrapping_mul(*x).wrapping_add(*b);
        }
        folded as i32
    })
}
