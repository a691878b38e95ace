//! Bootstrap: the unique id, the root rendezvous, and authenticated data connections.
//!
//! `ncclGetUniqueId` starts a *root* (a thread of the calling process) listening on this host's
//! bootstrap address and returns an id holding that address and a random secret. Every rank
//! connects to the root, proves it knows the secret, and sends its listening address and host
//! identity; when all `nranks` have arrived, the root sends everyone the full table and exits.
//! Ranks then connect to the peers they need directly (lower rank connects, higher accepts).

pub mod accept;
pub mod auth;
pub mod env;
pub mod net;
pub mod pending;
pub mod root;
pub use crate::net::wire;

pub use crate::net::hostname;
pub use net::host_id;

use crate::error::{Error, Result};
use auth::{Secret, NONCE_LEN, PROOF_LEN, SECRET_LEN};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const ID_MAGIC: &[u8; 4] = b"OXID";
const ID_VERSION: u8 = 1;
/// Byte of the id that is 1 when the root listened before the id was made (else 0).
const ROOT_UP: usize = 40;
/// How long a refused connection to a listener that was up already is retried.
const REFUSED_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The 128-byte `ncclUniqueId`: root address and the communicator's secret.
///
/// Layout: `"OXID"`, version (1), address family (4 or 6), port (big-endian u16),
/// 16 address bytes, 16 secret bytes, a flag (1: the root listened before the id was made),
/// zero padding.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    /// The raw bytes, as passed through `ncclUniqueId.internal`.
    pub bytes: [u8; 128],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.decode() {
            Ok((addr, _)) => write!(f, "UniqueId(root {addr})"),
            Err(_) => write!(f, "UniqueId(invalid)"),
        }
    }
}

impl UniqueId {
    /// Creates an id and starts its root in this process (`ncclGetUniqueId`).
    ///
    /// With `OXCCL_COMM_ID` set, no root is started here: the id names that address and rank 0
    /// starts the root when it joins.
    pub fn new() -> Result<UniqueId> {
        if let Some(addr) = crate::config::BootstrapSettings::from_env().comm_id {
            return UniqueId::for_address(&addr, env_secret());
        }
        let ip = net::pick_address()?.addr;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::from_io(&format!("bind bootstrap root on {ip}"), e))?;
        let mut secret = [0u8; SECRET_LEN];
        net::random_bytes(&mut secret)?;
        let addr = listener.local_addr().map_err(|e| Error::from_io("getsockname", e))?;
        root::spawn(listener, secret)?;
        crate::info!("bootstrap root listening on {addr}");
        let mut id = UniqueId::encode(addr, &secret);
        id.bytes[ROOT_UP] = 1;
        Ok(id)
    }

    /// An id for a fixed `host:port` (the `OXCCL_COMM_ID` form) with the given secret.
    pub fn for_address(hostport: &str, secret: Secret) -> Result<UniqueId> {
        let addr = hostport
            .to_socket_addrs()
            .map_err(|e| Error::invalid_argument(format!("rendezvous address {hostport:?} is not host:port: {e}")))?
            .next()
            .ok_or_else(|| Error::invalid_argument(format!("rendezvous address {hostport:?} resolves to nothing")))?;
        Ok(UniqueId::encode(addr, &secret))
    }

    /// The id of a root at `addr` whose ranks prove `secret`.
    pub(crate) fn encode(addr: SocketAddr, secret: &Secret) -> UniqueId {
        let mut b = [0u8; 128];
        b[..4].copy_from_slice(ID_MAGIC);
        b[4] = ID_VERSION;
        match addr.ip() {
            IpAddr::V4(v4) => {
                b[5] = 4;
                b[8..12].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b[5] = 6;
                b[8..24].copy_from_slice(&v6.octets());
            }
        }
        b[6..8].copy_from_slice(&addr.port().to_be_bytes());
        b[24..40].copy_from_slice(secret);
        UniqueId { bytes: b }
    }

    /// Decodes the root address and secret; garbage gives `ncclInvalidArgument`.
    pub fn decode(&self) -> Result<(SocketAddr, Secret)> {
        let b = &self.bytes;
        if &b[..4] != ID_MAGIC || b[4] != ID_VERSION || b[ROOT_UP] > 1 || b[ROOT_UP + 1..].iter().any(|&x| x != 0) {
            return Err(Error::invalid_argument(
                "unique id is not one made by ncclGetUniqueId (bad magic, version or padding)",
            ));
        }
        let port = u16::from_be_bytes([b[6], b[7]]);
        let ip = match b[5] {
            4 => IpAddr::V4(Ipv4Addr::new(b[8], b[9], b[10], b[11])),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[8..24]).expect("16 bytes"))),
            f => return Err(Error::invalid_argument(format!("unique id has unknown address family {f}"))),
        };
        if port == 0 {
            return Err(Error::invalid_argument("unique id has port 0"));
        }
        let mut secret = [0u8; SECRET_LEN];
        secret.copy_from_slice(&b[24..40]);
        Ok((SocketAddr::new(ip, port), secret))
    }

    /// Whether the root was listening before this id existed (made by `ncclGetUniqueId`), so
    /// that a refused connection means the root is gone rather than not started yet.
    pub fn root_listening(&self) -> bool {
        self.bytes[ROOT_UP] == 1
    }

    /// Hex text of the 128 bytes (for passing through environment variables).
    pub fn to_hex(&self) -> String {
        self.bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`UniqueId::to_hex`] output.
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 256 || !s.is_ascii() {
            return Err(Error::invalid_argument("unique id hex must be 256 hex digits"));
        }
        let mut b = [0u8; 128];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|_| Error::invalid_argument("unique id hex has a non-hex digit"))?;
        }
        let id = UniqueId { bytes: b };
        id.decode()?;
        Ok(id)
    }
}

