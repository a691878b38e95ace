//! [`Endpoint`]: a libfabric reliable-datagram endpoint (fabric, domain, completion queue,
//! address vector and endpoint, opened and closed together by the shim). One per NIC and
//! process, shared by every peer through its address vector ([`super::rail::Rail`]).

use super::sys;
use crate::error::{Error, Result};
use std::ffi::{c_void, CString};

/// Completions read at most at once by [`Endpoint::poll`].
pub const POLL_MAX: usize = 16;

/// What one [`Endpoint::poll`] read from the completion queue.
pub struct Completions {
    /// The operation context of each completion (the first `n`).
    pub ctx: [*mut c_void; POLL_MAX],
    /// The received length of each completion.
    pub len: [usize; POLL_MAX],
    /// The tag of each completion.
    pub tag: [u64; POLL_MAX],
    /// How many were read.
    pub n: usize,
}

/// An error completion read by [`Endpoint::poll`].
pub struct PollError {
    /// The failed operation's context (null where the provider gave none).
    pub ctx: *mut c_void,
    /// The (negative) return code.
    pub rc: i32,
    /// The provider's text.
    pub why: String,
}

/// An endpoint owned here: closed when dropped.
pub struct Endpoint(pub(super) *mut sys::Ep);

// SAFETY: the endpoint is used by one thread at a time (its rail's mutex; a test owns it
// alone), which libfabric's FI_THREAD_DOMAIN allows.
unsafe impl Send for Endpoint {}

impl Endpoint {
    /// Reads up to [`POLL_MAX`] completions (which also makes the provider progress), or the
    /// first error completion.
    pub fn poll(&self) -> std::result::Result<Completions, PollError> {
        let mut c = Completions { ctx: [std::ptr::null_mut(); POLL_MAX], len: [0; POLL_MAX], tag: [0; POLL_MAX], n: 0 };
        let mut errctx = std::ptr::null_mut::<c_void>();
        let mut err = [0u8; 512];
        // SAFETY: a valid endpoint; the arrays hold POLL_MAX entries each; `err` is writable
        // for its length.
        let n = unsafe {
            sys::oxccl_ofi_poll(
                self.0,
                c.ctx.as_mut_ptr(),
                c.len.as_mut_ptr(),
                c.tag.as_mut_ptr(),
                POLL_MAX as i32,
                &mut errctx,
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if n < 0 {
            return Err(PollError { ctx: errctx, rc: n, why: sys::text(&err) });
        }
        c.n = n as usize;
        Ok(c)
    }

    /// Opens an endpoint of `provider` (`None`: libfabric's first that is not host-local),
    /// bound to the IP address `node` when given.
    pub fn open(provider: Option<&str>, node: Option<&str>) -> Result<Endpoint> {
        let prov = provider.map(|p| CString::new(p).unwrap_or_default());
        let node = node.map(|n| CString::new(n).unwrap_or_default());
        let mut err = [0u8; 512];
        // SAFETY: the strings are NUL-terminated and outlive the call; `err` is writable for
        // its length. libfabric was loaded by the caller (`super::loaded`).
        let ep = unsafe {
            sys::oxccl_ofi_open(
                prov.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                node.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if ep.is_null() {
            return Err(Error::system(format!("libfabric: {}", sys::text(&err))));
        }
        Ok(Endpoint(ep))
    }

    /// The provider's name (`tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`, ...).
    pub fn provider(&self) -> String {
        // SAFETY: a valid endpoint; the name is NUL-terminated and lives as long as it.
        unsafe { std::ffi::CStr::from_ptr(sys::oxccl_ofi_provider(self.0)) }.to_string_lossy().into_owned()
    }

    /// Largest message the provider takes.
    pub fn max_msg(&self) -> usize {
        // SAFETY: a valid endpoint.
        unsafe { sys::oxccl_ofi_max_msg(self.0) }
    }

    /// This endpoint's address, to hand to the peer.
    pub fn name(&mut self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: a valid endpoint; `buf` is writable for `len` bytes.
        let rc = unsafe { sys::oxccl_ofi_name(self.0, buf.as_mut_ptr().cast(), &mut len) };
        if rc != 0 {
            return Err(Error::system(format!("libfabric fi_getname: {}", sys::strerror(rc))));
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// Whether receives can be directed to one source (`FI_DIRECTED_RECV` granted).
    pub fn directed(&self) -> bool {
        // SAFETY: a valid endpoint.
        unsafe { sys::oxccl_ofi_directed(self.0) != 0 }
    }

    /// Whether closing this endpoint may crash the process (libfabric before 1.18 with
    /// `tcp;ofi_rxm`: see docs/RDMA.md).
    pub fn close_unsafe(&self) -> bool {
        // SAFETY: a valid endpoint.
        unsafe { sys::oxccl_ofi_close_unsafe(self.0) != 0 }
    }

    /// Inserts `addr` (a peer's [`Endpoint::name`]) into the address vector; returns its handle.
    /// The address must be as long as this endpoint's own (the ends share a provider).
    pub fn insert(&mut self, addr: &[u8]) -> Result<u64> {
        let own = self.name()?.len();
        if addr.len() != own {
            return Err(Error::system(format!(
                "libfabric: the peer's address is {} bytes, the provider's are {own}",
                addr.len()
            )));
        }
        let mut peer = sys::ADDR_UNSPEC;
        // SAFETY: a valid endpoint; `addr` holds as many bytes as the provider's address format
        // (checked above against this endpoint's own name).
        let rc = unsafe { sys::oxccl_ofi_insert(self.0, addr.as_ptr().cast(), &mut peer) };
        if rc != 0 {
            return Err(Error::system(format!("libfabric fi_av_insert: {}", sys::strerror(rc))));
        }
        Ok(peer)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: the endpoint is valid and closed once; nothing uses it afterwards.
        unsafe { sys::oxccl_ofi_close(self.0) }
    }
}
