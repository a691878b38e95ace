//! `ncclGroupStart` / `ncclGroupEnd`: per-thread, nestable groups.
//!
//! Between the outermost start and its end, every call on this thread is checked at once
//! (errors are returned by that call, which is then left out) and queued; the outermost end
//! runs the queue as one group ([`crate::group::run`]) and returns its result.

use super::*;
use crate::coll::Op;

#[derive(Default)]
struct State {
    depth: usize,
    ops: Vec<(Arc<Communicator>, Op<'static>)>,
}

thread_local! {
    static GROUP: RefCell<State> = RefCell::new(State::default());
}

/// How deeply groups are nested on this thread (0: no group open).
pub(crate) fn depth() -> usize {
    GROUP.with(|g| g.borrow().depth)
}

/// Runs `op` now, or queues it when a group is open on this thread.
pub(crate) fn submit(comm: Arc<Communicator>, op: Op<'static>) -> Result<()> {
    let queued = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Some(op);
        }
        g.ops.push((comm.clone(), op));
        None
    });
    match queued {
        Some(op) => comm.run(op),
        None => Ok(()),
    }
}

/// Opens a group (groups nest; only the outermost end runs the operations).
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    boundary("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(())
    })
}

/// Closes a group; the outermost end runs every operation queued since its start.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    boundary("ncclGroupEnd", || {
        let ops = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(Error::invalid_usage("ncclGroupEnd without a matching ncclGroupStart"));
            }
            g.depth -= 1;
            Ok(if g.depth == 0 { std::mem::take(&mut g.ops) } else { Vec::new() })
        })?;
        if ops.is_empty() {
            return Ok(());
        }
        let (comms, ops): (Vec<Arc<Communicator>>, Vec<Op<'static>>) = ops.into_iter().unzip();
        let r = crate::group::run(comms.iter().map(|c| &**c).zip(ops).collect());
        if depth() == 0 {
            super::premul::release();
        }
        r
    })
}
