//! Locking that outlives a panic: a thread that panicked while holding a lock leaves data that
//! every user of these locks keeps consistent step by step (tables, counters, flags), so the
//! next holder takes the lock as it is rather than spreading the panic.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data as it is when another thread panicked while holding it.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