/// Iterations of PBKDF2-HMAC-SHA256 that turn an `OXCCL_SECRET` passphrase into a key.
pub const SECRET_KDF_ROUNDS: u32 = 200_000;
/// Salt of that derivation (fixed: every rank must derive the same key without talking).
pub const SECRET_KDF_SALT: &[u8] = b"oxccl-env-secret-v3";

/// The secret for ids built from an address (`OXCCL_SECRET`; all zeros when unset: then anyone
/// who can reach the port can join). 32 hex digits are the 128-bit key itself; any other text
/// is a passphrase, stretched with PBKDF2-HMAC-SHA256 ([`SECRET_KDF_ROUNDS`] rounds, about
/// 0.1 s once per process) so that each guess of someone who saw a handshake costs as much.
pub fn env_secret() -> Secret {
    static CACHE: std::sync::Mutex<Option<(String, Secret)>> = std::sync::Mutex::new(None);
    let Some(v) = crate::config::BootstrapSettings::from_env().secret else { return [0u8; SECRET_LEN] };
    let mut cache = crate::sync::lock(&CACHE);
    if let Some((text, s)) = cache.as_ref() {
        if *text == v {
            return *s;
        }
    }
    let s = secret_from_text(&v);
    *cache = Some((v, s));
    s
}

/// The key of an `OXCCL_SECRET` value (see [`env_secret`]).
pub fn secret_from_text(v: &str) -> Secret {
    let mut s = [0u8; SECRET_LEN];
    let t = v.trim();
    if t.len() == 2 * SECRET_LEN && t.bytes().all(|c| c.is_ascii_hexdigit()) {
        for (i, out) in s.iter_mut().enumerate() {
            *out = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).expect("hex digits");
        }
        return s;
    }
    auth::pbkdf2_sha256(v.as_bytes(), SECRET_KDF_SALT, SECRET_KDF_ROUNDS, &mut s);
    s
}

/// Whether a rank 0 that cannot bind the `OXCCL_COMM_ID` address may listen on every interface
/// instead (`OXCCL_COMM_ID_BIND_ANY=1`, or `NCCL_COMM_ID_BIND_ANY`; default no).
fn bind_any() -> bool {
    crate::config::BootstrapSettings::from_env().comm_id_bind_any
}

/// What a rank learns at bootstrap.
pub struct PeerInfo {
    /// Where the peer accepts data connections.
    pub addr: SocketAddr,
    /// The peer's host identity (see [`net::host_id`]).
    pub host: String,
}

/// A rank's result of the rendezvous.
pub struct Bootstrap {
    /// This rank.
    pub rank: usize,
    /// Every rank's address and host, indexed by rank.
    pub peers: Vec<PeerInfo>,
    /// This rank's data listener.
    pub listener: TcpListener,
    /// The communicator's secret.
    pub secret: Secret,
    /// This rank's data listeners on its further rails (`OXCCL_SOCKET_IFNAME`), at the data
    /// listener's port on each further rail's address, added once the rails are known
    /// ([`Bootstrap::listen_on_rails`]): a data link first needed after the bootstrap's rail
    /// died still gets in. Accepted with the same handshake ([`accept::accept_for`]).
    pub further: Vec<TcpListener>,
    /// For each rank, its addresses on the further rails this rank shares with it (learnt from
    /// the control channel's rails), with this end's interface name: where
    /// [`connect_peer_until`] dials a data link when the peer's bootstrap address does not answer.
    pub detours: Vec<Vec<(String, IpAddr)>>,
}

