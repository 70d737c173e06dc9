//! Element-wise reductions of several equal-length byte ranges into one,
//! for the CPU collectives. Each destination element is the reduction of
//! the sources' elements at its index, computed in a small accumulator on
//! the stack so the loops are plain slice loops the compiler vectorizes
//! (with AVX2 where the CPU has it). 16-bit floats accumulate in f32 and
//! round once at the end; integers wrap, as PyTorch's do.

use crate::error::{Error, ErrorKind, Result};

/// The element types the CPU collectives reduce natively.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F64,
    F16,
    BF16,
    I8,
    U8,
    I16,
    I32,
    I64,
}

impl Elem {
    /// The type of a PyTorch dtype name (`"float32"`, `"bfloat16"`, ...).
    pub fn from_name(name: &str) -> Result<Elem> {
        Ok(match name {
            "float32" | "float" => Elem::F32,
            "float64" | "double" => Elem::F64,
            "float16" | "half" => Elem::F16,
            "bfloat16" => Elem::BF16,
            "int8" => Elem::I8,
            "uint8" => Elem::U8,
            "int16" | "short" => Elem::I16,
            "int32" | "int" => Elem::I32,
            "int64" | "long" => Elem::I64,
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("no native reduction for dtype {other} (float32/64, float16, bfloat16, int8/16/32/64, uint8)"),
                ))
            }
        })
    }

    /// The PyTorch dtype name (without `torch.`).
    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "float32",
            Elem::F64 => "float64",
            Elem::F16 => "float16",
            Elem::BF16 => "bfloat16",
            Elem::I8 => "int8",
            Elem::U8 => "uint8",
            Elem::I16 => "int16",
            Elem::I32 => "int32",
            Elem::I64 => "int64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::I8 | Elem::U8 => 1,
            Elem::F16 | Elem::BF16 | Elem::I16 => 2,
            Elem::F32 | Elem::I32 => 4,
            Elem::F64 | Elem::I64 => 8,
        }
    }
}

/// How elements combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    Product,
}

impl ReduceOp {
    /// The op of a name as `torch.distributed.ReduceOp` spells it (any case).
    pub fn from_name(name: &str) -> Result<ReduceOp> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "max" => ReduceOp::Max,
            "min" => ReduceOp::Min,
            "product" | "prod" => ReduceOp::Product,
            other => return Err(Error::new(ErrorKind::InvalidArgument, format!("unsupported reduce op {other} (sum, max, min, product)"))),
        })
    }
}

/// Elements reduced per round: the accumulator stays in L1.
const CHUNK: usize = 1024;

/// An accumulator type and its four operations (max/min keep a NaN, as
/// `torch.maximum` does).
trait Acc: Copy + Default {
    fn sum(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
}

macro_rules! float_acc {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            #[allow(clippy::eq_op)]
            fn max(a: Self, b: Self) -> Self {
                // b != b: b is NaN; a NaN in a is kept because b > a fails.
                if b > a || b != b {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            #[allow(clippy::eq_op)]
            fn min(a: Self, b: Self) -> Self {
                if b < a || b != b {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                a * b
            }
        }
    };
}
float_acc!(f32);
float_acc!(f64);

macro_rules! int_acc {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
        }
    )*};
}
int_acc!(i8, u8, i16, i32, i64);

/// A stored element type and how it widens to its accumulator.
trait Lane: Copy {
    type A: Acc;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
}

macro_rules! same_lane {
    ($($t:ty),*) => {$(
        impl Lane for $t {
            type A = $t;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(a: $t) -> $t {
                a
            }
        }
    )*};
}
same_lane!(f32, f64, i8, u8, i16, i32, i64);

/// bfloat16 bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct Bf16(u16);

impl Lane for Bf16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    #[inline(always)]
    fn store(a: f32) -> Bf16 {
        Bf16(f32_to_bf16(a))
    }
}

/// Rounds to nearest even; a NaN stays a (quiet) NaN.
#[inline(always)]
fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// IEEE half bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct F16(u16);

