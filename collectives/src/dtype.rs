//! The element types collectives move and reduce: [`Element`] (implemented for the
//! integers, `f32`, `f64`, [`f16`](struct@f16) and [`bf16`]) and [`DataType`], its name at run time.

use std::fmt;

pub use half::{bf16, f16};

use crate::reduce::Kernels;

/// An element type's name at run time (for plans, reports and the wire's checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum DataType {
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    F16,
    Bf16,
    F32,
    F64,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::I16 | DataType::U16 | DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// Whether it is an integer type (the bitwise operations apply).
    pub fn is_integer(self) -> bool {
        !matches!(self, DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64)
    }

    /// The name tools print (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DataType::I8 => "i8",
            DataType::I16 => "i16",
            DataType::I32 => "i32",
            DataType::I64 => "i64",
            DataType::U8 => "u8",
            DataType::U16 => "u16",
            DataType::U32 => "u32",
            DataType::U64 => "u64",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::F32 => "f32",
            DataType::F64 => "f64",
        }
    }

    /// Every type, in declaration order.
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::I16,
        DataType::I32,
        DataType::I64,
        DataType::U8,
        DataType::U16,
        DataType::U32,
        DataType::U64,
        DataType::F16,
        DataType::Bf16,
        DataType::F32,
        DataType::F64,
    ];
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DataType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DataType::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| {
            format!("unknown element type {s:?} (one of i8..i64, u8..u64, f16, bf16, f32, f64)")
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type collectives can move and reduce. Implemented for `i8`...`i64`, `u8`...`u64`,
/// [`f16`](struct@f16), [`bf16`], `f32` and `f64`; sealed.
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + Kernels + sealed::Sealed + 'static
{
    /// The type's name at run time.
    const DTYPE: DataType;

    /// The element that is a small integer `v` (exact in every type for `0..=100`),
    /// for tests, checks and tools.
    fn from_small(v: u8) -> Self;
}

macro_rules! element {
    ($($t:ty => $d:ident, $from:expr;)*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
            #[allow(clippy::redundant_closure_call)]
            fn from_small(v: u8) -> Self {
                ($from)(v)
            }
        }
    )*};
}

element! {
    i8 => I8, |v: u8| v as i8;
    i16 => I16, |v: u8| v as i16;
    i32 => I32, |v: u8| v as i32;
    i64 => I64, |v: u8| v as i64;
    u8 => U8, |v: u8| v;
    u16 => U16, |v: u8| v as u16;
    u32 => U32, |v: u8| v as u32;
    u64 => U64, |v: u8| v as u64;
    f16 => F16, |v: u8| f16::from_f32(v as f32);
    bf16 => Bf16, |v: u8| bf16::from_f32(v as f32);
    f32 => F32, |v: u8| v as f32;
    f64 => F64, |v: u8| v as f64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_match() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>(), Ok(d));
        }
        assert!("f8".parse::<DataType>().is_err());
        assert_eq!(DataType::Bf16.size(), std::mem::size_of::<bf16>());
        assert_eq!(<u64 as Element>::DTYPE.size(), 8);
    }
}
