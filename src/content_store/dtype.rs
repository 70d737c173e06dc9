//! Element types, numbered as c10::ScalarType numbers them.

use crate::error::{Error, ErrorKind, Result};

/// A tensor element type; the discriminant is c10::ScalarType's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Dtype {
    UInt8 = 0,
    Int8 = 1,
    Int16 = 2,
    Int32 = 3,
    Int64 = 4,
    Float16 = 5,
    Float32 = 6,
    Float64 = 7,
    ComplexHalf = 8,
    ComplexFloat = 9,
    ComplexDouble = 10,
    Bool = 11,
    BFloat16 = 15,
    Float8E5M2 = 23,
    Float8E4M3Fn = 24,
    UInt16 = 27,
    UInt32 = 28,
    UInt64 = 29,
}

const ALL: [Dtype; 18] = [
    Dtype::UInt8,
    Dtype::Int8,
    Dtype::Int16,
    Dtype::Int32,
    Dtype::Int64,
    Dtype::Float16,
    Dtype::Float32,
    Dtype::Float64,
    Dtype::ComplexHalf,
    Dtype::ComplexFloat,
    Dtype::ComplexDouble,
    Dtype::Bool,
    Dtype::BFloat16,
    Dtype::Float8E5M2,
    Dtype::Float8E4M3Fn,
    Dtype::UInt16,
    Dtype::UInt32,
    Dtype::UInt64,
];

impl Dtype {
    /// The dtype for a c10::ScalarType code, or an error naming the code.
    pub fn from_code(code: i32) -> Result<Dtype> {
        ALL.into_iter()
            .find(|d| *d as i32 == code)
            .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("unknown or unsupported dtype code {code}")))
    }

    /// The c10::ScalarType code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        use Dtype::*;
        match self {
            UInt8 | Int8 | Bool | Float8E5M2 | Float8E4M3Fn => 1,
            Int16 | UInt16 | Float16 | BFloat16 => 2,
            Int32 | UInt32 | Float32 | ComplexHalf => 4,
            Int64 | UInt64 | Float64 | ComplexFloat => 8,
            ComplexDouble => 16,
        }
    }

    /// The name after `torch.` (`float32`, `bfloat16`, ...).
    pub fn torch_name(self) -> &'static str {
        use Dtype::*;
        match self {
            UInt8 => "uint8",
            Int8 => "int8",
            Int16 => "int16",
            Int32 => "int32",
            Int64 => "int64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            ComplexHalf => "complex32",
            ComplexFloat => "complex64",
            ComplexDouble => "complex128",
            Bool => "bool",
            BFloat16 => "bfloat16",
            Float8E5M2 => "float8_e5m2",
            Float8E4M3Fn => "float8_e4m3fn",
            UInt16 => "uint16",
            UInt32 => "uint32",
            UInt64 => "uint64",
        }
    }

    /// The dtype for a name after `torch.`, or an error naming it.
    pub fn from_torch_name(name: &str) -> Result<Dtype> {
        ALL.into_iter()
            .find(|d| d.torch_name() == name)
            .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, format!("unknown or unsupported dtype torch.{name}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for d in ALL {
            assert_eq!(Dtype::from_code(d.code()).unwrap(), d);
            assert_eq!(Dtype::from_torch_name(d.torch_name()).unwrap(), d);
        }
        assert_eq!(Dtype::Float32.code(), 6);
        assert_eq!(Dtype::BFloat16.itemsize(), 2);
        assert_eq!(Dtype::from_code(12).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert!(Dtype::from_torch_name("qint8").unwrap_err().message().contains("torch.qint8"));
    }
}
