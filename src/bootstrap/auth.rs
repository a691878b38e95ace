//! Connection authentication: HMAC-SHA256 challenge-response keyed by the unique id's secret.
//!
//! The accepting side sends a fresh random nonce; the connecting side answers with
//! `HMAC(secret, label || nonce || context)`. The secret itself never crosses the wire.

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

#[cfg(test)]
mod tests {
    use super::*;

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
