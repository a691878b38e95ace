//! The device test cases of tests/device_colls.rs and tests/device_failures.rs: rank set-up on
//! the CUDA stand-in (or the real driver), device buffers for any collective in and out of
//! place, an f64 reference for every case, and the rank launcher (one test at a time).
//! Included by those files with `#[path]` (not part of `common`, which every test compiles).

#![allow(dead_code)] // each including test uses a part

use crate::common;
use common::standin::{standin_env, DevMem};
use cudarc::driver::{result, sys};
use oxccl::ffi::coll::{
    ncclAllGather, ncclAllReduce, ncclAlltoAll, ncclBroadcast, ncclGather, ncclRecv, ncclReduce, ncclReduceScatter,
    ncclScatter, ncclSend,
};
use oxccl::ffi::group::{ncclGroupEnd, ncclGroupStart};
use oxccl::ffi::premul::ncclRedOpCreatePreMulSum;
use oxccl::ffi::{comm::ncclCommInitRank, config::ncclCommGetAsyncError, ncclComm_t, ncclResult_t, ncclUniqueId};
use oxccl::{reduce, Collective, DataType, ReduceOp};
use std::ffi::c_void;
use std::time::Duration;

pub fn ok(r: ncclResult_t, comm: ncclComm_t, what: &str) {
    assert_eq!(r, ncclResult_t::ncclSuccess, "{what}: {}", last_error(comm));
}

pub fn last_error(comm: ncclComm_t) -> String {
    // SAFETY: ncclGetLastError returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(oxccl::ffi::comm::ncclGetLastError(comm)) }.to_string_lossy().into_owned()
}

/// How a case reduces: a built-in operator, or PreMulSum with scalar `0.5 * (rank + 1)` on the
/// host or in device memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Red {
    Op(ReduceOp),
    PreMulHost,
    PreMulDevice,
}

impl Red {
    fn name(self) -> String {
        match self {
            Red::Op(o) => o.name().to_string(),
            Red::PreMulHost => "premulsum(host)".into(),
            Red::PreMulDevice => "premulsum(device)".into(),
        }
    }
}

pub fn scalar(rank: usize) -> f64 {
    0.5 * (rank + 1) as f64
}

/// Rank `rank`'s input for a case: `len` elements, as stored in `dt` and decoded back.
pub fn input(dt: DataType, red: Red, rank: usize, len: usize, seed: usize) -> (Vec<u8>, Vec<f64>) {
    let prod = red == Red::Op(ReduceOp::Prod);
    let vals: Vec<f64> = (0..len).map(|i| common::input(rank, i, seed, false, prod)).collect();
    let mut bytes = vec![0u8; len * dt.size()];
    reduce::from_f64(dt, &vals, &mut bytes);
    let exact = reduce::to_f64(dt, &bytes);
    (bytes, exact)
}

/// The f64 reduction of `xs` (one value per rank) and its tolerance.
pub fn reduce_ref(dt: DataType, red: Red, xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let abs: f64 = xs.iter().map(|x| x.abs()).sum();
    let eps = common::eps(dt);
    match red {
        Red::Op(ReduceOp::Sum) => (xs.iter().sum(), n * eps * abs),
        Red::Op(ReduceOp::Avg) if dt.is_float() => (xs.iter().sum::<f64>() / n, 2.0 * eps * abs),
        Red::Op(ReduceOp::Avg) => ((xs.iter().sum::<f64>() / n).trunc(), 0.0),
        Red::Op(ReduceOp::Prod) => (xs.iter().product(), n * eps * xs.iter().product::<f64>().abs()),
        Red::Op(ReduceOp::Max) => (xs.iter().cloned().fold(f64::MIN, f64::max), 0.0),
        Red::Op(ReduceOp::Min) => (xs.iter().cloned().fold(f64::MAX, f64::min), 0.0),
        Red::PreMulHost | Red::PreMulDevice => {
            let s: Vec<f64> = xs.iter().enumerate().map(|(k, x)| scalar(k) * x).collect();
            (s.iter().sum(), 2.0 * n * eps * s.iter().map(|x| x.abs()).sum::<f64>())
        }
    }
}