impl Lane for F16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        f16_to_f32(self.0)
    }
    #[inline(always)]
    fn store(a: f32) -> F16 {
        F16(f32_to_f16(a))
    }
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value m * 2^-24, exact in f32.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Rounds to nearest even, overflowing to infinity; a NaN stays a NaN.
fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let abs = b & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return sign | 0x7e00 | ((abs >> 13) & 0x3ff) as u16;
    }
    if abs >= 0x4780_0000 {
        // >= 65536 (or infinity): past the largest half after rounding.
        return sign | 0x7c00;
    }
    if abs < 0x3880_0000 {
        // Below the smallest normal half (2^-14): a subnormal or zero,
        // rounded by adding in a float whose ulp is the half's 2^-24.
        let v = f32::from_bits(abs) + 0.5;
        return sign | (v.to_bits() - 0.5f32.to_bits()) as u16;
    }
    // Normal: rebias the exponent and round the 13 dropped bits to even.
    let rebased = abs - (112 << 23);
    let rounded = rebased + 0xfff + ((rebased >> 13) & 1);
    sign | (rounded >> 13) as u16
}

/// `dsts[..] = op(srcs[0], srcs[1], ...)` element by element over `n`
/// elements of `L`.
///
/// # Safety
/// Every source holds `n` readable elements of `L` and every destination
/// `n` writable ones (any alignment); nobody else writes them meanwhile. A
/// destination may be a source (element i is read from every source before
/// it is written).
#[inline(always)]
unsafe fn reduce_lanes<L: Lane>(dsts: &[*mut u8], srcs: &[*const u8], n: usize, op: ReduceOp) {
    match op {
        ReduceOp::Sum => reduce_with::<L>(dsts, srcs, n, <L::A as Acc>::sum),
        ReduceOp::Max => reduce_with::<L>(dsts, srcs, n, <L::A as Acc>::max),
        ReduceOp::Min => reduce_with::<L>(dsts, srcs, n, <L::A as Acc>::min),
        ReduceOp::Product => reduce_with::<L>(dsts, srcs, n, <L::A as Acc>::prod),
    }
}

#[inline(always)]
unsafe fn reduce_with<L: Lane>(dsts: &[*mut u8], srcs: &[*const u8], n: usize, f: impl Fn(L::A, L::A) -> L::A + Copy) {
    let size = std::mem::size_of::<L>();
    let mut acc = [L::A::default(); CHUNK];
    let mut done = 0;
    while done < n {
        let len = CHUNK.min(n - done);
        let acc = &mut acc[..len];
        // Unaligned reads: a user tensor may start anywhere.
        let first = srcs[0].add(done * size) as *const L;
        for (i, a) in acc.iter_mut().enumerate() {
            *a = first.add(i).read_unaligned().load();
        }
        for src in &srcs[1..] {
            let s = src.add(done * size) as *const L;
            for (i, a) in acc.iter_mut().enumerate() {
                *a = f(*a, s.add(i).read_unaligned().load());
            }
        }
        for dst in dsts {
            let d = dst.add(done * size) as *mut L;
            for (i, a) in acc.iter().enumerate() {
                d.add(i).write_unaligned(L::store(*a));
            }
        }
        done += len;
    }
}

