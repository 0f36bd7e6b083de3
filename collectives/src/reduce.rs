//! Reduction operations ([`ReduceOp`]) and their kernels: one loop per type and
//! operation, chosen once per call (never per element), written so that the compiler
//! vectorises them, for the widest instruction set the processor has (chosen at run
//! time); `f16` is widened to `f32` in blocks (by the processor's F16C
//! instructions where it has them), `bf16` element by element in one pass; both are
//! rounded back to nearest even.

use std::fmt;

use half::{bf16, f16, slice::HalfFloatSliceExt};

/// How values from different ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (integers wrap on overflow).
    Sum,
    /// Product (integers wrap on overflow).
    Prod,
    /// Minimum. For floats a NaN on either side gives a NaN, so the result is the same
    /// whichever order ranks combine in.
    Min,
    /// Maximum; NaNs as for [`ReduceOp::Min`].
    Max,
    /// Bitwise and (integers only).
    Band,
    /// Bitwise or (integers only).
    Bor,
    /// Bitwise exclusive or (integers only).
    Bxor,
}

impl ReduceOp {
    /// Every operation.
    pub const ALL: [ReduceOp; 7] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
    ];

    /// Whether it is one of the bitwise operations, which apply to integers only.
    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor)
    }

    /// Whether it applies to elements of type `d` (the bitwise operations only to
    /// integers).
    pub fn applies_to(self, d: crate::DataType) -> bool {
        d.is_integer() || !self.is_bitwise()
    }

    /// The name tools print (`sum`, `band`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Band => "band",
            ReduceOp::Bor => "bor",
            ReduceOp::Bxor => "bxor",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| format!("unknown reduction {s:?} (one of sum, prod, min, max, band, bor, bxor)"))
    }
}

/// The reduction kernels of an element type (see [`crate::Element`], which requires it).
pub trait Kernels: Sized + Copy {
    /// `acc[i] = acc[i] op other[i]` for every `i` both have. Bitwise operations on
    /// floats combine the bit patterns (collectives refuse them before this is reached).
    fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]);
}

/// The loop every kernel is: one pass, one operation, no branch on the operation inside,
/// compiled for AVX2 and for the baseline and run with AVX2 where the processor has it
/// (pulp's detection, once per call; not for a few elements, where it would cost more
/// than the loop). Sum over 16 KiB of f32 in cache: 42 -> 75 GiB/s, of bf16: 4.9 -> 10.9
/// GiB/s (`cargo bench -p ucxkit-benches --bench reduce`).
#[inline(always)]
fn zip_with<T: Copy, F: Fn(T, T) -> T>(acc: &mut [T], other: &[T], f: F) {
    if acc.len() < FEW {
        for (a, b) in acc.iter_mut().zip(other) {
            *a = f(*a, *b);
        }
        return;
    }
    pulp::Arch::new().dispatch(Zip { acc, other, f });
}

/// Fewer elements than this are reduced without looking for vector instructions.
const FEW: usize = 16;

/// [`zip_with`]'s loop, as pulp runs it: inlined into a function compiled for each
/// instruction set, where the compiler vectorises it with that set's registers.
struct Zip<'a, T, F> {
    acc: &'a mut [T],
    other: &'a [T],
    f: F,
}

impl<T: Copy, F: Fn(T, T) -> T> pulp::WithSimd for Zip<'_, T, F> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for (a, b) in self.acc.iter_mut().zip(self.other) {
            *a = (self.f)(*a, *b);
        }
    }
}

macro_rules! int_kernels {
    ($($t:ty),*) => {$(
        impl Kernels for $t {
            fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                match op {
                    ReduceOp::Sum => zip_with(acc, other, <$t>::wrapping_add),
                    ReduceOp::Prod => zip_with(acc, other, <$t>::wrapping_mul),
                    ReduceOp::Min => zip_with(acc, other, |a, b| a.min(b)),
                    ReduceOp::Max => zip_with(acc, other, |a, b| a.max(b)),
                    ReduceOp::Band => zip_with(acc, other, |a, b| a & b),
                    ReduceOp::Bor => zip_with(acc, other, |a, b| a | b),
                    ReduceOp::Bxor => zip_with(acc, other, |a, b| a ^ b),
                }
            }
        }
    )*};
}

int_kernels!(i8, i16, i32, i64, u8, u16, u32, u64);