impl Bootstrap {
    /// Binds a data listener at the data listener's port on each address of `rails` (this
    /// rank's rails) but the data listener's own; an address whose port is taken is left out
    /// with an INFO line (data links then reach this rank there only through its bootstrap
    /// address).
    pub fn listen_on_rails(&mut self, rails: &[net::IfAddr]) {
        let Ok(home) = self.listener.local_addr() else { return };
        for r in rails.iter().filter(|r| r.addr != home.ip() && !r.addr.is_unspecified()) {
            match TcpListener::bind(SocketAddr::new(r.addr, home.port())) {
                Ok(l) => self.further.push(l),
                Err(e) => crate::info!(
                    "rank {}: no data listener on rail {} ({}:{}): {e}; data links reach this rank only at {home}",
                    self.rank,
                    r.name,
                    r.addr,
                    home.port()
                ),
            }
        }
    }
}

const HELLO_LABEL: &[u8] = b"oxccl-bootstrap-hello-3";
const DATA_LABEL: &[u8] = b"oxccl-data-connect-2";
/// Label of the acceptor's proof back to the connector (mutual authentication).
const DATA_ACK_LABEL: &[u8] = b"oxccl-data-accept-2";
/// Labels of a control-channel handshake ([`Purpose::Control`]): the same exchange as a data
/// connection's under other labels, so neither can be taken for the other.
const CONTROL_LABEL: &[u8] = b"oxccl-control-connect-1";
const CONTROL_ACK_LABEL: &[u8] = b"oxccl-control-accept-1";

/// What a connection between two ranks is for, proven in its handshake (the labels of the
/// MACs differ, so a data link can never be accepted as a control channel or back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// A data link of the transports.
    Data,
    /// A control channel (`crate::control`): heartbeats, abort and closing frames.
    Control,
}

impl Purpose {
    /// The labels of the connector's and the acceptor's proofs.
    pub(crate) fn labels(self) -> (&'static [u8], &'static [u8]) {
        match self {
            Purpose::Data => (DATA_LABEL, DATA_ACK_LABEL),
            Purpose::Control => (CONTROL_LABEL, CONTROL_ACK_LABEL),
        }
    }
}
/// How long a data link's dial of a peer's bootstrap address is tried before its further
/// rails' addresses are ([`Bootstrap::detours`]).
const DETOUR_AFTER: Duration = Duration::from_secs(2);
/// Longest address or host-id string accepted from the network.
pub const MAX_STR: usize = 1024;

/// Joins the rendezvous of `id` as `rank` of `nranks`.
///
/// With `start_root`, this rank first starts the root at the id's address (the
/// `OXCCL_COMM_ID` / `MASTER_ADDR` forms, where no `ncclGetUniqueId` call made one).
pub fn rendezvous(id: &UniqueId, nranks: usize, rank: usize, deadline: Instant, start_root: bool) -> Result<Bootstrap> {
    rendezvous_with(id, nranks, rank, deadline, start_root, &|_| {}, &|| false)
}

