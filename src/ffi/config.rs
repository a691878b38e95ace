//! `ncclConfig_t` and the communicator constructors that take it: ncclCommInitRankConfig,
//! ncclCommInitRankScalable, ncclCommInitAll, ncclCommSplit, ncclCommShrink, ncclCommGrow
//! (with ncclCommGetUniqueId), plus ncclCommFinalize and ncclCommGetAsyncError.
//!
//! Nonblocking communicators (`config.blocking = 0`): the constructor writes the handle at once,
//! returns `ncclInProgress` and the call layer builds the communicator on a worker thread
//! ([`crate::call::create`]); the caller polls
//! `ncclCommGetAsyncError` until it reports something other than `ncclInProgress`. Until then
//! the handle is *pending*: other calls on it fail with `ncclInvalidUsage`, `ncclCommAbort` /
//! `ncclCommDestroy` cancel it at once (the worker drops what it built). Collectives on a
//! nonblocking communicator complete before they return (`ncclSuccess`), which NCCL's
//! nonblocking contract allows ("may return ncclInProgress").

use super::*;
use crate::call::UniqueId;
use crate::call::{CommInit, Created, InitState};
use std::os::raw::c_int;

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): a config field the caller left unset.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`: the value of `ncclConfig_t.magic` set by `NCCL_CONFIG_INITIALIZER`.
pub const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_SHRINK_ABORT`: `ncclCommShrink` aborts the parent first (the header's macro is in
/// cbindgen.toml, so this one stays private).
const NCCL_SHRINK_ABORT: c_int = 1;
/// `NCCL_SPLIT_NOCOLOR`: the color of a rank that joins no child in `ncclCommSplit`.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;

/// Communicator options (`ncclConfig_t`), laid out exactly as NCCL 2.32's `ncclConfig_v23100`.
/// oxccl acts on `blocking`; it accepts and ignores the GPU tuning fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    /// `sizeof(ncclConfig_t)` of the caller's header (older callers pass a shorter struct).
    pub size: usize,
    /// Must be `NCCL_API_MAGIC`.
    pub magic: u32,
    /// The caller's `NCCL_VERSION_CODE`.
    pub version: u32,
    /// 0: nonblocking communicator; 1 or unset: blocking.
    pub blocking: c_int,
    /// GPU tuning (ignored).
    pub cgaClusterSize: c_int,
    /// GPU tuning (ignored).
    pub minCTAs: c_int,
    /// GPU tuning (ignored).
    pub maxCTAs: c_int,
    /// Network plugin name (ignored).
    pub netName: *const c_char,
    /// Resource sharing with the parent on split (ignored: children have their own links).
    pub splitShare: c_int,
    /// Network traffic class (ignored).
    pub trafficClass: c_int,
    /// Communicator name for logs (ignored).
    pub commName: *const c_char,
    /// CollNet (ignored).
    pub collnetEnable: c_int,
    /// CTA policy (ignored).
    pub CTAPolicy: c_int,
    /// Resource sharing with the parent on shrink (ignored).
    pub shrinkShare: c_int,
    /// NVLS (ignored).
    pub nvlsCTAs: c_int,
    /// Network channels (ignored).
    pub nChannelsPerNetPeer: c_int,
    /// NVLink scheduling (ignored).
    pub nvlinkCentricSched: c_int,
    /// CUDA graph usage (ignored).
    pub graphUsageMode: c_int,
    /// One-sided contexts (ignored).
    pub numRmaCtx: c_int,
    /// P2P peers (ignored).
    pub maxP2pPeers: c_int,
    /// CUDA graph ordering (ignored).
    pub graphStreamOrdering: c_int,
    /// Launch ordering (ignored).
    pub launchOrderImplicit: c_int,
    /// One-sided signals (ignored).
    pub numRmaSig: c_int,
    /// One-sided eager init (ignored).
    pub rmaEagerInit: c_int,
    /// Host CFT mode (ignored).
    pub hostCftMode: c_int,
    /// NVLS host mode (ignored).
    pub nvlsHostMode: c_int,
}