macro_rules! float_kernels {
    ($($t:ty),*) => {$(
        impl Kernels for $t {
            fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                match op {
                    ReduceOp::Sum => zip_with(acc, other, |a, b| a + b),
                    ReduceOp::Prod => zip_with(acc, other, |a, b| a * b),
                    // Written as selects (not `f32::min`, which is a call with NaN rules)
                    // so that they become the processor's min and max instructions.
                    ReduceOp::Min => zip_with(acc, other, |a, b| if b < a || b != b { b } else { a }),
                    ReduceOp::Max => zip_with(acc, other, |a, b| if b > a || b != b { b } else { a }),
                    ReduceOp::Band => zip_with(acc, other, |a, b| <$t>::from_bits(a.to_bits() & b.to_bits())),
                    ReduceOp::Bor => zip_with(acc, other, |a, b| <$t>::from_bits(a.to_bits() | b.to_bits())),
                    ReduceOp::Bxor => zip_with(acc, other, |a, b| <$t>::from_bits(a.to_bits() ^ b.to_bits())),
                }
            }
        }
    )*};
}

float_kernels!(f32, f64);

/// Elements of a half-precision type widened at a time (two blocks of f32 on the stack).
const BLOCK: usize = 256;

/// A half-precision reduction through f32: widen a block of each side, reduce, narrow.
#[inline(always)]
fn through_f32<H: Copy>(
    op: ReduceOp,
    acc: &mut [H],
    other: &[H],
    widen: impl Fn(&[H], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [H]),
) {
    let (mut a, mut b) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (ac, oc) in acc.chunks_mut(BLOCK).zip(other.chunks(BLOCK)) {
        let n = ac.len().min(oc.len());
        widen(&ac[..n], &mut a[..n]);
        widen(&oc[..n], &mut b[..n]);
        f32::reduce(op, &mut a[..n], &b[..n]);
        narrow(&a[..n], &mut ac[..n]);
    }
}

/// The bitwise operations on 16-bit patterns.
#[inline(always)]
fn bits16<H: Copy>(op: ReduceOp, acc: &mut [H], other: &[H], to: fn(H) -> u16, from: fn(u16) -> H) {
    match op {
        ReduceOp::Band => zip_with(acc, other, |a, b| from(to(a) & to(b))),
        ReduceOp::Bor => zip_with(acc, other, |a, b| from(to(a) | to(b))),
        _ => zip_with(acc, other, |a, b| from(to(a) ^ to(b))),
    }
}

impl Kernels for f16 {
    fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
        if op.is_bitwise() {
            return bits16(op, acc, other, f16::to_bits, f16::from_bits);
        }
        // half converts whole slices with the processor's F16C instructions when it has
        // them.
        through_f32(op, acc, other, |h, f| h.convert_to_f32_slice(f), |f, h| h.convert_from_f32_slice(f));
    }
}

/// One bf16 (its bits) to f32.
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// One f32 to bf16 bits, rounded to nearest even, NaN kept quiet; branch-free.
#[inline(always)]
fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let quiet = (x >> 16) | 0x0040;
    (if (x & 0x7fff_ffff) > 0x7f80_0000 { quiet } else { rounded }) as u16
}

/// A bf16 reduction in one pass over the raw bits: widen both, combine, round back,
/// element by element, which the compiler vectorises (where widening into blocks and
/// narrowing back took three passes and ran 12x slower than a copy).
#[inline(always)]
fn bf16_fused(acc: &mut [bf16], other: &[bf16], f: impl Fn(f32, f32) -> f32) {
    let a: &mut [u16] = bytemuck::cast_slice_mut(acc);
    let b: &[u16] = bytemuck::cast_slice(other);
    zip_with(a, b, |x, y| f32_to_bf16(f(bf16_to_f32(x), bf16_to_f32(y))));
}