/// What rank `rank` must hold after `coll` (`None`: its receive buffer is not written), from
/// every rank's full input (`n * count` elements each).
pub fn expected(
    coll: Collective,
    red: Red,
    dt: DataType,
    ins: &[Vec<f64>],
    rank: usize,
    count: usize,
) -> Option<Vec<(f64, f64)>> {
    let n = ins.len();
    let red_at = |j: usize| reduce_ref(dt, red, &ins.iter().map(|v| v[j]).collect::<Vec<_>>());
    let exact = |x: f64| (x, 0.0);
    Some(match coll {
        Collective::AllReduce => (0..count).map(red_at).collect(),
        Collective::Broadcast { root } => (0..count).map(|i| exact(ins[root][i])).collect(),
        Collective::Reduce { root } if root == rank => (0..count).map(red_at).collect(),
        Collective::AllGather => (0..n * count).map(|j| exact(ins[j / count][j % count])).collect(),
        Collective::ReduceScatter => (0..count).map(|i| red_at(rank * count + i)).collect(),
        Collective::AllToAll => (0..n * count).map(|j| exact(ins[j / count][rank * count + j % count])).collect(),
        Collective::Gather { root } if root == rank => {
            (0..n * count).map(|j| exact(ins[j / count][j % count])).collect()
        }
        Collective::Scatter { root } => (0..count).map(|i| exact(ins[root][rank * count + i])).collect(),
        Collective::Recv { peer } => (0..count).map(|i| exact(ins[peer][i])).collect(),
        _ => return None,
    })
}

/// One enqueued case and what to check once the streams are synchronised.
pub struct Case {
    pub what: String,
    pub want: Option<Vec<(f64, f64)>>,
    pub dt: DataType,
    pub got: Vec<u8>,
    /// Where the result is, and the stream that wrote it.
    pub out: u64,
    pub stream: sys::CUstream,
    pub _src: Vec<u8>,
    pub _mem: Vec<DevMem>,
}

impl Case {
    /// Enqueues the copy of the result back to the host (after the call on its stream).
    pub fn fetch(mut self) -> Case {
        let len = self.want.as_ref().map_or(0, |w| w.len()) * self.dt.size();
        self.got = vec![0u8; len];
        if len > 0 {
            // SAFETY: `got` lives in the case until the streams are synchronised.
            let r = unsafe { sys::cuMemcpyDtoHAsync_v2(self.got.as_mut_ptr().cast(), self.out, len, self.stream) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        }
        self
    }
}

/// The streams, the device scalars of the PreMulSum operators and the communicator of a rank.
pub struct Rank {
    pub comm: ncclComm_t,
    pub rank: usize,
    pub n: usize,
    pub streams: Vec<sys::CUstream>,
    pub host_dummy: Vec<u8>,
    pub dev_scalars: Vec<DevMem>,
}

impl Rank {
    /// The operator argument of `red` for `dt` (creates PreMulSum operators as needed).
    pub fn op_arg(&mut self, red: Red, dt: DataType) -> i32 {
        match red {
            Red::Op(o) => o as i32,
            Red::PreMulHost | Red::PreMulDevice => {
                let mut bytes = vec![0u8; dt.size()];
                reduce::from_f64(dt, &[scalar(self.rank)], &mut bytes);
                let mut op = 0;
                let r = if red == Red::PreMulHost {
                    ncclRedOpCreatePreMulSum(&mut op, bytes.as_mut_ptr().cast(), dt as i32, 1, self.comm)
                } else {
                    let m = DevMem::new(8);
                    // SAFETY: `m` holds 8 bytes, the scalar at most 8. The context synchronisation
                    // lands the pageable copy's DMA, which non-blocking streams do not wait for.
                    unsafe {
                        result::memcpy_htod_sync(m.0, &bytes).expect("scalar upload");
                        result::ctx::synchronize().expect("cuCtxSynchronize");
                    }
                    let r = ncclRedOpCreatePreMulSum(&mut op, m.0 as *mut c_void, dt as i32, 0, self.comm);
                    self.dev_scalars.push(m);
                    r
                };
                ok(r, self.comm, "ncclRedOpCreatePreMulSum");
                op
            }
        }
    }

