//! Memory and registration calls that host memory makes simple: ncclMemAlloc / ncclMemFree
//! (device memory, or page-aligned shareable host memory that the host arena reads in place:
//! [`crate::call::memory`]), ncclCommRegister / ncclCommDeregister (a checked handle; host
//! buffers need no registration), ncclCommMemStats (the GPU memory of the device state), and the
//! logging knob ncclResetDebugInit.

use super::*;
use std::ffi::c_void;
use std::os::raw::c_int;

fn registrations() -> &'static Mutex<HashMap<usize, (usize, usize)>> {
    static R: OnceLock<Mutex<HashMap<usize, (usize, usize)>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Allocates `size` bytes for buffers: device memory of the current context's GPU when the
/// application uses CUDA (as NCCL), page-aligned shareable host memory otherwise: the other
/// ranks of the host read buffers in it where they lie (`OXCCL_LOCAL_REGISTER`). Free with `ncclMemFree`.
#[no_mangle]
pub extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    boundary("ncclMemAlloc", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(ptr, "ptr") }?;
        dst.write(crate::call::memory::alloc(size)?);
        Ok(())
    })
}

/// Frees memory from `ncclMemAlloc` (NULL is a no-op; any other pointer is an error).
///
/// Raw pointers as NCCL's contract has them: `ptr` is NULL or came from `ncclMemAlloc`.
#[no_mangle]
pub extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    boundary("ncclMemFree", || crate::call::memory::free(ptr))
}

/// Registers `buff` (`size` bytes) with `comm` and returns a handle for `ncclCommDeregister`.
/// The handle only records the range: host buffers need no registration, and device buffers
/// are not registered either (no zero-copy path uses registrations: device calls copy through
/// the CUDA IPC region or pinned staging whether or not a buffer was registered).
#[no_mangle]
pub extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    boundary("ncclCommRegister", || {
        lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(handle, "handle") }?;
        if buff.is_null() && size > 0 {
            return Err(Error::invalid_argument("buff is NULL"));
        }
        let token = super::next_handle();
        crate::sync::lock(registrations()).insert(token, (comm as usize, buff as usize));
        dst.write(token as *mut c_void);
        Ok(())
    })
}

/// Releases a handle from `ncclCommRegister` on the same communicator.
#[no_mangle]
pub extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    boundary("ncclCommDeregister", || {
        lookup(comm)?;
        let mut regs = crate::sync::lock(registrations());
        match regs.get(&(handle as usize)) {
            Some(&(c, buff)) if c == comm as usize => {
                regs.remove(&(handle as usize));
                // The buffer's cached classification goes with it (its memory may be freed next).
                crate::call::memory::forget_buffer(buff as *mut c_void);
                Ok(())
            }
            Some(_) => {
                Err(Error::invalid_argument(format!("handle {handle:p} was registered with another communicator")))
            }
            None => Err(Error::invalid_argument(format!("handle {handle:p} is not a live registration"))),
        }
    })
}

/// Memory statistics (`ncclCommMemStat_t`): 0 `ncclStatGpuMemSuspend` and 1
/// `ncclStatGpuMemSuspended` are 0 (nothing is suspendable); 2 `ncclStatGpuMemPersist` and 3
/// `ncclStatGpuMemTotal` are the bytes of GPU memory the communicator holds (its CUDA IPC
/// region, once a device call made one; pinned host staging is host memory and not counted).
#[no_mangle]
pub extern "C" fn ncclCommMemStats(comm: ncclComm_t, stat: c_int, value: *mut u64) -> ncclResult_t {
    boundary("ncclCommMemStats", || {
        lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(value, "value") }?;
        if !(0..=3).contains(&stat) {
            return Err(Error::invalid_argument(format!("invalid memory statistic {stat}")));
        }
        let held = match stat {
            2 | 3 => lookup(comm).map(|c| crate::call::memory::device_bytes(&c))?,
            _ => 0,
        };
        dst.write(held);
        Ok(())
    })
}

/// Re-reads the logging settings (deprecated in NCCL; oxccl reads them at each use: no-op).
#[no_mangle]
pub extern "C" fn ncclResetDebugInit() {}
