//! # oxccl
//!
//! A collective-communication library with NVIDIA NCCL's C API (`nccl.h` names, types and
//! values), built as `liboxccl.so`, plus a safe Rust API.
//!
//! Layers (see `docs/ARCHITECTURE.md`): [`ffi`] (C ABI) and [`api`] (Rust) → [`call`] (one
//! description of a call, checked once; groups; nonblocking creation) → [`comm`] (communicator) →
//! [`algo`] (sans-IO collective schedules) → [`engine`] (runs a schedule over links) →
//! [`transport`] (TCP, in-memory), with [`bootstrap`] building the links and [`reduce`]
//! holding the host reduction kernels and [`device`] the CUDA path (loaded at run time).
//!
//! ```no_run
//! use oxccl::{Communicator, ReduceOp};
//! let comm = Communicator::from_env()?; // torchrun / mpirun / srun variables
//! let grad = vec![1.0f32; 1024];
//! let mut sum = vec![0.0f32; 1024];
//! comm.all_reduce(&grad, &mut sum, ReduceOp::Sum)?;
//! # Ok::<(), oxccl::Error>(())
//! ```

pub mod algo;
pub mod api;
pub mod bootstrap;
pub mod call;
pub mod coll;
pub mod comm;
pub mod config;
pub mod control;
pub mod device;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod flight;
pub mod group;
mod guard;
pub mod log;
pub mod mismatch;
pub mod net;
pub mod reduce;
pub mod split;
pub mod sync;
pub mod transport;
pub mod types;
pub mod wait;

pub use algo::tuning::{Algo, AlgoSet, Overrides, TransportKind};
pub use algo::Collective;
pub use api::Collectives;
pub use bootstrap::UniqueId;
pub use call::{group, Call, Group, GroupComm, Reduction};
pub use coll::Op;
pub use comm::Communicator;
pub use error::{Error, ErrorKind, Result};
pub use transport::shm::hostmem::SharedBuffer;
pub use types::{DataType, ReduceOp};

pub use ffi::types::{NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, NCCL_VERSION_CODE};

/// The crate's own version (distinct from the NCCL API level).
pub const OXCCL_VERSION: &str = env!("CARGO_PKG_VERSION");

/// An element type that can be passed to the safe collective API.
///
/// Implemented for the Rust types matching each `ncclDataType_t`.
pub trait Element: bytemuck::Pod {
    /// The matching NCCL data type.
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DataType = DataType::$d; })*
    };
}
element!(i8 => Int8, u8 => Uint8, i32 => Int32, u32 => Uint32, i64 => Int64, u64 => Uint64,
         half::f16 => Float16, f32 => Float32, f64 => Float64, half::bf16 => Bfloat16);
