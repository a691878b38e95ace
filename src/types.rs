//! Data types and reduction operators, mirrored from NVIDIA's `nccl.h` with identical values.
//!
//! Values arriving over the C ABI are plain integers: they are validated with
//! [`DataType::from_raw`] / [`ReduceOp::from_raw`], never transmuted.

use crate::error::{Error, Result};

/// Element type of a buffer (`ncclDataType_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DataType {
    /// `ncclInt8` / `ncclChar`.
    Int8 = 0,
    /// `ncclUint8`.
    Uint8 = 1,
    /// `ncclInt32` / `ncclInt`.
    Int32 = 2,
    /// `ncclUint32`.
    Uint32 = 3,
    /// `ncclInt64`.
    Int64 = 4,
    /// `ncclUint64`.
    Uint64 = 5,
    /// `ncclFloat16` / `ncclHalf` (IEEE binary16).
    Float16 = 6,
    /// `ncclFloat32` / `ncclFloat`.
    Float32 = 7,
    /// `ncclFloat64` / `ncclDouble`.
    Float64 = 8,
    /// `ncclBfloat16`.
    Bfloat16 = 9,
    /// `ncclFloat8e4m3` (OCP E4M3, "fn" variant: no infinities, saturating).
    Float8e4m3 = 10,
    /// `ncclFloat8e5m2` (OCP E5M2).
    Float8e5m2 = 11,
}

/// Number of data types (`ncclNumTypes`).
pub const NUM_TYPES: i32 = 12;

impl DataType {
    /// All data types, in `ncclDataType_t` order.
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8e4m3,
        DataType::Float8e5m2,
    ];

    /// Validates a raw `ncclDataType_t` value.
    pub fn from_raw(v: i32) -> Result<DataType> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
            .ok_or_else(|| Error::invalid_argument(format!("invalid data type {v} (valid: 0..{})", NUM_TYPES - 1)))
    }

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8e4m3 | DataType::Float8e5m2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// True for the floating-point types (including f16, bf16 and fp8).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::Float16
                | DataType::Float32
                | DataType::Float64
                | DataType::Bfloat16
                | DataType::Float8e4m3
                | DataType::Float8e5m2
        )
    }

    /// Short name as nccl-tests prints it (`int8`, `float`, `bfloat16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float8e4m3 => "f8e4m3",
            DataType::Float8e5m2 => "f8e5m2",
        }
    }

    /// Parses a name as nccl-tests' `-d` flag accepts it (`float`, `int32`, `half`, `bf16`, ...).
    pub fn parse(s: &str) -> Option<DataType> {
        Some(match s.to_ascii_lowercase().as_str() {
            "int8" | "char" | "i8" => DataType::Int8,
            "uint8" | "u8" => DataType::Uint8,
            "int32" | "int" | "i32" => DataType::Int32,
            "uint32" | "u32" => DataType::Uint32,
            "int64" | "i64" => DataType::Int64,
            "uint64" | "u64" => DataType::Uint64,
            "half" | "float16" | "f16" | "fp16" => DataType::Float16,
            "float" | "float32" | "f32" | "fp32" => DataType::Float32,
            "double" | "float64" | "f64" | "fp64" => DataType::Float64,
            "bfloat16" | "bf16" => DataType::Bfloat16,
            "f8e4m3" | "fp8_e4m3" | "float8e4m3" | "e4m3" => DataType::Float8e4m3,
            "f8e5m2" | "fp8_e5m2" | "float8e5m2" | "e5m2" => DataType::Float8e5m2,
            _ => return None,
        })
    }
}

/// Reduction operator (`ncclRedOp_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ReduceOp {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclProd`.
    Prod = 1,
    /// `ncclMax`.
    Max = 2,
    /// `ncclMin`.
    Min = 3,
    /// `ncclAvg`: sum divided by the number of ranks.
    Avg = 4,
}

/// Number of built-in operators (`ncclNumOps`); user-created operators are numbered from here.
pub const NUM_OPS: i32 = 5;

impl ReduceOp {
    /// All built-in operators, in `ncclRedOp_t` order.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg];

    /// Validates a raw `ncclRedOp_t` value.
    pub fn from_raw(v: i32) -> Result<ReduceOp> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
            .ok_or_else(|| Error::invalid_argument(format!("invalid reduction op {v} (valid: 0..{})", NUM_OPS - 1)))
    }

    /// Name as nccl-tests prints it (`sum`, `prod`, `max`, `min`, `avg`).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parses an operator name (`sum`, `prod`, `max`, `min`, `avg`).
    pub fn parse(s: &str) -> Option<ReduceOp> {
        Self::ALL.iter().copied().find(|o| o.name().eq_ignore_ascii_case(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_values_match_nccl_h() {
        for (i, t) in DataType::ALL.iter().enumerate() {
            assert_eq!(*t as i32, i as i32);
            assert_eq!(DataType::from_raw(i as i32).unwrap(), *t);
            assert_eq!(DataType::parse(t.name()), Some(*t));
        }
        assert!(DataType::from_raw(12).is_err());
        assert!(DataType::from_raw(-1).is_err());
        assert!(ReduceOp::from_raw(5).is_err());
        assert!(ReduceOp::from_raw(i32::MIN).is_err());
        assert_eq!(ReduceOp::from_raw(4).unwrap(), ReduceOp::Avg);
    }
}