impl Default for ncclConfig_t {
    /// The value of `NCCL_CONFIG_INITIALIZER`.
    fn default() -> Self {
        let u = NCCL_CONFIG_UNDEF_INT;
        ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(),
            magic: NCCL_API_MAGIC,
            version: crate::NCCL_VERSION_CODE as u32,
            blocking: u,
            cgaClusterSize: u,
            minCTAs: u,
            maxCTAs: u,
            netName: std::ptr::null(),
            splitShare: u,
            trafficClass: u,
            commName: std::ptr::null(),
            collnetEnable: u,
            CTAPolicy: u,
            shrinkShare: u,
            nvlsCTAs: u,
            nChannelsPerNetPeer: u,
            nvlinkCentricSched: u,
            graphUsageMode: u,
            numRmaCtx: u,
            maxP2pPeers: u,
            graphStreamOrdering: u,
            launchOrderImplicit: u,
            numRmaSig: u,
            rmaEagerInit: u,
            hostCftMode: u,
            nvlsHostMode: u,
        }
    }
}

/// Reads a caller's config: NULL gives the defaults; only `config.size` bytes are read (an
/// older, shorter struct keeps the defaults for the fields it lacks); a wrong magic is
/// `ncclInvalidArgument`. Returns whether the communicator is blocking.
pub(crate) fn read_blocking(config: *const ncclConfig_t) -> Result<bool> {
    if config.is_null() {
        return Ok(true);
    }
    let mut c = ncclConfig_t::default();
    // SAFETY: the caller passes a config initialised with NCCL_CONFIG_INITIALIZER, whose first
    // field is its size; we read that word, then at most that many bytes (and at most ours).
    unsafe {
        let head = std::ptr::read_unaligned(config as *const usize);
        let magic = std::ptr::read_unaligned((config as *const u8).add(8) as *const u32);
        if magic != NCCL_API_MAGIC {
            return Err(Error::invalid_argument(format!(
                "config magic is {magic:#x}, not {NCCL_API_MAGIC:#x}: initialise it with NCCL_CONFIG_INITIALIZER"
            )));
        }
        if head < 16 {
            return Err(Error::invalid_argument(format!("config size {head} is too small")));
        }
        let n = head.min(std::mem::size_of::<ncclConfig_t>());
        std::ptr::copy_nonoverlapping(config as *const u8, &mut c as *mut ncclConfig_t as *mut u8, n);
    }
    match c.blocking {
        0 => Ok(false),
        1 | NCCL_CONFIG_UNDEF_INT => Ok(true),
        b => Err(Error::invalid_argument(format!("config.blocking must be 0 or 1 (got {b})"))),
    }
}

/// Nonblocking communicators being built ([`CommInit`]), by the handle already returned. An
/// entry leaves when its communicator is registered ([`promote`]) or its handle cancelled; a
/// failed one stays, so that the handle keeps reporting its failure.
fn building() -> &'static Mutex<HashMap<usize, CommInit>> {
    static P: OnceLock<Mutex<HashMap<usize, CommInit>>> = OnceLock::new();
    P.get_or_init(|| Mutex::new(HashMap::new()))
}

use crate::sync::lock;

/// Registers the communicator of handle `comm` if it is built; returns the creation's state
/// (`None`: not a handle being built, or registered now).
pub(crate) fn promote(comm: ncclComm_t) -> Option<InitState> {
    let mut table = lock(building());
    let init = table.get(&(comm as usize))?;
    if let Some(Ok(c)) = init.poll() {
        register_at(comm as usize, c);
        table.remove(&(comm as usize));
        return None;
    }
    Some(init.state())
}

/// Why a handle is not usable if it is a communicator still being built (or failed).
pub(crate) fn pending_reason(comm: ncclComm_t) -> Option<String> {
    Some(match promote(comm)? {
        InitState::Failed(e) => format!("comm {comm:p} failed to initialise: {}", e.message()),
        _ => format!(
            "comm {comm:p} is still being initialised (poll ncclCommGetAsyncError until it is not ncclInProgress)"
        ),
    })
}