    /// Enqueues `coll` on stream `s` (the ring: a send and a receive in a group) and returns its
    /// check; [`Case::fetch`] then enqueues the copy of its result.
    #[allow(clippy::too_many_arguments)]
    pub fn case(
        &mut self,
        coll: Collective,
        dt: DataType,
        red: Red,
        count: usize,
        in_place: bool,
        seed: usize,
        s: usize,
    ) -> Case {
        let (rank, n, comm) = (self.rank, self.n, self.comm);
        let es = dt.size();
        let ins: Vec<Vec<f64>> = (0..n).map(|k| input(dt, red, k, n * count, seed).1).collect();
        let (mine, _) = input(dt, red, rank, n * count, seed);
        let (sc, rc) = match coll {
            Collective::Send { .. } => (count, count), // the ring both sends and receives
            c => c.buffer_counts(rank, n, count),
        };
        let blk = count * es;
        let stream = self.streams[s];
        let upload = |dst: u64, src: &[u8]| {
            // SAFETY: `dst` holds `src.len()` bytes; `mine` lives until the case is checked.
            let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        };
        let mut mem = Vec::new();
        // (send, recv, where the result is, its length in bytes)
        let (send, recv, out): (u64, u64, u64) = if in_place {
            let big = DevMem::new(n * blk);
            let b = big.0;
            let (send, recv) = match coll {
                Collective::AllGather => (b + (rank * blk) as u64, b),
                Collective::Gather { root } if root == rank => (b + (rank * blk) as u64, b),
                Collective::ReduceScatter => (b, b + (rank * blk) as u64),
                Collective::Scatter { root } if root == rank => (b, b + (rank * blk) as u64),
                _ => (b, b),
            };
            if sc > 0 {
                upload(send, &mine[..sc * es]);
            }
            mem.push(big);
            (send, recv, recv)
        } else {
            let sbuf = DevMem::new(sc * es);
            let rbuf = DevMem::new(rc.max(count) * es);
            if sc > 0 {
                upload(sbuf.0, &mine[..sc * es]);
            }
            // Buffers NCCL ignores on this rank: NULL send, host-memory receive.
            let send = if sc > 0 { sbuf.0 } else { 0 };
            let recv = if rc > 0 { rbuf.0 } else { self.host_dummy.as_mut_ptr() as u64 };
            let out = rbuf.0;
            mem.push(sbuf);
            mem.push(rbuf);
            (send, recv, out)
        };
        let op = self.op_arg(red, dt);
        let (sp, rp, st) = (send as *const c_void, recv as *mut c_void, stream.cast());
        let d = dt as i32;
        let r = match coll {
            Collective::AllReduce => ncclAllReduce(sp, rp, count, d, op, comm, st),
            Collective::Broadcast { root } => ncclBroadcast(sp, rp, count, d, root as i32, comm, st),
            Collective::Reduce { root } => ncclReduce(sp, rp, count, d, op, root as i32, comm, st),
            Collective::AllGather => ncclAllGather(sp, rp, count, d, comm, st),
            Collective::ReduceScatter => ncclReduceScatter(sp, rp, count, d, op, comm, st),
            Collective::AllToAll => ncclAlltoAll(sp, rp, count, d, comm, st),
            Collective::Gather { root } => ncclGather(sp, rp, count, d, root as i32, comm, st),
            Collective::Scatter { root } => ncclScatter(sp, rp, count, d, root as i32, comm, st),
            Collective::Recv { .. } | Collective::Send { .. } => {
                // The ring: send to the right, receive from the left, in one group.
                let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
                ok(ncclGroupStart(), comm, "ncclGroupStart");
                ok(ncclSend(sp, count, d, right as i32, comm, st), comm, "ncclSend");
                // In place: the receive overwrites the buffer the send reads (safe on both paths: each
                // piece is staged before the matching received piece lands).
                ok(ncclRecv(rp, count, d, left as i32, comm, st), comm, "ncclRecv");
                ncclGroupEnd()
            }
        };
        let what = format!(
            "rank {rank}/{n} {} {} {} count {count} in_place {in_place} stream {s}",
            coll.name(),
            dt.name(),
            red.name()
        );
        ok(r, comm, &what);
        let check_coll = match coll {
            Collective::Send { .. } | Collective::Recv { .. } => Collective::Recv { peer: (rank + n - 1) % n },
            c => c,
        };
        let want = expected(check_coll, red, dt, &ins, rank, count);
        // `mine` outlives its asynchronous upload: it is kept with the case.
        Case { what, want, dt, got: Vec::new(), out, stream, _src: mine, _mem: mem }
    }
}

pub fn check(c: &Case) {
    let Some(want) = &c.want else { return };
    let got = reduce::to_f64(c.dt, &c.got);
    assert_eq!(got.len(), want.len(), "{}", c.what);
    for (i, (g, (w, tol))) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= *tol, "{}: element {i}: got {g} want {w} (tolerance {tol})", c.what);
    }
}

