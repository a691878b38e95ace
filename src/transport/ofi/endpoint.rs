//! [`Endpoint`]: a libfabric reliable-datagram endpoint to one peer (fabric, domain,
//! completion queue, address vector and endpoint, opened and closed together by the shim).

use super::sys;
use crate::error::{Error, Result};
use std::ffi::CString;

/// An endpoint owned here: closed when dropped.
pub struct Endpoint(pub(super) *mut sys::Ep);

// SAFETY: the endpoint is used by one thread at a time (the link's mutex; the handshake owns
// it alone), which libfabric's FI_THREAD_DOMAIN allows.
unsafe impl Send for Endpoint {}

impl Endpoint {
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

    /// Makes `addr` (the peer's [`Endpoint::name`]) this endpoint's destination; an address
    /// whose length is not this provider's (both ends use the same one) is refused before
    /// libfabric reads it.
    pub fn insert(&mut self, addr: &[u8]) -> Result<()> {
        let want = self.name()?.len();
        if addr.len() != want {
            return Err(Error::remote(format!(
                "the peer's libfabric address is {} bytes, this provider's ({}) are {want}: refused",
                addr.len(),
                self.provider()
            )));
        }
        // SAFETY: a valid endpoint; `addr` holds exactly as many bytes as this provider's
        // addresses (checked above), which is what fi_av_insert reads.
        let rc = unsafe { sys::oxccl_ofi_insert(self.0, addr.as_ptr().cast()) };
        if rc != 0 {
            return Err(Error::system(format!("libfabric fi_av_insert: {}", sys::strerror(rc))));
        }
        Ok(())
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: the endpoint is valid and closed once; nothing uses it afterwards.
        unsafe { sys::oxccl_ofi_close(self.0) }
    }
}