/// Cancels a handle being built (`ncclCommAbort` / `ncclCommDestroy`); false if it is not one.
pub(crate) fn cancel_pending(comm: ncclComm_t) -> bool {
    // A communicator built meanwhile is registered, to be destroyed as any other.
    promote(comm);
    lock(building()).remove(&(comm as usize)).is_some()
}

/// Creates a communicator with `make` where the call layer decides ([`crate::call::create`])
/// and gives it a handle: a communicator still being built gets a handle at once (usable once
/// built, see [`promote`]). Returns the handle and `ncclSuccess` or `ncclInProgress`.
pub(crate) fn create(
    blocking: bool,
    make: impl FnOnce() -> Result<crate::call::Communicator> + Send + 'static,
) -> Result<(ncclComm_t, ncclResult_t)> {
    let make = move || make().inspect_err(|e| set_last_error(&format!("communicator creation: {}", e.message())));
    match crate::call::create(blocking, make)? {
        Created::Ready(c) => Ok((register(*c), ncclResult_t::ncclSuccess)),
        Created::Building { init, in_progress } => {
            // A never-reused handle, valid from now on (being built until the worker ends).
            let token = super::next_handle();
            lock(building()).insert(token, init);
            let st = if in_progress { ncclResult_t::ncclInProgress } else { ncclResult_t::ncclSuccess };
            Ok((token as ncclComm_t, st))
        }
    }
}

/// Runs an ABI body that reports `ncclInProgress` as a status rather than as an error.
fn boundary_status(name: &str, f: impl FnOnce() -> Result<ncclResult_t>) -> ncclResult_t {
    let mut st = ncclResult_t::ncclSuccess;
    let r = boundary(name, || {
        st = f()?;
        Ok(())
    });
    if r == ncclResult_t::ncclSuccess {
        st
    } else {
        r
    }
}

fn id_bytes(id: &ncclUniqueId) -> UniqueId {
    let mut bytes = [0u8; 128];
    for (d, s) in bytes.iter_mut().zip(id.internal) {
        *d = s as u8;
    }
    UniqueId { bytes }
}

fn check_ranks(nranks: c_int, rank: c_int) -> Result<(usize, usize)> {
    if nranks < 1 {
        return Err(Error::invalid_argument(format!("nranks must be at least 1 (got {nranks})")));
    }
    if rank < 0 || rank >= nranks {
        return Err(Error::invalid_argument(format!("rank {rank} is out of range for nranks {nranks}")));
    }
    Ok((nranks as usize, rank as usize))
}

/// `ncclCommInitRank` with a config (blocking or nonblocking).
#[no_mangle]
pub extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    boundary_status("ncclCommInitRankConfig", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(comm, "comm") }?;
        let (n, r) = check_ranks(nranks, rank)?;
        let blocking = read_blocking(config)?;
        let id = id_bytes(&commId);
        let (h, st) = create(blocking, move || crate::call::Communicator::init_rank(n, &id, r))?;
        dst.write(h);
        Ok(st)
    })
}

/// `ncclCommInitRank` with several unique ids (NCCL spreads the rendezvous over several
/// roots). oxccl's root handles any number of ranks, so every rank uses `commIds[0]`.
///
/// Raw pointers as NCCL's contract has them: `commIds` points to `nId` unique ids.
#[no_mangle]
pub extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    myrank: c_int,
    nId: c_int,
    commIds: *mut ncclUniqueId,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    boundary_status("ncclCommInitRankScalable", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(newcomm, "newcomm") }?;
        let (n, r) = check_ranks(nranks, myrank)?;
        if nId < 1 || commIds.is_null() {
            return Err(Error::invalid_argument(format!(
                "need at least one unique id (nId {nId}, commIds {commIds:p})"
            )));
        }
        let blocking = read_blocking(config)?;
        // SAFETY: non-null; the caller passes nId >= 1 ids.
        let id = id_bytes(unsafe { &*commIds });
        let (h, st) = create(blocking, move || crate::call::Communicator::init_rank(n, &id, r))?;
        dst.write(h);
        Ok(st)
    })
}

