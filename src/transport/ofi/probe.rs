//! [`Inner`] of [`super::Probe`]: a bare endpoint of its own that sends tagged messages to any
//! address, as any process that reaches the fabric can (tests play a stranger with it).

use super::endpoint::Endpoint;
use super::sys;
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::time::{Duration, Instant};

const SLOTS: usize = 64;

/// The endpoint, its send buffers and their contexts.
pub struct Inner {
    ep: Endpoint,
    bufs: Vec<Vec<u8>>,
    ctx: Box<[[usize; 8]]>,
    busy: [bool; SLOTS],
}

impl Inner {
    pub fn open(provider: &str, node: &str) -> Result<Inner> {
        let ep = Endpoint::open(Some(provider), Some(node))?;
        Ok(Inner {
            ep,
            bufs: vec![Vec::new(); SLOTS],
            ctx: vec![[0usize; 8]; SLOTS].into_boxed_slice(),
            busy: [false; SLOTS],
        })
    }

    fn reap(&mut self) -> Result<()> {
        let base = self.ctx.as_ptr() as usize;
        let slot = |p: *mut c_void| (p as usize).wrapping_sub(base) / std::mem::size_of::<[usize; 8]>();
        let c = match self.ep.poll() {
            Ok(c) => c,
            Err(e) => {
                if !e.ctx.is_null() && slot(e.ctx) < SLOTS {
                    self.busy[slot(e.ctx)] = false;
                }
                return Err(Error::system(format!("libfabric: {}", e.why)));
            }
        };
        for p in &c.ctx[..c.n] {
            if slot(*p) < SLOTS {
                self.busy[slot(*p)] = false;
            }
        }
        Ok(())
    }

    pub fn send_all(&mut self, to: &[u8], msgs: &mut dyn Iterator<Item = (u64, Vec<u8>)>) -> Result<usize> {
        let peer = self.ep.insert(to)?;
        let mut sent = 0;
        let deadline = Instant::now() + Duration::from_secs(120);
        for (tag, payload) in msgs {
            let i = loop {
                if let Some(i) = self.busy.iter().position(|b| !b) {
                    break i;
                }
                self.reap()?;
                if Instant::now() > deadline {
                    return Err(Error::timeout("sends did not complete within 120 s"));
                }
            };
            self.bufs[i] = payload;
            loop {
                let ctx: *mut [usize; 8] = &mut self.ctx[i];
                // SAFETY: the buffer and context stay untouched until the completion is read
                // (busy), or the endpoint closes (dropped before them).
                let rc = unsafe {
                    sys::oxccl_ofi_tsend(
                        self.ep.0,
                        self.bufs[i].as_ptr().cast(),
                        self.bufs[i].len(),
                        std::ptr::null_mut(),
                        peer,
                        tag,
                        ctx.cast(),
                    )
                };
                match rc {
                    0 => break,
                    sys::EAGAIN => self.reap()?,
                    rc => return Err(Error::system(format!("fi_tsend: {}", sys::strerror(rc)))),
                }
                if Instant::now() > deadline {
                    return Err(Error::timeout("the provider took no send within 120 s"));
                }
            }
            self.busy[i] = true;
            sent += 1;
        }
        while self.busy.iter().any(|b| *b) && Instant::now() < deadline {
            self.reap()?;
        }
        Ok(sent)
    }
}
