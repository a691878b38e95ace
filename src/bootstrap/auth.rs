//! Connection authentication: HMAC-SHA256 challenge-response keyed by the unique id's secret.
//!
//! The accepting side sends a fresh random nonce; the connecting side answers first with
//! `HMAC(secret, label || nonce || context)`, and the accepting side proves the secret back
//! only to a side that did. The secret itself never crosses the wire.

use crate::error::Result;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the secret carried in the unique id.
pub const SECRET_LEN: usize = 16;
/// Bytes of a challenge nonce.
pub const NONCE_LEN: usize = 16;
/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;

/// The shared secret of one communicator.
pub type Secret = [u8; SECRET_LEN];
/// Bytes of a per-connection key ([`Keys`]).
pub const KEY_LEN: usize = 32;
/// Label of the key derivation ([`Keys::derive`]).
const KEY_LABEL: &[u8] = b"oxccl-connection-key-1";
/// Label of a control connection's keys on a further rail ([`Keys::for_rail`]).
const RAIL_LABEL: &[u8] = b"oxccl-control-rail-key-1";

/// The keys of one authenticated connection, one per direction, derived from the
/// communicator's secret and both ends' handshake nonces: a frame sealed under one
/// connection's key verifies on no other connection, in no other direction.
#[derive(Clone, PartialEq, Eq)]
pub struct Keys {
    /// Seals what this end sends.
    pub send: [u8; KEY_LEN],
    /// Checks what this end receives.
    pub recv: [u8; KEY_LEN],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

impl Keys {
    /// The keys of rank `me` on a connection to rank `peer` whose handshake proved `label`
    /// (the connector's label of its purpose), in which the acceptor sent `nonce_a` and the
    /// connector `nonce_c`. Both ends derive the same two keys, swapped.
    pub fn derive(secret: &Secret, label: &[u8], me: usize, peer: usize, nonce_a: &[u8], nonce_c: &[u8]) -> Keys {
        let key = |from: usize, to: usize| {
            let ctx = [&(from as u32).to_be_bytes()[..], &(to as u32).to_be_bytes(), nonce_a, nonce_c].concat();
            prove(secret, KEY_LABEL, label, &ctx)
        };
        Keys { send: key(me, peer), recv: key(peer, me) }
    }

    /// The keys of the control connection on rail `rail` of the link these keys belong to:
    /// each direction's key is `HMAC(this key, label || rail)`, so both ends derive the same
    /// two keys, swapped, without sending them, and each rail's differ from every other
    /// rail's and from the link's own (whose MAC inputs start with a record number, never
    /// with the label).
    pub fn for_rail(&self, rail: usize) -> Keys {
        let sub = |key: &[u8; KEY_LEN]| -> [u8; KEY_LEN] {
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts keys of any length");
            mac.update(RAIL_LABEL);
            mac.update(&(rail as u32).to_be_bytes());
            mac.finalize().into_bytes().into()
        };
        Keys { send: sub(&self.send), recv: sub(&self.recv) }
    }
}

/// A fresh random challenge.
pub fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    super::net::random_bytes(&mut n)?;
    Ok(n)
}

/// The proof that the holder of `secret` answers to `nonce` for a connection described by
/// `label` and `context` (e.g. the ranks at each end).
pub fn prove(secret: &Secret, label: &[u8], nonce: &[u8], context: &[u8]) -> [u8; PROOF_LEN] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(label);
    mac.update(nonce);
    mac.update(context);
    mac.finalize().into_bytes().into()
}

/// Checks a proof in constant time.
pub fn verify(secret: &Secret, label: &[u8], nonce: &[u8], context: &[u8], proof: &[u8]) -> bool {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(label);
    mac.update(nonce);
    mac.update(context);
    mac.verify_slice(proof).is_ok()
}

/// PBKDF2-HMAC-SHA256 (RFC 8018) of `password` and `salt`, `rounds` iterations, into `out`
/// (at most 32 bytes: one block).
pub fn pbkdf2_sha256(password: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
    let key = <Hmac<Sha256> as Mac>::new_from_slice(password).expect("HMAC accepts keys of any length");
    let mut mac = key.clone();
    mac.update(salt);
    mac.update(&1u32.to_be_bytes());
    let mut u: [u8; 32] = mac.finalize().into_bytes().into();
    let mut t = u;
    for _ in 1..rounds {
        let mut mac = key.clone();
        mac.update(&u);
        u = mac.finalize().into_bytes().into();
        t.iter_mut().zip(u.iter()).for_each(|(a, b)| *a ^= b);
    }
    out.copy_from_slice(&t[..out.len()]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_matches_the_rfc_7914_vector() {
        // RFC 7914 section 11: PBKDF2-HMAC-SHA256, P="passwd", S="salt", c=1.
        let mut out = [0u8; 32];
        pbkdf2_sha256(b"passwd", b"salt", 1, &mut out);
        assert_eq!(out[..8], [0x55, 0xac, 0x04, 0x6e, 0x56, 0xe3, 0x08, 0x9f]);
        // And c=2 against Python's hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 2).
        pbkdf2_sha256(b"password", b"salt", 2, &mut out);
        assert_eq!(out[..4], [0xae, 0x4d, 0x0c, 0x95]);
    }

    #[test]
    fn both_ends_derive_swapped_keys_that_differ_per_direction_connection_and_purpose() {
        let s = [7u8; SECRET_LEN];
        let (a, c) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let mine = Keys::derive(&s, b"control", 0, 1, &a, &c);
        let theirs = Keys::derive(&s, b"control", 1, 0, &a, &c);
        assert_eq!((mine.send, mine.recv), (theirs.recv, theirs.send));
        assert_ne!(mine.send, mine.recv, "each direction has its own key");
        assert_ne!(Keys::derive(&s, b"data", 0, 1, &a, &c), mine, "another purpose");
        assert_ne!(Keys::derive(&s, b"control", 0, 1, &c, &a), mine, "other nonces");
        assert_ne!(Keys::derive(&[8u8; SECRET_LEN], b"control", 0, 1, &a, &c), mine, "another secret");
        assert_eq!(format!("{mine:?}"), "Keys(..)", "keys are never printed");
        // A further rail's control keys: the same at both ends, swapped; per rail and direction.
        let (r1, r1t) = (mine.for_rail(1), theirs.for_rail(1));
        assert_eq!((r1.send, r1.recv), (r1t.recv, r1t.send));
        assert_ne!(r1.send, r1.recv);
        assert!(r1 != mine && r1 != mine.for_rail(2), "each rail has its own keys");
    }

    #[test]
    fn proofs_depend_on_every_input() {
        let s = [7u8; SECRET_LEN];
        let p = prove(&s, b"x", b"nonce", b"ctx");
        assert!(verify(&s, b"x", b"nonce", b"ctx", &p));
        assert!(!verify(&[8u8; SECRET_LEN], b"x", b"nonce", b"ctx", &p));
        assert!(!verify(&s, b"y", b"nonce", b"ctx", &p));
        assert!(!verify(&s, b"x", b"nonce2", b"ctx", &p));
        assert!(!verify(&s, b"x", b"nonce", b"ctx2", &p));
        assert!(!verify(&s, b"x", b"nonce", b"ctx", &p[..31]));
    }
}
