//! `OXCCL_DETERMINISTIC=1` on device buffers, on the CUDA stand-in (`cuda-standin/`; the real
//! driver with `OXCCL_DEVICE_TESTS_REAL=1`): with CUDA IPC available, a device all-reduce runs
//! the host's fixed-order schedule on pinned staging (the INFO log says so) and gives the
//! rank-order fold bit for bit: float32 in float32, float16 accumulated in float32 and rounded
//! once, both computed here from the inputs.

mod common;

use cudarc::driver::{result, sys};
use oxccl::ffi::{coll::ncclAllReduce, comm::ncclCommDestroy, comm::ncclCommInitRank, ncclComm_t, ncclResult_t};
use oxccl::{DataType, ReduceOp};
use std::time::Duration;

use common::standin::{standin_env, DevMem};

/// Rank `rank`'s input over many magnitudes (the sum depends on the order).
fn values(rank: usize, count: usize, span: i32) -> Vec<f64> {
    (0..count)
        .map(|i| {
            let h = (i.wrapping_mul(2654435761) ^ (rank * 40503 + 7)) % (2 * span as usize + 1);
            let sign = if (i + rank) % 3 == 0 { -1.0 } else { 1.0 };
            sign * 2f64.powi(h as i32 - span) * (1.0 + (i % 89) as f64 / 89.0)
        })
        .collect()
}

fn encode(dt: DataType, v: &[f64]) -> Vec<u8> {
    let mut out = vec![0u8; v.len() * dt.size()];
    oxccl::reduce::from_f64(dt, v, &mut out);
    out
}

/// The left fold in rank order in f32 of the stored inputs, rounded once to `dt`.
fn reference(dt: DataType, n: usize, count: usize, span: i32) -> Vec<u8> {
    let ins: Vec<Vec<f64>> = (0..n).map(|r| oxccl::reduce::to_f64(dt, &encode(dt, &values(r, count, span)))).collect();
    let sums: Vec<f64> = (0..count)
        .map(|i| {
            let mut acc = ins[0][i] as f32;
            ins[1..].iter().for_each(|x| acc += x[i] as f32);
            f64::from(acc)
        })
        .collect();
    encode(dt, &sums)
}

fn rank_main(rank: usize, n: usize, id_hex: &str) {
    assert!(oxccl::device::available(), "rank {rank}: no CUDA (stand-in not on LD_LIBRARY_PATH?)");
    let id = oxccl::UniqueId::from_hex(id_hex).expect("id");
    let mut cid = oxccl::ffi::ncclUniqueId { internal: [0; 128] };
    for (d, s) in cid.internal.iter_mut().zip(id.bytes) {
        *d = s as std::ffi::c_char;
    }
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, n as i32, cid, rank as i32), ncclResult_t::ncclSuccess);
    let gpu = oxccl::device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    for (dt, span, count) in [(DataType::Float32, 30, 20_011), (DataType::Float16, 6, 1_003)] {
        let data = encode(dt, &values(rank, count, span));
        let (send, recv) = (DevMem::new(data.len()), DevMem::new(data.len()));
        let mut got = vec![0u8; data.len()];
        // SAFETY: the device buffers hold data.len() bytes; the host buffers outlive the
        // stream's work (synchronised below).
        unsafe {
            assert_eq!(
                sys::cuMemcpyHtoDAsync_v2(send.0, data.as_ptr().cast(), data.len(), stream),
                sys::CUresult::CUDA_SUCCESS
            );
            let r = ncclAllReduce(
                send.0 as *const _,
                recv.0 as *mut _,
                count,
                dt as i32,
                ReduceOp::Sum as i32,
                comm,
                stream.cast(),
            );
            assert_eq!(r, ncclResult_t::ncclSuccess);
            assert_eq!(
                sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), recv.0, got.len(), stream),
                sys::CUresult::CUDA_SUCCESS
            );
            result::stream::synchronize(stream).expect("cuStreamSynchronize");
        }
        assert!(
            got == reference(dt, n, count, span),
            "rank {rank}: {dt:?} device all-reduce is not the rank-order fold"
        );
    }
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn device_all_reduce_is_the_rank_order_fold_under_the_switch() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_main(rank, n, &id);
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_DETERMINISTIC", "1".into()));
    env.push(("OXCCL_CUDA_IPC_BUFFER", "65536".into()));
    let res = common::run_ranks(
        "device_all_reduce_is_the_rank_order_fold_under_the_switch",
        3,
        &env,
        Duration::from_secs(300),
    );
    common::assert_all_ok(&res);
    for (i, (_, err)) in res.iter().enumerate() {
        assert!(err.contains("device all_reduce path: staged"), "rank {i}: expected the staged path:\n{err}");
        assert!(!err.contains("device all_reduce path: ipc"), "rank {i}:\n{err}");
    }
}