/// Creates `ndev` ranks in this process joined by in-memory links (host memory; `devlist` is
/// accepted and ignored). `comm[i]` is rank `i`.
///
/// Raw pointers as NCCL's contract has them: `comm` points to room for `ndev` handles.
#[no_mangle]
pub extern "C" fn ncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t {
    let _ = devlist;
    boundary("ncclCommInitAll", || {
        if comm.is_null() {
            return Err(Error::invalid_argument("comm is NULL"));
        }
        if ndev < 1 {
            return Err(Error::invalid_argument(format!("ndev must be at least 1 (got {ndev})")));
        }
        for (i, c) in crate::call::Communicator::in_memory(ndev as usize).into_iter().enumerate() {
            // SAFETY: the caller passes an array of ndev handles.
            unsafe { *comm.add(i) = register(c) };
        }
        Ok(())
    })
}

/// Splits `comm` by `color` (`NCCL_SPLIT_NOCOLOR`: no child, `*newcomm = NULL`), ordering each
/// child's ranks by `key`. Every rank of `comm` must call it.
#[no_mangle]
pub extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    boundary_status("ncclCommSplit", || {
        let parent = lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(newcomm, "newcomm") }?;
        let color = match color {
            NCCL_SPLIT_NOCOLOR => None,
            c if c >= 0 => Some(c as u32),
            c => return Err(Error::invalid_argument(format!("color {c} is negative and not NCCL_SPLIT_NOCOLOR"))),
        };
        let blocking = read_blocking(config)?;
        if color.is_none() {
            // Still take part in the exchange (deferred to the group's end inside a group),
            // then report no child.
            dst.write(std::ptr::null_mut());
            let p = parent.clone();
            crate::call::now_or_at_group_end(move || p.split(None, key).map(|_| ()).map_err(|e| p.record(e)))?;
            return Ok(ncclResult_t::ncclSuccess);
        }
        let (h, st) = create(blocking, move || {
            parent
                .split(color, key)
                .map_err(|e| parent.record(e))?
                .ok_or_else(|| Error::internal("split made no child for a color"))
        })?;
        dst.write(h);
        Ok(st)
    })
}

/// Forms a child of the ranks of `comm` not listed in `excludeRanksList` (in parent order).
/// Only the remaining ranks call it; it works after excluded ranks died (the survivors meet
/// without the parent's connections). `shrinkFlags`: `NCCL_SHRINK_DEFAULT` (0), or
/// `NCCL_SHRINK_ABORT` (1), which aborts `comm` first (use it after an error).
///
/// Raw pointers as NCCL's contract has them: `excludeRanksList` points to `excludeRanksCount` ints.
#[no_mangle]
pub extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    excludeRanksList: *mut c_int,
    excludeRanksCount: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrinkFlags: c_int,
) -> ncclResult_t {
    boundary_status("ncclCommShrink", || {
        let parent = lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(newcomm, "newcomm") }?;
        if !(0..=1).contains(&shrinkFlags) {
            return Err(Error::invalid_argument(format!(
                "shrinkFlags {shrinkFlags} is not NCCL_SHRINK_DEFAULT or NCCL_SHRINK_ABORT"
            )));
        }
        let count =
            usize::try_from(excludeRanksCount).map_err(|_| Error::invalid_argument("excludeRanksCount is negative"))?;
        if count > 0 && excludeRanksList.is_null() {
            return Err(Error::invalid_argument("excludeRanksList is NULL"));
        }
        // SAFETY: the caller passes excludeRanksCount ints.
        let list = if count == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(excludeRanksList, count) } };
        let exclude = list
            .iter()
            .map(|&r| usize::try_from(r).map_err(|_| Error::invalid_argument(format!("excluded rank {r} is negative"))))
            .collect::<Result<Vec<usize>>>()?;
        let blocking = read_blocking(config)?;
        let abort = shrinkFlags == NCCL_SHRINK_ABORT;
        let (h, st) = create(blocking, move || parent.shrink_with(&exclude, abort).map_err(|e| parent.record(e)))?;
        dst.write(h);
        Ok(st)
    })
}

