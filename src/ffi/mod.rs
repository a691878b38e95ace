//! The C ABI: every `extern "C"` function of `nccl.h` that oxccl implements.
//!
//! Rules kept by every function here: the body runs inside `boundary`, so a panic becomes
//! `ncclInternalError` with a message and never crosses into C; enum arguments are validated
//! as integers; output parameters are written only on success; communicator handles are
//! checked against a registry of live communicators, so a destroyed or garbage handle gives
//! `ncclInvalidArgument` instead of undefined behaviour.
//!
//! Handles are never reused: every handle given to C (communicators, pending communicators,
//! buffer registrations) is a fresh number from `next_handle`, not an address, so a handle
//! kept after destroy can never name a communicator created later.
#![allow(non_snake_case)]
// Every public function here is a C entry point (`extern "C"`, called from C with NCCL's
// pointer contract): they check each pointer for NULL and reach it only through the
// `unsafe fn` helpers below, each call with a SAFETY note. Marking them `unsafe extern` would
// change nothing for C callers and would hide them from build.rs's `pnccl*` alias generation.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod coll;
pub mod collconfig;
pub mod comm;
pub mod config;
pub mod extra;
pub mod group;
pub mod oxccl_ext;
pub mod premul;
pub mod profiling;
pub mod types;
pub mod unsupported;

use crate::call::Communicator;
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CString;
use std::os::raw::c_char;
use std::sync::{Arc, Mutex, OnceLock};
pub use types::*;

fn registry() -> &'static Mutex<HashMap<usize, Arc<Communicator>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<Communicator>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

fn global_last_error() -> &'static Mutex<String> {
    static E: OnceLock<Mutex<String>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(String::new()))
}

thread_local! {
    static RETURNED: RefCell<CString> = RefCell::new(CString::default());
}

/// A handle for C that no earlier call returned and no later call will: a process-wide counter
/// (aligned like a pointer, far from NULL and from small integers), never an address.
pub(crate) fn next_handle() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0x0c0c_0000);
    NEXT.fetch_add(16, Ordering::Relaxed)
}

/// Registers a communicator and returns its (never reused) handle.
pub(crate) fn register(c: Communicator) -> ncclComm_t {
    let handle = next_handle();
    register_at(handle, c);
    handle as ncclComm_t
}

/// Registers a communicator under a handle chosen earlier (a nonblocking init's token).
pub(crate) fn register_at(handle: usize, c: Communicator) {
    crate::sync::lock(registry()).insert(handle, Arc::new(c));
}

/// Looks up a live communicator by handle.
pub(crate) fn lookup(comm: ncclComm_t) -> Result<Arc<Communicator>> {
    if comm.is_null() {
        return Err(Error::invalid_argument("comm is NULL"));
    }
    let live = || crate::sync::lock(registry()).get(&(comm as usize)).cloned();
    if let Some(c) = live() {
        return Ok(c);
    }
    // A nonblocking communicator built meanwhile is registered now (the registry is not
    // locked here: registering takes its lock).
    match config::pending_reason(comm) {
        Some(why) => Err(Error::invalid_usage(why)),
        None => live().ok_or_else(|| {
            Error::invalid_argument(format!(
                "comm {comm:p} is not a live communicator (destroyed already, or never created)"
            ))
        }),
    }
}

/// Removes a communicator from the registry (destroy/abort), with its PreMulSum operators, and
/// marks it closed: calls on it still queued in an open group then fail with
/// `ncclInvalidUsage` instead of running on a destroyed communicator.
pub(crate) fn unregister(comm: ncclComm_t) -> Result<Arc<Communicator>> {
    lookup(comm)?;
    let c = crate::sync::lock(registry())
        .remove(&(comm as usize))
        .ok_or_else(|| Error::invalid_argument(format!("comm {comm:p} was destroyed concurrently")))?;
    premul::forget(comm);
    c.close();
    Ok(c)
}

/// Records `msg` as the process-wide last error (and logs it at WARN).
pub(crate) fn set_last_error(msg: &str) {
    crate::warn!("{msg}");
    *crate::sync::lock(global_last_error()) = msg.to_string();
}

/// Returns a C string valid until the next call of a text-returning function on this thread.
pub(crate) fn thread_cstr(s: &str) -> *const c_char {
    let c = CString::new(s.replace('\0', " ")).unwrap_or_default();
    RETURNED.with(|r| {
        *r.borrow_mut() = c;
        r.borrow().as_ptr()
    })
}

/// Runs an ABI function body: converts errors to `ncclResult_t`, records their message, and
/// turns a panic into `ncclInternalError`.
pub(crate) fn boundary(name: &str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => ncclResult_t::ncclSuccess,
        Ok(Err(e)) => {
            set_last_error(&format!("{name}: {}", e.message()));
            ncclResult_t::from_code(e.code())
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_last_error(&format!("{name}: internal error (panic): {what}"));
            ncclResult_t::ncclInternalError
        }
    }
}

/// A C caller's output parameter: a non-null pointer that [`out`]'s caller vouched for.
/// Writing through it needs no reference to the caller's memory (which may be uninitialised).
pub(crate) struct Out<T>(std::ptr::NonNull<T>);

impl<T> Clone for Out<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Out<T> {}

impl<T> Out<T> {
    /// Stores `v` in the caller's object (its old contents are not read nor dropped).
    pub(crate) fn write(self, v: T) {
        // SAFETY: `out`'s caller guaranteed the pointer is aligned and writable for a `T` for
        // as long as this slot is used (the ABI call).
        unsafe { self.0.as_ptr().write(v) }
    }
}

/// The output parameter `p` (called `name` in messages), or `ncclInvalidArgument` when it is
/// NULL. Write to it only once the call has succeeded, so that outputs change only on success.
///
/// # Safety
/// `p` must be NULL or aligned and writable for a `T` for as long as the returned slot is used.
pub(crate) unsafe fn out<T>(p: *mut T, name: &str) -> Result<Out<T>> {
    std::ptr::NonNull::new(p).map(Out).ok_or_else(|| Error::invalid_argument(format!("{name} is NULL")))
}

/// The process-wide last error text.
pub(crate) fn last_error_text() -> String {
    crate::sync::lock(global_last_error()).clone()
}
