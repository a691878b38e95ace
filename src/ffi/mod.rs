//! The C ABI: every `extern "C"` function of `nccl.h` that oxccl implements.
//!
//! Rules kept by every function here: the body runs inside `boundary`, so a panic becomes
//! `ncclInternalError` with a message and never crosses into C; enum arguments are validated
//! as integers; output parameters are written only on success; communicator handles are
//! checked against a registry of live communicators, so a destroyed or garbage handle gives
//! `ncclInvalidArgument` instead of undefined behaviour.
#![allow(non_snake_case)]

pub mod coll;
pub mod collconfig;
pub mod comm;
pub mod config;
pub mod extra;
pub mod group;
pub mod premul;
pub mod profiling;
pub mod types;
pub mod unsupported;

use crate::comm::Communicator;
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

/// Registers a communicator and returns its handle.
pub(crate) fn register(c: Communicator) -> ncclComm_t {
    let arc = Arc::new(c);
    let handle = Arc::as_ptr(&arc) as *mut ncclComm;
    registry().lock().unwrap_or_else(|e| e.into_inner()).insert(handle as usize, arc);
    handle
}

/// Registers a communicator under a handle chosen earlier (a nonblocking init's token).
pub(crate) fn register_at(handle: usize, c: Communicator) {
    registry().lock().unwrap_or_else(|e| e.into_inner()).insert(handle, Arc::new(c));
}

/// Looks up a live communicator by handle.
pub(crate) fn lookup(comm: ncclComm_t) -> Result<Arc<Communicator>> {
    if comm.is_null() {
        return Err(Error::invalid_argument("comm is NULL"));
    }
    registry().lock().unwrap_or_else(|e| e.into_inner()).get(&(comm as usize)).cloned().ok_or_else(|| {
        match config::pending_reason(comm) {
            Some(why) => Error::invalid_usage(why),
            None => Error::invalid_argument(format!(
                "comm {comm:p} is not a live communicator (destroyed already, or never created)"
            )),
        }
    })
}

/// Removes a communicator from the registry (destroy/abort).
pub(crate) fn unregister(comm: ncclComm_t) -> Result<Arc<Communicator>> {
    lookup(comm)?;
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(comm as usize))
        .ok_or_else(|| Error::invalid_argument(format!("comm {comm:p} was destroyed concurrently")))
}

/// Records `msg` as the process-wide last error (and logs it at WARN).
pub(crate) fn set_last_error(msg: &str) {
    crate::warn!("{msg}");
    *global_last_error().lock().unwrap_or_else(|e| e.into_inner()) = msg.to_string();
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

/// Writes `v` through an output pointer, or fails on NULL (write happens only on success).
pub(crate) fn out<T>(p: *mut T, name: &str) -> Result<&'static mut T> {
    if p.is_null() {
        return Err(Error::invalid_argument(format!("{name} is NULL")));
    }
    // SAFETY: non-null; the C caller promises it points to a writable T for the call.
    Ok(unsafe { &mut *p })
}

/// The process-wide last error text.
pub(crate) fn last_error_text() -> String {
    global_last_error().lock().unwrap_or_else(|e| e.into_inner()).clone()
}