/// [`rendezvous`], showing `on_socket` the connection to the root as soon as it is made (a
/// caller that must be able to end the wait shuts it from another thread), and giving up
/// reaching the root once `abort` says so.
pub fn rendezvous_with(
    id: &UniqueId,
    nranks: usize,
    rank: usize,
    deadline: Instant,
    start_root: bool,
    on_socket: &dyn Fn(&TcpStream),
    abort: &dyn Fn() -> bool,
) -> Result<Bootstrap> {
    let (root_addr, secret) = id.decode()?;
    if start_root {
        let listener = match TcpListener::bind(root_addr) {
            Ok(l) => l,
            // Every interface only when asked: a silent fallback would listen where the user
            // did not expect (and hide a wrong address).
            Err(e) if bind_any() => {
                let any: IpAddr =
                    if root_addr.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
                crate::warn!("rank {rank}: cannot bind the bootstrap root on {root_addr} ({e}); listening on {any} (OXCCL_COMM_ID_BIND_ANY=1)");
                TcpListener::bind(SocketAddr::new(any, root_addr.port()))
                    .map_err(|e| Error::from_io(&format!("bind bootstrap root on {any}:{}", root_addr.port()), e))?
            }
            Err(e) => {
                return Err(Error::system(format!(
                    "rank {rank}: cannot bind the bootstrap root on {root_addr} (OXCCL_COMM_ID / MASTER_ADDR): {e}; if that address reaches this host only through NAT, set OXCCL_COMM_ID_BIND_ANY=1 to listen on every interface"
                )))
            }
        };
        root::spawn(listener, secret)?;
    }
    let grace = id.root_listening().then_some(REFUSED_GRACE);
    let mut s = crate::net::connect::connect_retry_until(root_addr, deadline, grace, abort)
        .map_err(|e| e.context(format!("rank {rank}: reaching the bootstrap root")))?;
    on_socket(&s);
    let nonce = wire::read_frame(&mut s, NONCE_LEN, deadline)
        .map_err(|e| e.context(format!("rank {rank}: the bootstrap root at {root_addr} (challenge)")))?;
    let ip = s.local_addr().map_err(|e| Error::from_io("getsockname", e))?.ip();
    let listener = TcpListener::bind(SocketAddr::new(ip, 0))
        .map_err(|e| Error::from_io(&format!("bind data listener on {ip}"), e))?;
    let my_addr = listener.local_addr().map_err(|e| Error::from_io("getsockname", e))?;
    // This rank proves the secret first (over everything the root acts on); the root proves
    // it back in the MAC of its reply, over this rank's own challenge.
    let mine = auth::nonce()?;
    let hello =
        root::hello_message(&secret, &nonce, &mine, nranks as u32, rank as u32, &my_addr.to_string(), &host_id());
    wire::write_frame(&mut s, &hello)?;
    let reply =
        wire::read_frame(&mut s, 64 + PROOF_LEN + nranks.saturating_mul(2 * MAX_STR + 8), deadline).map_err(|e| {
            e.context(format!("rank {rank}: waiting for the other ranks at the bootstrap root {root_addr}"))
        })?;
    let reply = root::open_reply(&reply, &secret, &mine, &nonce).map_err(|e| {
        e.context(format!(
            "rank {rank}: the process at the bootstrap root address {root_addr} could not prove the communicator's secret: refused"
        ))
    })?;
    let peers = root::parse_table(reply, nranks)?;
    let detours = vec![Vec::new(); nranks];
    Ok(Bootstrap { rank, peers, listener, secret, further: Vec::new(), detours })
}

/// Connects to `peer`'s listener; both ends prove the secret over both nonces
/// ([`accept`]) before this returns, so no byte of data goes to a listener that cannot.
pub fn connect_peer(b: &Bootstrap, peer: usize, deadline: Instant) -> Result<TcpStream> {
    connect_peer_for(b, peer, Purpose::Data, deadline)
}

/// [`connect_peer`] for a connection of the given purpose.
pub fn connect_peer_for(b: &Bootstrap, peer: usize, purpose: Purpose, deadline: Instant) -> Result<TcpStream> {
    connect_peer_until(b, peer, purpose, deadline, &|| false).map(|c| c.stream)
}

/// An authenticated connection to a peer and its keys ([`auth::Keys`], derived from the
/// handshake's nonces: control frames, and data under `OXCCL_WIRE_INTEGRITY`, are sealed
/// with them).
#[derive(Debug)]
pub struct Conn {
    /// The connected stream, past the handshake.
    pub stream: TcpStream,
    /// This end's keys.
    pub keys: auth::Keys,
}