pub fn join(rank: usize, n: usize, id_hex: &str) -> (Rank, oxccl::device::CtxGuard) {
    if std::env::var("OXCCL_TEST_FAKE_HOSTS").is_ok_and(|v| v == "1") {
        // Two fake hosts: ranks 0, 2 on one, 1, 3 on the other.
        std::env::set_var("OXCCL_HOSTID", format!("fake-host-{}", rank % 2));
    }
    assert!(oxccl::device::available(), "rank {rank}: no CUDA (stand-in not on LD_LIBRARY_PATH?)");
    let id = oxccl::UniqueId::from_hex(id_hex).expect("id");
    let mut cid = ncclUniqueId { internal: [0; 128] };
    for (d, s) in cid.internal.iter_mut().zip(id.bytes) {
        *d = s as std::ffi::c_char;
    }
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, n as i32, cid, rank as i32), ncclResult_t::ncclSuccess);
    let guard = oxccl::device::gpu(0).unwrap().enter().unwrap();
    let streams =
        (0..2).map(|_| result::stream::create(result::stream::StreamKind::NonBlocking).unwrap()).collect::<Vec<_>>();
    (Rank { comm, rank, n, streams, host_dummy: vec![0u8; 64], dev_scalars: Vec::new() }, guard)
}

pub fn finish(r: &Rank, cases: &[Case]) {
    for &s in &r.streams {
        // SAFETY: live streams of the current context.
        unsafe { result::stream::synchronize(s) }.expect("cuStreamSynchronize");
    }
    cases.iter().for_each(check);
    let mut e = ncclResult_t::ncclInternalError;
    assert_eq!(ncclCommGetAsyncError(r.comm, &mut e), ncclResult_t::ncclSuccess);
    assert_eq!(e, ncclResult_t::ncclSuccess, "{}", last_error(r.comm));
}

pub const TYPES: [DataType; 4] = [DataType::Float32, DataType::Float16, DataType::Bfloat16, DataType::Int32];

/// The tests of this file start their ranks one test at a time (all ranks share one simulated
/// GPU; parallel tests on a loaded 2-core machine only add noise).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn run(entry: &str, n: usize, extra: &[(&'static str, String)], limit: Duration) -> Vec<(bool, String)> {
    let _one = serial();
    let mut env = standin_env();
    env.extend_from_slice(extra);
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_CUDA_IPC_BUFFER", "65536".into()));
    common::run_ranks(entry, n, &env, limit)
}