/// Makes the id for growing `comm` with `ncclCommGrow` (a new rendezvous root in this process);
/// pass it out of band to the joining ranks. The grow consumes it.
#[no_mangle]
pub extern "C" fn ncclCommGetUniqueId(comm: ncclComm_t, uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    boundary("ncclCommGetUniqueId", || {
        let c = lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(uniqueId, "uniqueId") }?;
        let id = c.grow_unique_id().map_err(|e| c.record(e))?;
        dst.write(ncclUniqueId { internal: id.bytes.map(|b| b as c_char) });
        Ok(())
    })
}

/// Grows a communicator to `nRanks` ranks. Existing ranks: `comm` set, `rank = -1` (they keep
/// their ranks), `uniqueId` the grow id or NULL. Joining ranks: `comm = NULL`, `uniqueId` the
/// id from `ncclCommGetUniqueId` on an existing rank, `rank` from the old size up.
///
/// Raw pointers as NCCL's contract has them: `uniqueId` is NULL or points to a unique id.
#[no_mangle]
pub extern "C" fn ncclCommGrow(
    comm: ncclComm_t,
    nRanks: c_int,
    uniqueId: *const ncclUniqueId,
    rank: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    boundary_status("ncclCommGrow", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(newcomm, "newcomm") }?;
        if nRanks < 1 {
            return Err(Error::invalid_argument(format!("nRanks must be at least 1 (got {nRanks})")));
        }
        let n = nRanks as usize;
        // SAFETY: a non-null uniqueId points to an ncclUniqueId (the caller's contract).
        let id = (!uniqueId.is_null()).then(|| id_bytes(unsafe { &*uniqueId }));
        let blocking = read_blocking(config)?;
        let (h, st) = if comm.is_null() {
            let Some(id) = id else {
                return Err(Error::invalid_argument("a joining rank (comm = NULL) needs the grow uniqueId"));
            };
            let (_, r) = check_ranks(nRanks, rank)?;
            create(blocking, move || crate::call::Communicator::join_grow(n, &id, r))?
        } else {
            let parent = lookup(comm)?;
            if rank != -1 {
                return Err(Error::invalid_argument(format!(
                    "an existing rank keeps its rank: pass rank = -1 (got {rank})"
                )));
            }
            create(blocking, move || parent.grow(n, id.as_ref()).map_err(|e| parent.record(e)))?
        };
        dst.write(h);
        Ok(st)
    })
}

/// Finishes outstanding work of `comm` before destroy. Host collectives complete before they
/// return, so this only checks the handle and reports an earlier failure.
#[no_mangle]
pub extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclCommFinalize", || match lookup(comm)?.async_error() {
        Some(e) => Err(e),
        None => Ok(()),
    })
}

/// The state of `comm`: `ncclInProgress` while a nonblocking init runs, then its outcome; for
/// a live communicator `ncclSuccess` or the error that stopped it.
#[no_mangle]
pub extern "C" fn ncclCommGetAsyncError(comm: ncclComm_t, asyncError: *mut ncclResult_t) -> ncclResult_t {
    boundary("ncclCommGetAsyncError", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(asyncError, "asyncError") }?;
        let code = |e: &Error| ncclResult_t::from_code(e.code());
        let live = || crate::sync::lock(registry()).get(&(comm as usize)).cloned();
        let state = match live() {
            Some(c) => Some(c),
            // Registers a communicator built meanwhile.
            None => match promote(comm) {
                Some(InitState::Failed(e)) => {
                    dst.write(code(&e));
                    return Ok(());
                }
                Some(_) => {
                    dst.write(ncclResult_t::ncclInProgress);
                    return Ok(());
                }
                None => live(),
            },
        };
        match state {
            Some(c) => {
                dst.write(c.async_error().map(|e| code(&e)).unwrap_or(ncclResult_t::ncclSuccess));
                Ok(())
            }
            None => lookup(comm).map(|_| ()),
        }
    })
}