impl Kernels for bf16 {
    fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
        match op {
            ReduceOp::Sum => bf16_fused(acc, other, |a, b| a + b),
            ReduceOp::Prod => bf16_fused(acc, other, |a, b| a * b),
            ReduceOp::Min => bf16_fused(acc, other, |a, b| if b < a || b.is_nan() { b } else { a }),
            ReduceOp::Max => bf16_fused(acc, other, |a, b| if b > a || b.is_nan() { b } else { a }),
            _ => bits16(op, acc, other, bf16::to_bits, bf16::from_bits),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Element;

    /// Each kernel against a one-element-at-a-time reference, over a few elements and
    /// over a length that is not a multiple of the half-precision block.
    fn check<T: Element>(reference: impl Fn(ReduceOp, T, T) -> T) {
        for (n, op) in [FEW - 1, BLOCK * 2 + 7].into_iter().flat_map(|n| ReduceOp::ALL.map(|op| (n, op))) {
            if !op.applies_to(T::DTYPE) {
                continue;
            }
            let a: Vec<T> = (0..n).map(|i| T::from_small((i % 11) as u8 + 1)).collect();
            let b: Vec<T> = (0..n).map(|i| T::from_small((i % 7) as u8 + 2)).collect();
            let mut got = a.clone();
            T::reduce(op, &mut got, &b);
            let want: Vec<T> = a.iter().zip(&b).map(|(x, y)| reference(op, *x, *y)).collect();
            assert_eq!(got, want, "{} {op} over {n}", T::DTYPE);
        }
    }

    macro_rules! int_reference {
        ($t:ty) => {
            check::<$t>(|op, a, b| match op {
                ReduceOp::Sum => a.wrapping_add(b),
                ReduceOp::Prod => a.wrapping_mul(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
                ReduceOp::Band => a & b,
                ReduceOp::Bor => a | b,
                ReduceOp::Bxor => a ^ b,
            })
        };
    }

    #[test]
    fn integer_kernels_match_the_reference() {
        int_reference!(i8);
        int_reference!(i16);
        int_reference!(i32);
        int_reference!(i64);
        int_reference!(u8);
        int_reference!(u16);
        int_reference!(u32);
        int_reference!(u64);
    }

    fn float_reference(op: ReduceOp, a: f64, b: f64) -> f64 {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            _ => unreachable!("bitwise operations are not checked on floats"),
        }
    }

    #[test]
    fn float_kernels_match_the_reference() {
        check::<f32>(|op, a, b| float_reference(op, a as f64, b as f64) as f32);
        check::<f64>(float_reference);
        check::<f16>(|op, a, b| f16::from_f64(float_reference(op, a.to_f64(), b.to_f64())));
        check::<bf16>(|op, a, b| bf16::from_f64(float_reference(op, a.to_f64(), b.to_f64())));
    }

    #[test]
    fn bf16_narrowing_rounds_to_nearest_even_and_keeps_nan() {
        // Two ties (1 + 2^-8 and 1 + 3 * 2^-8) that round to the even neighbour.
        let cases = [
            1.0f32,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            -3.3e38,
            f32::INFINITY,
            1e-40,
            0.1,
            65504.0,
        ];
        for f in cases {
            assert_eq!(bf16::from_bits(f32_to_bf16(f)), bf16::from_f32(f), "{f}");
        }
        assert!(bf16::from_bits(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(bf16::from_f32(-2.5).to_bits()), -2.5);
    }

    #[test]
    fn bitwise_on_floats_combines_bits_and_mismatched_lengths_stop_at_the_shorter() {
        let mut a = [1.0f32, 2.0];
        f32::reduce(ReduceOp::Bxor, &mut a, &[1.0]);
        assert_eq!(a, [0.0, 2.0]);
        let mut h = [bf16::ONE; 3];
        bf16::reduce(ReduceOp::Sum, &mut h, &[bf16::ONE]);
        assert_eq!(h, [bf16::from_f32(2.0), bf16::ONE, bf16::ONE]);
    }

    #[test]
    fn float_min_and_max_are_commutative_with_nan() {
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let (mut a, mut b) = ([f32::NAN, 1.0], [1.0f32, f32::NAN]);
            f32::reduce(op, &mut a, &[1.0, f32::NAN]);
            f32::reduce(op, &mut b, &[f32::NAN, 1.0]);
            assert!(a.iter().chain(&b).all(|x| x.is_nan()), "{op}");
            let mut h = [bf16::ONE];
            bf16::reduce(op, &mut h, &[bf16::NAN]);
            assert!(h[0].is_nan(), "{op}");
        }
    }

    #[test]
    fn names_round_trip() {
        for op in ReduceOp::ALL {
            assert_eq!(op.name().parse::<ReduceOp>(), Ok(op));
        }
        assert!("avg".parse::<ReduceOp>().is_err());
    }
}
