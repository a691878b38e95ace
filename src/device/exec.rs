//! The staged executor: any collective, send/receive or group of them on device buffers, run by
//! the host plans of `crate::algo` on pinned staging copies.
//!
//! One plan, two executors: the plans are the same sans-IO step lists the host path runs; only
//! where their bytes live differs. For a device call the stream (through the proxy, `proxy.rs`)
//! copies each call's send bytes into a staging area (D2H), the proxy thread runs the host plan
//! of the call (or of the whole group, merged as `crate::group` merges host calls) on those
//! areas, and the stream copies each receive area back (H2D). No ring, tree or exchange logic
//! is repeated under `src/device`.
//!
//! Each call gets its own send and receive areas, so in-place calls run out of place on the
//! host and the in-place layouts (all-gather, reduce-scatter, gather, scatter) need no special
//! case: the receive copy writes the same bytes the in-place layout expects. Only the bytes a
//! rank uses are staged (none of a non-root broadcast rank's send buffer, none of a non-root
//! reduce or gather rank's receive buffer). A PreMulSum factor is applied to the staged send
//! bytes before the plan runs; a device-resident scalar is copied into the staging area by the
//! stream, so it is read in stream order, as NCCL reads it.

use crate::algo::Collective;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};

/// The factor of a PreMulSum call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// A value read on the host (at operator creation or at the call).
    Host(f64),
    /// The device address of one element of the call's type, read in stream order.
    Device(u64),
}

/// One collective or point-to-point call on device buffers, as the staged executor runs it.
#[derive(Clone, Copy, Debug)]
pub struct DevOp {
    /// The collective (with its root or peer).
    pub coll: Collective,
    /// Device address of the send buffer (ignored where the collective reads none here).
    pub send: u64,
    /// Device address of the receive buffer (ignored where the collective writes none here).
    pub recv: u64,
    /// NCCL's count argument.
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// Operator (`Sum` for a PreMulSum call, with `scale` set).
    pub op: ReduceOp,
    /// PreMulSum factor.
    pub scale: Option<Scalar>,
}

impl DevOp {
    /// What [`crate::algo::select::device`] needs to know about this call.
    pub(crate) fn shape(&self) -> crate::algo::select::DeviceCall {
        use crate::algo::select::ScalarKind;
        crate::algo::select::DeviceCall {
            coll: self.coll,
            elem: self.dtype.size(),
            empty: self.count == 0,
            scalar: match self.scale {
                None => ScalarKind::None,
                Some(Scalar::Host(_)) => ScalarKind::Host,
                Some(Scalar::Device(_)) => ScalarKind::Device,
            },
        }
    }
}

/// Where one call's bytes sit in the staging buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Area {
    pub send_off: usize,
    pub send_len: usize,
    pub recv_off: usize,
    pub recv_len: usize,
    /// Offset of the staged scalar (device-resident PreMulSum factor).
    pub scalar_off: usize,
}

const ALIGN: usize = 64;

