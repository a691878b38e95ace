//! The proxy path: device buffers staged through pinned host memory into the host engine
//! (any transport, any number of hosts), with NCCL's stream semantics.
//!
//! A call enqueues on the user's stream, and returns at once:
//!
//! ```text
//! D2H copy send -> staging | write ready[slot] = seq | wait done[slot] >= seq | H2D staging -> recv | write released[slot] = seq
//! ```
//!
//! The flags are pinned, device-mapped host words written and waited on by the GPU with stream
//! memory operations (`cuStreamWriteValue32` / `cuStreamWaitValue32`; the write is preceded by a
//! memory fence, so the staging bytes are in host memory when `ready` changes). A proxy thread
//! per communicator takes the calls in issue order, waits (spinning, then sleeping) until
//! `ready` reaches the call's sequence number, runs the host all-reduce in place on the staging
//! buffer, and stores `done`, which releases the stream. The proxy thread makes no CUDA call.
//! If the wait times out (`OXCCL_TIMEOUT_MS`) or the collective fails, the proxy still stores
//! `done` (the stream never hangs on it), records the error, and every later call fails with it.
//!
//! Every call runs on the communicator's internal stream (`state`). If enqueueing fails after
//! the call took its sequence number, this rank would skip a collective its peers run: the
//! call's flags are written from the host so nothing waits on them, and the error fails the
//! communicator at once (the device session's failure path, `session.rs`: the peers are
//! told, so they fail instead of pairing with the wrong call).
//!
//! Each call has its own flag slot and staging buffer, so calls on different streams cannot
//! overtake each other's data; a buffer is reused only after its `released` flag shows the
//! H2D copy finished. At most [`MAX_IN_FLIGHT`] calls are in flight; the next one waits (bounded
//! by the timeout) for the oldest to be released.

use super::exec::{layout, run_staged, Area, DevOp, Scalar};
use super::pinned::{load, reached, Pinned};
use super::{check, DevCall};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Flag slots (ready, done, released per slot).
const SLOTS: usize = 32;
/// Staging buffers (calls) in flight at most; below `SLOTS` so a slot is free when reused.
pub(crate) const MAX_IN_FLIGHT: usize = 8;
/// Smallest staging buffer allocated.
const MIN_STAGING: usize = 1 << 20;

fn ready(slot: usize) -> usize {
    slot
}
fn done(slot: usize) -> usize {
    SLOTS + slot
}
/// Enqueues on `stream` the hand-over of call `seq` in `slot` to the proxy thread: flag its
/// staging ready, then hold the stream until the proxy flags it done.
///
/// # Safety
/// `stream` is a valid stream of the context `flags` was mapped in.
unsafe fn hand_over(flags: &Pinned, stream: sys::CUstream, slot: usize, seq: u32) -> Result<()> {
    use sys::CUstreamWaitValue_flags as W;
    // SAFETY: per this function's contract.
    unsafe { write_flag(flags, stream, ready(slot), seq, "cuStreamWriteValue32(ready)") }?;
    // SAFETY: the flags are device-mapped pinned words; `stream` per this function's contract.
    unsafe {
        check(
            sys::cuStreamWaitValue32_v2(stream, flags.flag_dev(done(slot)), seq, W::CU_STREAM_WAIT_VALUE_GEQ as u32),
            "cuStreamWaitValue32(done)",
        )
    }
}

/// Enqueues on `stream` a write of `seq` into flag `i` (`what` names it in errors).
///
/// # Safety
/// As [`hand_over`].
unsafe fn write_flag(flags: &Pinned, stream: sys::CUstream, i: usize, seq: u32, what: &str) -> Result<()> {
    let write = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: the flags are device-mapped pinned words; `stream` per this function's contract.
    check(unsafe { sys::cuStreamWriteValue32_v2(stream, flags.flag_dev(i), seq, write) }, what)
}

fn released(slot: usize) -> usize {
    2 * SLOTS + slot
}

struct Job {
    seq: u32,
    slot: usize,
    comm: Arc<Communicator>,
    buf: Arc<Pinned>,
    work: Work,
}

/// What the proxy thread runs on a job's staging buffer.
enum Work {
    /// An all-reduce in place on the staging buffer.
    AllReduce { count: usize, dtype: DataType, op: ReduceOp },
    /// Any calls, each with its own areas (`exec`).
    Staged { ops: Vec<DevOp>, areas: Vec<Area> },
}

struct Staging {
    mem: Arc<Pinned>,
    /// Sequence number and slot of the last call that used it.
    last: Option<(u32, usize)>,
}