/// [`connect_peer_for`] that stops retrying a refused or unanswered connection once `abort`
/// says so (the communicator, or the parent of the one being made, failed); the connection
/// with its keys.
pub fn connect_peer_until(
    b: &Bootstrap,
    peer: usize,
    purpose: Purpose,
    deadline: Instant,
    abort: &dyn Fn() -> bool,
) -> Result<Conn> {
    let (label, ack_label) = purpose.labels();
    let home = b.peers[peer].addr;
    let detours = if purpose == Purpose::Data { b.detours.get(peer).map_or(&[][..], |d| &d[..]) } else { &[] };
    // Every rank's listener was up before the table was sent: a refusal means it is gone.
    // With further rails, the bootstrap's rail gets a bounded try before they are tried in turn.
    let first = if detours.is_empty() { deadline } else { deadline.min(Instant::now() + DETOUR_AFTER) };
    let (mut s, addr) = match crate::net::connect::connect_retry_until(home, first, Some(REFUSED_GRACE), abort) {
        Ok(s) => (s, home),
        Err(e) if detours.is_empty() => {
            return Err(e.context(format!("rank {}: connecting to rank {peer}", b.rank)));
        }
        Err(e) => {
            let mut last = e.context(format!("rank {}: connecting to rank {peer} at {home}", b.rank));
            let mut got = None;
            for (k, (name, ip)) in detours.iter().enumerate() {
                let to = SocketAddr::new(*ip, home.port());
                let until = if k + 1 == detours.len() { deadline } else { deadline.min(Instant::now() + DETOUR_AFTER) };
                match crate::net::connect::connect_retry_until(to, until, Some(REFUSED_GRACE), abort) {
                    Ok(s) => {
                        crate::warn!(
                            "rank {}: rank {peer}'s data listener {home} did not answer ({}); data link through rail {name}, its address {to}",
                            b.rank,
                            last.message()
                        );
                        got = Some((s, to));
                        break;
                    }
                    Err(e) => {
                        last = e.context(format!("rank {}: connecting to rank {peer} at {to} (rail {name})", b.rank))
                    }
                }
            }
            got.ok_or(last)?
        }
    };
    let who = || format!("rank {}: rank {peer} at {addr}", b.rank);
    let theirs =
        wire::read_frame(&mut s, NONCE_LEN, deadline).map_err(|e| e.context(format!("{} (challenge)", who())))?;
    let mine = auth::nonce()?;
    let ctx = [&data_context(b.rank, peer)[..], &mine[..]].concat();
    let mut w = wire::Writer::default();
    w.bytes(&mine).bytes(&auth::prove(&b.secret, label, &theirs, &ctx)).u32(b.rank as u32);
    wire::write_frame(&mut s, &w.0)?;
    let proof = wire::read_frame(&mut s, PROOF_LEN, deadline)
        .map_err(|e| e.context(format!("{} (its proof of the secret)", who())))?;
    let ctx = [&data_context(b.rank, peer)[..], &theirs[..]].concat();
    if !auth::verify(&b.secret, ack_label, &mine, &ctx, &proof) {
        return Err(Error::remote(format!("{} could not prove the communicator's secret: refused", who())));
    }
    let keys = auth::Keys::derive(&b.secret, label, b.rank, peer, &theirs, &mine);
    Ok(Conn { stream: s, keys })
}

pub(crate) fn data_context(from: usize, to: usize) -> [u8; 8] {
    let mut c = [0u8; 8];
    c[..4].copy_from_slice(&(from as u32).to_be_bytes());
    c[4..].copy_from_slice(&(to as u32).to_be_bytes());
    c
}

/// Checks one incoming data connection, blocking (tests and tools; communicators use
/// [`accept::accept_ranks`], which runs every handshake at once): sends a challenge, verifies
/// the answer, proves the secret back, and returns the rank of the connecting peer.
pub fn authenticate_incoming(b: &Bootstrap, s: &mut TcpStream, deadline: Instant) -> Result<usize> {
    let nonce = auth::nonce()?;
    wire::write_frame(s, &nonce)?;
    let msg = wire::read_frame(s, NONCE_LEN + PROOF_LEN + 4, deadline)?;
    let (from, theirs, purpose) = accept::check_answer(b, &nonce, &msg)?;
    if purpose != Purpose::Data {
        return Err(Error::remote(format!(
            "rank {from} opened a {purpose:?} connection where a data link was expected"
        )));
    }
    wire::write_frame(s, &accept::ack(b, from, &theirs, &nonce, purpose))?;
    Ok(from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_secret_is_stretched_and_a_hex_secret_is_the_key() {
        let hex = secret_from_text("000102030405060708090a0B0c0d0e0f");
        assert_eq!(hex, core::array::from_fn(|i| i as u8));
        // PBKDF2-HMAC-SHA256("hunter2", "oxccl-env-secret-v3", 200000), as Python's
        // hashlib.pbkdf2_hmac computes it (python-bindings/oxccl/env.py derives it so).
        let text = secret_from_text("hunter2");
        assert_eq!(text, [70, 124, 127, 230, 210, 92, 223, 140, 240, 175, 83, 151, 61, 252, 175, 3]);
        // 31 hex digits are text, not a key.
        assert_ne!(secret_from_text("000102030405060708090a0b0c0d0e0"), [0u8; SECRET_LEN]);
    }
}
