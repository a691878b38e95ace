//! The flat C API of `shim.c` (compiled by build.rs where libfabric's headers exist): the few
//! libfabric calls the ofi transport makes, with libfabric itself loaded at run time.

use std::ffi::{c_char, c_int, c_void, CStr};

/// One endpoint of a NIC, shared by every peer (opaque; `shim.c`'s `struct oxccl_ofi`).
#[repr(C)]
pub struct Ep {
    _opaque: [u8; 0],
}

extern "C" {
    pub fn oxccl_ofi_load(err: *mut c_char, errlen: usize) -> c_int;
    pub fn oxccl_ofi_providers(prov: *const c_char, out: *mut c_char, outlen: usize) -> c_int;
    pub fn oxccl_ofi_open(prov: *const c_char, node: *const c_char, err: *mut c_char, errlen: usize) -> *mut Ep;
    pub fn oxccl_ofi_close(ep: *mut Ep);
    pub fn oxccl_ofi_provider(ep: *const Ep) -> *const c_char;
    pub fn oxccl_ofi_wait_fd(ep: *const Ep) -> c_int;
    pub fn oxccl_ofi_mr_local(ep: *const Ep) -> c_int;
    pub fn oxccl_ofi_directed(ep: *const Ep) -> c_int;
    pub fn oxccl_ofi_close_unsafe(ep: *const Ep) -> c_int;
    pub fn oxccl_ofi_max_msg(ep: *const Ep) -> usize;
    pub fn oxccl_ofi_name(ep: *mut Ep, buf: *mut c_void, len: *mut usize) -> c_int;
    pub fn oxccl_ofi_insert(ep: *mut Ep, addr: *const c_void, peer: *mut u64) -> c_int;
    pub fn oxccl_ofi_mr_reg(
        ep: *mut Ep,
        buf: *mut c_void,
        len: usize,
        desc: *mut *mut c_void,
        mr: *mut *mut c_void,
    ) -> c_int;
    pub fn oxccl_ofi_mr_close(mr: *mut c_void);
    pub fn oxccl_ofi_tsend(
        ep: *mut Ep,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        peer: u64,
        tag: u64,
        ctx: *mut c_void,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub fn oxccl_ofi_trecv(
        ep: *mut Ep,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        peer: u64,
        tag: u64,
        ignore: u64,
        ctx: *mut c_void,
    ) -> c_int;
    pub fn oxccl_ofi_cancel(ep: *mut Ep, ctx: *mut c_void) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub fn oxccl_ofi_poll(
        ep: *mut Ep,
        ctx: *mut *mut c_void,
        len: *mut usize,
        tag: *mut u64,
        max: c_int,
        errctx: *mut *mut c_void,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    pub fn oxccl_ofi_trywait(ep: *mut Ep) -> c_int;
    pub fn oxccl_ofi_strerror(rc: c_int) -> *const c_char;
}

/// libfabric's `FI_EAGAIN`, as the shim returns it (negated).
pub const EAGAIN: c_int = -11;
/// libfabric's `FI_ECANCELED`, as the shim returns it (negated).
pub const ECANCELED: c_int = -125;
/// libfabric's `FI_ADDR_UNSPEC`: a receive from anyone.
pub const ADDR_UNSPEC: u64 = u64::MAX;

/// The text of a NUL-terminated buffer the shim filled.
pub fn text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// libfabric's text for a (negative) return code.
pub fn strerror(rc: c_int) -> String {
    // SAFETY: the shim returns a static string of libfabric's (loaded before any call that
    // can return a code).
    let p = unsafe { oxccl_ofi_strerror(rc) };
    if p.is_null() {
        return format!("error {rc}");
    }
    // SAFETY: non-null and NUL-terminated (libfabric's static table).
    format!("{} ({rc})", unsafe { CStr::from_ptr(p) }.to_string_lossy())
}
