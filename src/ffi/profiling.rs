//! The `pnccl*` profiling aliases: NCCL exports every API function a second time under a `p`
//! prefix (for profiling tools that interpose the `nccl*` names). build.rs generates one
//! forwarding wrapper per `nccl*` function of src/ffi, with the same signature.
#![allow(missing_docs)]

use super::collconfig::ncclCollConfig_t;
use super::config::ncclConfig_t;
use super::premul::ncclScalarResidenceRaw;
use super::unsupported::*;
use super::*;
use std::ffi::c_void;
use std::os::raw::c_int;

include!(concat!(env!("OUT_DIR"), "/pnccl.rs"));