#[inline(always)]
unsafe fn reduce_any(dsts: &[*mut u8], srcs: &[*const u8], n: usize, elem: Elem, op: ReduceOp) {
    match elem {
        Elem::F32 => reduce_lanes::<f32>(dsts, srcs, n, op),
        Elem::F64 => reduce_lanes::<f64>(dsts, srcs, n, op),
        Elem::F16 => reduce_lanes::<F16>(dsts, srcs, n, op),
        Elem::BF16 => reduce_lanes::<Bf16>(dsts, srcs, n, op),
        Elem::I8 => reduce_lanes::<i8>(dsts, srcs, n, op),
        Elem::U8 => reduce_lanes::<u8>(dsts, srcs, n, op),
        Elem::I16 => reduce_lanes::<i16>(dsts, srcs, n, op),
        Elem::I32 => reduce_lanes::<i32>(dsts, srcs, n, op),
        Elem::I64 => reduce_lanes::<i64>(dsts, srcs, n, op),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_avx2(dsts: &[*mut u8], srcs: &[*const u8], n: usize, elem: Elem, op: ReduceOp) {
    reduce_any(dsts, srcs, n, elem, op)
}

unsafe fn reduce_baseline(dsts: &[*mut u8], srcs: &[*const u8], n: usize, elem: Elem, op: ReduceOp) {
    reduce_any(dsts, srcs, n, elem, op)
}

/// Writes into every destination the element-wise `op` of the sources
/// (`n` elements of `elem` each); does nothing without a source.
///
/// # Safety
/// Every source points at `n * elem.size()` readable bytes and every
/// destination at as many writable bytes, which nobody else writes during
/// the call. A destination may be exactly a source, never partly overlap one.
pub unsafe fn reduce(dsts: &[*mut u8], srcs: &[*const u8], n: usize, elem: Elem, op: ReduceOp) {
    if srcs.is_empty() || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        return reduce_avx2(dsts, srcs, n, elem, op);
    }
    reduce_baseline(dsts, srcs, n, elem, op)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Copy + Default>(elem: Elem, op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
        let n = inputs[0].len();
        let mut out = vec![T::default(); n];
        let srcs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr() as *const u8).collect();
        // SAFETY: every vector holds n elements of the type `elem` names.
        unsafe { reduce(&[out.as_mut_ptr() as *mut u8], &srcs, n, elem, op) };
        out
    }

    #[test]
    fn sums_past_a_chunk_with_an_odd_tail() {
        let n = CHUNK * 2 + 7;
        let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| 2.0 * i as f32).collect();
        let c: Vec<f32> = vec![1.0; n];
        let out = run(Elem::F32, ReduceOp::Sum, &[a, b, c]);
        assert!(out.iter().enumerate().all(|(i, &x)| x == 3.0 * i as f32 + 1.0));
    }

    #[test]
    fn max_and_min_keep_nan() {
        let a = vec![1.0f64, f64::NAN, 3.0];
        let b = vec![f64::NAN, 2.0, -1.0];
        let mx = run(Elem::F64, ReduceOp::Max, &[a.clone(), b.clone()]);
        assert!(mx[0].is_nan() && mx[1].is_nan() && mx[2] == 3.0);
        let mn = run(Elem::F64, ReduceOp::Min, &[a, b]);
        assert!(mn[0].is_nan() && mn[1].is_nan() && mn[2] == -1.0);
    }

    #[test]
    fn integers_wrap() {
        let out = run(Elem::I8, ReduceOp::Sum, &[vec![100i8, -100], vec![100, -100]]);
        assert_eq!(out, vec![-56, 56]);
        let out = run(Elem::I64, ReduceOp::Product, &[vec![3i64, i64::MAX], vec![-4, 2]]);
        assert_eq!(out, vec![-12, -2]);
    }

    #[test]
    fn destination_may_be_a_source() {
        let mut a = vec![1i32, 2, 3];
        let b = [10i32, 20, 30];
        let p = a.as_mut_ptr() as *mut u8;
        // SAFETY: both hold 3 i32; the destination is exactly source 0.
        unsafe { reduce(&[p], &[p, b.as_ptr() as *const u8], 3, Elem::I32, ReduceOp::Sum) };
        assert_eq!(a, vec![11, 22, 33]);
    }

    #[test]
    fn half_conversions_round_trip_every_value() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
            } else {
                assert_eq!(f32_to_f16(f), h, "half {h:#06x} = {f}");
            }
        }
        for h in 0..=u16::MAX {
            let f = f32::from_bits((h as u32) << 16);
            if !f.is_nan() {
                assert_eq!(f32_to_bf16(f), h);
            }
        }
    }

    #[test]
    fn half_rounding_is_to_nearest_even() {
        // 1 + 2^-11 lies halfway between 1 and the next half: rounds to 1.
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        // 1 + 3 * 2^-11 lies halfway between two halves: rounds up to even.
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds past 65504: infinity
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0); // halfway to the smallest subnormal: even
        assert_eq!(f32_to_f16(1.5 * 2f32.powi(-24)), 2); // halfway between 1 and 2 ulps: even
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    }

    #[test]
    fn names_parse_and_unknown_ones_are_named() {
        assert_eq!(Elem::from_name("bfloat16").unwrap(), Elem::BF16);
        assert_eq!(ReduceOp::from_name("PRODUCT").unwrap(), ReduceOp::Product);
        assert!(Elem::from_name("complex64").unwrap_err().message().contains("complex64"));
        assert!(ReduceOp::from_name("avg").unwrap_err().message().contains("avg"));
    }
}