struct Inner {
    seq: u32,
    bufs: Vec<Staging>,
}

/// One communicator's proxy: flags, staging pool and thread.
pub(crate) struct Proxy {
    flags: Arc<Pinned>,
    inner: Mutex<Inner>,
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    failure: Arc<Mutex<Option<Error>>>,
    timeout: Duration,
    /// The communicator's internal stream (owned by `state`).
    stream: sys::CUstream,
}

// SAFETY: the stream handle is usable from any thread with the context current; the rest is
// thread-safe. The proxy is used under the communicator's device lock.
unsafe impl Send for Proxy {}

use crate::sync::lock;

/// Waits until `flag` reaches `want`: spins for a millisecond, then sleeps in short steps.
fn wait_flag(flag: &std::sync::atomic::AtomicU32, want: u32, timeout: Duration) -> bool {
    let start = Instant::now();
    loop {
        if reached(load(flag), want) {
            return true;
        }
        let waited = start.elapsed();
        if waited > timeout {
            return false;
        }
        if waited < Duration::from_millis(1) {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

impl Proxy {
    /// Creates the flags and starts the proxy thread (the GPU's context must be current).
    pub(crate) fn new(rank: usize, timeout: Duration, stream: sys::CUstream) -> Result<Proxy> {
        let flags = Arc::new(Pinned::new(3 * SLOTS * 4)?);
        let failure = Arc::new(Mutex::new(None::<Error>));
        let (tx, rx) = channel::<Job>();
        let (f2, fail2) = (flags.clone(), failure.clone());
        let thread = std::thread::Builder::new()
            .name(format!("oxccl-proxy-{rank}"))
            .spawn(move || {
                crate::comm::mark_device_worker();
                for job in rx {
                    let r =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_job(&job, &f2, &fail2, timeout)));
                    if r.is_err() {
                        record(
                            &fail2,
                            Error::internal(format!("rank {rank}: proxy thread panicked on call {}", job.seq)),
                        );
                    }
                    // Release the stream whatever happened.
                    f2.flag(done(job.slot)).store(job.seq, Ordering::Release);
                }
            })
            .map_err(|e| Error::from_io("spawning the CUDA proxy thread", e))?;
        Ok(Proxy {
            flags,
            inner: Mutex::new(Inner { seq: 0, bufs: Vec::new() }),
            tx: Some(tx),
            thread: Some(thread),
            failure,
            timeout,
            stream,
        })
    }

    /// Bytes of pinned host memory this proxy holds (flags and staging buffers).
    pub(crate) fn pinned_bytes(&self) -> usize {
        self.flags.len() + lock(&self.inner).bufs.iter().map(|s| s.mem.len()).sum::<usize>()
    }

    /// The error that stopped this proxy, if any.
    pub(crate) fn failure(&self) -> Option<Error> {
        lock(&self.failure).clone()
    }

    fn is_free(&self, s: &Staging) -> bool {
        s.last.is_none_or(|(seq, slot)| reached(load(self.flags.flag(released(slot))), seq))
    }

    /// Waits (bounded by the timeout) until the proxy thread has finished every job handed to
    /// it, so that host collectives of the calling thread cannot interleave with its own.
    pub(crate) fn drain(&self) -> Result<()> {
        let seq = lock(&self.inner).seq;
        if seq == 0 || wait_flag(self.flags.flag(done(seq as usize % SLOTS)), seq, self.timeout) {
            return Ok(());
        }
        Err(Error::timeout(format!(
            "device collective {seq} still running on the CUDA proxy after {:?} (OXCCL_TIMEOUT_MS)",
            self.timeout
        )))
    }

    /// A staging buffer of at least `bytes`, free of earlier calls (waits for one, bounded).
    fn take_buffer(&self, inner: &mut Inner, bytes: usize) -> Result<usize> {
        let start = Instant::now();
        loop {
            if let Some(i) = inner.bufs.iter().position(|s| s.mem.len() >= bytes && self.is_free(s)) {
                return Ok(i);
            }
            let size = bytes.max(MIN_STAGING).next_power_of_two();
            if inner.bufs.len() < MAX_IN_FLIGHT {
                inner.bufs.push(Staging { mem: Arc::new(Pinned::new(size)?), last: None });
                return Ok(inner.bufs.len() - 1);
            }
            if let Some(i) = inner.bufs.iter().position(|s| self.is_free(s)) {
                // Free but too small: replace it (no GPU work refers to it any more).
                inner.bufs[i] = Staging { mem: Arc::new(Pinned::new(size)?), last: None };
                return Ok(i);
            }
            if start.elapsed() > self.timeout {
                return Err(Error::timeout(format!(
                    "{MAX_IN_FLIGHT} device collectives are still in flight after {:?} (OXCCL_TIMEOUT_MS)",
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Enqueues one all-reduce on its stream (the GPU's context is current).
    ///
    /// # Safety
    /// The call's buffers must be device-accessible addresses of `count` elements, valid until
    /// the stream has run the call; the stream must belong to the current context.
    pub(crate) unsafe fn all_reduce(&self, comm: &Arc<Communicator>, call: DevCall) -> Result<()> {
        let bytes = call.count * call.dtype.size();
        let work = Work::AllReduce { count: call.count, dtype: call.dtype, op: call.op };
        // SAFETY: forwarded from this function's contract.
        self.submit(comm, bytes, work, |seq, slot, buf| unsafe { self.enqueue(call, seq, slot, buf, bytes) })
    }

    /// Enqueues calls (one, or a group's) run by the staged executor on `stream` (the GPU's
    /// context is current).
    ///
    /// # Safety
    /// Each call's buffers must be device-accessible and hold what the collective uses on this
    /// rank, valid until the stream has run them; the stream must belong to the current context.
    pub(crate) unsafe fn staged(&self, comm: &Arc<Communicator>, ops: Vec<DevOp>, stream: sys::CUstream) -> Result<()> {
        let (areas, bytes) = layout(&ops, comm.rank(), comm.size())?;
        let work = Work::Staged { ops: ops.clone(), areas: areas.clone() };
        // SAFETY: forwarded from this function's contract.
        self.submit(comm, bytes, work, |seq, slot, buf| unsafe {
            self.enqueue_staged(&ops, &areas, seq, slot, buf, stream)
        })
    }

    /// Takes a staging buffer and a sequence number, enqueues the stream work with `enqueue`
    /// and hands the job to the proxy thread. A failure makes the proxy unusable (and, once
    /// the sequence number was taken, writes the call's flags from the host); the caller's
    /// device session fails the communicator with the error (see the module docs).
    fn submit(
        &self,
        comm: &Arc<Communicator>,
        bytes: usize,
        work: Work,
        enqueue: impl FnOnce(u32, usize, &Pinned) -> Result<()>,
    ) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(e.context("the CUDA proxy failed earlier"));
        }
        let mut inner = lock(&self.inner);
        let i = match self.take_buffer(&mut inner, bytes) {
            Ok(i) => i,
            Err(e) => {
                // Skipping this call would desynchronise the ranks, as below.
                record(&self.failure, e.clone());
                return Err(e);
            }
        };
        inner.seq = inner.seq.wrapping_add(1);
        let seq = inner.seq;
        let slot = seq as usize % SLOTS;
        let buf = inner.bufs[i].mem.clone();
        inner.bufs[i].last = Some((seq, slot));
        drop(inner);
        let r = enqueue(seq, slot, &buf).and_then(|()| {
            let job = Job { seq, slot, comm: comm.clone(), buf, work };
            let tx = self.tx.as_ref().ok_or_else(|| Error::internal("CUDA proxy is shut down"))?;
            tx.send(job).map_err(|_| Error::internal("CUDA proxy thread is gone"))
        });
        r.map_err(|e| {
            // This rank would skip a collective its peers run: unusable from now on, and the
            // peers are told (by the device session, which fails the communicator) instead of
            // pairing with the next call.
            let e = e.context(format!("rank {}: enqueueing a device collective", comm.rank()));
            record(&self.failure, e.clone());
            let f = &self.flags;
            f.flag(done(slot)).store(seq, Ordering::Release);
            f.flag(ready(slot)).store(seq, Ordering::Release);
            f.flag(released(slot)).store(seq, Ordering::Release);
            e
        })
    }

    /// The stream work of a staged job: D2H of every send area (and device scalar), `ready`,
    /// wait for `done`, H2D of every receive area, `released`.
    ///
    /// # Safety
    /// As [`Proxy::staged`]; `buf` holds the layout.
    unsafe fn enqueue_staged(
        &self,
        ops: &[DevOp],
        areas: &[Area],
        seq: u32,
        slot: usize,
        buf: &Pinned,
        stream: sys::CUstream,
    ) -> Result<()> {
        let host = buf.host();
        // SAFETY: every area lies inside `buf` (the layout sized it); device addresses per this
        // function's contract; flags are device-mapped pinned words.
        unsafe {
            for (o, a) in ops.iter().zip(areas) {
                if a.send_len > 0 {
                    check(
                        sys::cuMemcpyDtoHAsync_v2(host.add(a.send_off).cast(), o.send, a.send_len, stream),
                        "cuMemcpyDtoHAsync(send -> staging)",
                    )?;
                }
                if let Some(Scalar::Device(p)) = o.scale {
                    check(
                        sys::cuMemcpyDtoHAsync_v2(host.add(a.scalar_off).cast(), p, o.dtype.size(), stream),
                        "cuMemcpyDtoHAsync(PreMulSum scalar -> staging)",
                    )?;
                }
            }
            hand_over(&self.flags, stream, slot, seq)?;
            for (o, a) in ops.iter().zip(areas) {
                if a.recv_len > 0 {
                    check(
                        sys::cuMemcpyHtoDAsync_v2(o.recv, host.add(a.recv_off).cast(), a.recv_len, stream),
                        "cuMemcpyHtoDAsync(staging -> recv)",
                    )?;
                }
            }
            write_flag(&self.flags, stream, released(slot), seq, "cuStreamWriteValue32(released)")
        }
    }

    /// The stream work and the proxy job of one call (sequence number and slot taken).
    ///
    /// # Safety
    /// As [`Proxy::all_reduce`].
    unsafe fn enqueue(&self, call: DevCall, seq: u32, slot: usize, buf: &Pinned, bytes: usize) -> Result<()> {
        let DevCall { send, recv, stream, .. } = call;
        // SAFETY: staging holds `bytes`; addresses per this function's contract; flags are
        // device-mapped pinned words.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(buf.host().cast(), send, bytes, stream),
                "cuMemcpyDtoHAsync(send -> staging)",
            )?;
            hand_over(&self.flags, stream, slot, seq)?;
            check(
                sys::cuMemcpyHtoDAsync_v2(recv, buf.host().cast(), bytes, stream),
                "cuMemcpyHtoDAsync(staging -> recv)",
            )?;
            write_flag(&self.flags, stream, released(slot), seq, "cuStreamWriteValue32(released)")
        }
    }
}

fn record(failure: &Mutex<Option<Error>>, e: Error) {
    crate::warn!("{}", e.message());
    let mut f = lock(failure);
    if f.is_none() {
        *f = Some(e);
    }
}

fn run_job(job: &Job, flags: &Pinned, failure: &Mutex<Option<Error>>, timeout: Duration) {
    if lock(failure).is_some() {
        return;
    }
    let rank = job.comm.rank();
    if !wait_flag(flags.flag(ready(job.slot)), job.seq, timeout) {
        record(failure, Error::timeout(format!("rank {rank}: device collective {} never became ready on its stream within {timeout:?} (OXCCL_TIMEOUT_MS)", job.seq)));
        return;
    }
    let p = job.buf.host();
    // SAFETY: the staging buffer holds the job's bytes (sized in `take_buffer`); the GPU
    // finished writing it (ready flag) and will not touch it until `done` is stored.
    let r = unsafe {
        match &job.work {
            Work::AllReduce { count, dtype, op } => job.comm.all_reduce_raw(p, p, *count, *dtype, *op),
            Work::Staged { ops, areas } => run_staged(&job.comm, ops, areas, p),
        }
    };
    if let Err(e) = r {
        let e = e.context(format!("rank {rank}: device collective {}", job.seq));
        if matches!(job.work, Work::Staged { .. }) {
            // A staged job may fail its checks here (a group's unpaired send to itself): the
            // communicator fails, so the error shows in ncclCommGetAsyncError and the peers stop.
            job.comm.fail(e.clone());
        }
        record(failure, e);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Nothing is freed while the internal stream may still copy into or out of it.
        let start = Instant::now();
        // SAFETY: the communicator's live internal stream.
        while unsafe { sys::cuStreamQuery(self.stream) } == sys::CUresult::CUDA_ERROR_NOT_READY {
            if start.elapsed() > self.timeout {
                crate::warn!("CUDA proxy: GPU work still pending at teardown after {:?}; leaking it", self.timeout);
                std::mem::forget(self.flags.clone());
                for s in &lock(&self.inner).bufs {
                    std::mem::forget(s.mem.clone());
                }
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Staging buffers may still be read by H2D copies: wait for their release (bounded).
        let inner = lock(&self.inner);
        for s in &inner.bufs {
            if let Some((seq, slot)) = s.last {
                if !wait_flag(self.flags.flag(released(slot)), seq, self.timeout) {
                    crate::warn!(
                        "CUDA proxy: staging buffer of call {seq} not released after {:.3} s; leaking it",
                        self.timeout.as_secs_f64()
                    );
                    std::mem::forget(s.mem.clone());
                    std::mem::forget(self.flags.clone());
                }
            }
        }
    }
}
