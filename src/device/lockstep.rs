//! A group's device calls on several communicators of one GPU, enqueued in lockstep.
//!
//! CUDA orders the work of different streams nowhere, and when they share a hardware queue
//! (`CUDA_DEVICE_MAX_CONNECTIONS=1`, more streams than connections, or both on one stream) the
//! queue runs their work in the order it was enqueued. A barrier is a write into each peer's
//! flag followed by waits on this rank's flags (`mesh.rs`); enqueued one communicator after the
//! other, rank 0's wait would sit in front of rank 1's write in the queue and never return.
//!
//! So when one thread's group holds calls of two or more communicators on one GPU
//! ([`enqueue_group`]), each communicator's part is enqueued by a thread of its own, and every
//! barrier of those threads meets the others between its writes and its waits
//! ([`arrive`]): the k-th waits of any of them are enqueued only after the k-th writes of all
//! of them (or after a thread finished its part and left), so every wait follows in the queue
//! the write it waits for, whatever the number of hardware queues. The threads wait only for
//! each other's enqueue (all driven by the caller's one group), never for another caller or a
//! peer process, and a meeting is bounded (a part that never reaches it, such as a mismatched
//! group, is no longer waited for after [`MEET_LIMIT`], with a WARN).

use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The longest a barrier waits for the other threads of its group to reach the same barrier.
pub(crate) const MEET_LIMIT: Duration = Duration::from_secs(2);

/// The meeting point of one group's enqueue threads.
struct Lockstep {
    /// (round, arrived in this round, threads still enqueueing).
    state: Mutex<(u64, usize, usize)>,
    cv: Condvar,
}

thread_local! {
    static MINE: RefCell<Option<Arc<Lockstep>>> = const { RefCell::new(None) };
}

impl Lockstep {
    fn arrive(&self) {
        let mut s = crate::sync::lock(&self.state);
        let round = s.0;
        s.1 += 1;
        if s.1 >= s.2 {
            *s = (round + 1, 0, s.2);
            self.cv.notify_all();
            return;
        }
        let start = Instant::now();
        while s.0 == round {
            let left = MEET_LIMIT.saturating_sub(start.elapsed());
            if left.is_zero() {
                crate::warn!(
                    "device group: a barrier's enqueue waited {MEET_LIMIT:?} for the group's other communicators to reach \
                     theirs; going on (their calls differ?)"
                );
                // Leave this round as if released: later arrivals count for the next one.
                s.1 = s.1.saturating_sub(1);
                return;
            }
            s = self.cv.wait_timeout(s, left).map(|r| r.0).unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn leave(&self) {
        let mut s = crate::sync::lock(&self.state);
        s.2 -= 1;
        if s.1 > 0 && s.1 >= s.2 {
            let round = s.0;
            *s = (round + 1, 0, s.2);
            self.cv.notify_all();
        }
    }
}

/// Called by every barrier between its writes and its waits: on a thread of
/// [`enqueue_group`], waits until every other thread of the group wrote its flags of the same
/// barrier (or left); elsewhere nothing.
pub(super) fn arrive() {
    let ls = MINE.with(|m| m.borrow().clone());
    if let Some(ls) = ls {
        ls.arrive();
    }
}

/// A part of a group: something to run on a thread of its own.
pub(crate) struct Part<'a>(pub(crate) Box<dyn FnOnce() -> crate::error::Result<()> + Send + 'a>);

/// Runs `parts` (each one communicator's part of a group on one GPU), each on a thread of its
/// own with its barriers in lockstep with the others'; the results in order.
pub(crate) fn enqueue_group(parts: Vec<Part<'_>>) -> Vec<crate::error::Result<()>> {
    let ls = Arc::new(Lockstep { state: Mutex::new((0, 0, parts.len())), cv: Condvar::new() });
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|p| {
                let ls = ls.clone();
                s.spawn(move || {
                    MINE.with(|m| *m.borrow_mut() = Some(ls.clone()));
                    let r = (p.0)();
                    MINE.with(|m| *m.borrow_mut() = None);
                    ls.leave();
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(crate::error::Error::internal("enqueueing a device group part panicked")))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_thread_writes_before_any_waits_and_a_thread_that_leaves_early_releases_the_rest() {
        // Thread k "writes" (counts) k + 1 barriers; after each meeting every thread still in the
        // group has written as many as the round number.
        let writes: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        let parts: Vec<Part<'_>> = (0..3)
            .map(|k| {
                let writes = &writes;
                Part(Box::new(move || {
                    for round in 0..=k {
                        writes[k].fetch_add(1, Ordering::SeqCst);
                        arrive();
                        for (j, w) in writes.iter().enumerate().filter(|&(j, _)| j >= round) {
                            assert!(w.load(Ordering::SeqCst) > round, "thread {k}, round {round}: thread {j} behind");
                        }
                    }
                    Ok(())
                }))
            })
            .collect();
        let start = Instant::now();
        assert!(enqueue_group(parts).into_iter().all(|r| r.is_ok()));
        assert!(start.elapsed() < MEET_LIMIT, "a meeting timed out instead of being released");
    }
}