fn up(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// The staging layout of a list of calls of rank `rank` of `n`, and its total size.
pub(crate) fn layout(ops: &[DevOp], rank: usize, n: usize) -> Result<(Vec<Area>, usize)> {
    let mut off = 0usize;
    let mut areas = Vec::with_capacity(ops.len());
    for o in ops {
        let (sc, rc) = o.coll.buffer_counts(rank, n, o.count);
        let send_len = crate::comm::byte_len(sc, o.dtype)?;
        let recv_len = crate::comm::byte_len(rc, o.dtype)?;
        let send_off = off;
        let recv_off = send_off + up(send_len);
        let scalar_off = recv_off + up(recv_len);
        off = scalar_off + if matches!(o.scale, Some(Scalar::Device(_))) { ALIGN } else { 0 };
        areas.push(Area { send_off, send_len, recv_off, recv_len, scalar_off });
    }
    Ok((areas, off))
}

/// Runs the host plans of `ops` on the staging buffer at `base` (the proxy thread, once the
/// stream has filled the send areas): applies PreMulSum factors, then runs the calls as one
/// group (a single collective runs its cached plan as is), as host work of the device call
/// ([`crate::group::host_work::HostWork`]: it does not wait for the communicator's device
/// work in flight, which it is part of).
///
/// # Safety
/// `base` must hold the layout's bytes, with no other access while this runs.
pub(crate) unsafe fn run_staged(comm: &Communicator, ops: &[DevOp], areas: &[Area], base: *mut u8) -> Result<()> {
    let mut prepared = Vec::with_capacity(ops.len());
    for (o, a) in ops.iter().zip(areas) {
        // SAFETY: every area lies inside the staging buffer (the layout sized it).
        let (send, recv) = unsafe { (base.add(a.send_off), base.add(a.recv_off)) };
        if let Some(s) = o.scale {
            let factor = match s {
                Scalar::Host(v) => v,
                Scalar::Device(_) => {
                    // SAFETY: the stream copied one element of the scalar there.
                    let b = unsafe { std::slice::from_raw_parts(base.add(a.scalar_off), o.dtype.size()) };
                    crate::reduce::to_f64(o.dtype, b)[0]
                }
            };
            // SAFETY: the send area holds `send_len` bytes that only this thread touches now.
            let buf = unsafe { std::slice::from_raw_parts_mut(send, a.send_len) };
            crate::reduce::scale(o.dtype, buf, factor);
        }
        let s = if a.send_len > 0 { send.cast_const() } else { std::ptr::null() };
        let r = if a.recv_len > 0 { recv } else { std::ptr::null_mut() };
        // SAFETY: the areas are disjoint, sized by `buffer_counts`, and live until the job
        // finishes (the stream waits for `done` before reusing or copying them out).
        let op = unsafe { comm.prepare(o.coll, s, r, o.count, o.dtype, o.op)? };
        prepared.push(op);
    }
    if prepared.is_empty() {
        return Err(Error::internal("an empty staged device job"));
    }
    // The job is the device work in flight: its group must not wait for it.
    comm.device_host_call().run_group(prepared)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(coll: Collective, count: usize, scale: Option<Scalar>) -> DevOp {
        DevOp { coll, send: 0, recv: 0, count, dtype: DataType::Float32, op: ReduceOp::Sum, scale }
    }

    #[test]
    fn layout_stages_only_what_this_rank_uses() {
        let ops = [
            op(Collective::Broadcast { root: 0 }, 10, None),
            op(Collective::Reduce { root: 0 }, 3, Some(Scalar::Device(8))),
            op(Collective::AllGather, 5, None),
        ];
        let (a, total) = layout(&ops, 1, 4).unwrap();
        // Non-root broadcast: no send bytes; non-root reduce: no receive bytes.
        assert_eq!((a[0].send_len, a[0].recv_len), (0, 40));
        assert_eq!((a[1].send_len, a[1].recv_len), (12, 0));
        assert_eq!((a[2].send_len, a[2].recv_len), (20, 80));
        // Areas are disjoint, aligned and in order; the device scalar has its own slot.
        let mut end = 0;
        for x in &a {
            assert!(x.send_off >= end && x.send_off % ALIGN == 0);
            assert!(x.recv_off >= x.send_off + x.send_len && x.recv_off % ALIGN == 0);
            assert!(x.scalar_off >= x.recv_off + x.recv_len);
            end = x.scalar_off;
        }
        assert_eq!(a[1].scalar_off + ALIGN, a[2].send_off);
        assert!(total >= a[2].recv_off + 80);
    }

    #[test]
    fn staged_group_runs_the_host_plans() {
        // Two in-memory ranks run a broadcast and a scaled reduce on "staging" memory.
        let comms = Communicator::in_memory(2);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(rank, c)| {
                    s.spawn(move || {
                        let ops = [
                            op(Collective::Broadcast { root: 0 }, 4, None),
                            op(Collective::Reduce { root: 1 }, 4, Some(Scalar::Host(0.5))),
                        ];
                        let (areas, total) = layout(&ops, rank, 2).unwrap();
                        let mut mem = vec![0u64; total.div_ceil(8)];
                        let base = mem.as_mut_ptr().cast::<u8>();
                        let put = |off: usize, v: &[f32]| {
                            // SAFETY: inside `mem` (the layout's size).
                            unsafe {
                                std::ptr::copy_nonoverlapping(v.as_ptr().cast::<u8>(), base.add(off), v.len() * 4)
                            }
                        };
                        if rank == 0 {
                            put(areas[0].send_off, &[1.0, 2.0, 3.0, 4.0]);
                        }
                        put(areas[1].send_off, &[10.0 * (rank as f32 + 1.0); 4]);
                        // SAFETY: `mem` holds the layout.
                        unsafe { run_staged(c, &ops, &areas, base) }.unwrap();
                        let get = |off: usize| -> Vec<f32> {
                            // SAFETY: inside `mem`.
                            let b = unsafe { std::slice::from_raw_parts(base.add(off), 16) };
                            b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                        };
                        let mut out = get(areas[0].recv_off);
                        if rank == 1 {
                            out.extend(get(areas[1].recv_off));
                        }
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results[0], [1.0, 2.0, 3.0, 4.0]);
        // Reduce at root 1: 0.5 * 10 + 0.5 * 20 = 15 per element.
        assert_eq!(results[1], [1.0, 2.0, 3.0, 4.0, 15.0, 15.0, 15.0, 15.0]);
    }
}
