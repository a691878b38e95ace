//! Bounded fuzzing of every parser of network bytes (the same parsers as the cargo-fuzz
//! targets in fuzz/): random and mutated inputs must give a value or an error, never a panic,
//! an unbounded allocation or a forged authentication.

use oxccl::bootstrap::{root, wire, UniqueId};
use oxccl::control::frame::Frame;
use oxccl::mismatch::{Desc, Signature, SIG_LEN};
use proptest::prelude::*;

/// A valid root table for `addrs` (the format `root::parse_table` reads).
fn table(addrs: &[(u16, String)]) -> Vec<u8> {
    let mut w = wire::Writer::default();
    w.bytes(&[0]).u32(addrs.len() as u32);
    for (port, host) in addrs {
        w.str(&format!("127.0.0.1:{port}")).str(host);
    }
    w.0
}

/// Applies byte edits (position modulo length, xor value) to `v`.
fn mutate(mut v: Vec<u8>, edits: &[(usize, u8)], cut: usize) -> Vec<u8> {
    for &(i, x) in edits {
        if !v.is_empty() {
            let n = v.len();
            v[i % n] ^= x;
        }
    }
    v.truncate(v.len().saturating_sub(cut));
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn control_frame_parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1200)) {
        let mut buf = bytes;
        while let Ok(Some(_)) = Frame::take(&mut buf) {}
    }

    #[test]
    fn abort_frames_round_trip_after_any_frames_and_cut_frames_are_not_taken(
        before in proptest::collection::vec(any::<u32>(), 0..5), text in ".{0,200}", cut in 1usize..20,
    ) {
        let mut stream: Vec<u8> = before.iter().flat_map(|&pid| Frame::Heartbeat { pid }.encode()).collect();
        let f = Frame::Abort { code: oxccl::ErrorKind::InvalidUsage.code(), reason: text.clone() }.encode();
        stream.extend_from_slice(&f);
        let mut buf = stream.clone();
        let mut got = Vec::new();
        while let Some(x) = Frame::take(&mut buf).unwrap() {
            got.push(x);
        }
        prop_assert_eq!(got.len(), before.len() + 1);
        prop_assert_eq!(got.pop(), Some(Frame::Abort { code: oxccl::ErrorKind::InvalidUsage.code(), reason: text }));
        // A frame cut short (the peer died while writing it) is never taken for one.
        let mut buf = f[..f.len() - cut.min(f.len())].to_vec();
        prop_assert_eq!(Frame::take(&mut buf).unwrap(), None);
    }

    #[test]
    fn signature_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
        let _ = Signature::decode(&bytes);
    }

    #[test]
    fn signature_round_trips_and_mutations_are_caught(
        tag in 1u8..11, dtype in 0u8..12, op in 0u8..5, root in any::<u32>(), count in any::<u64>(),
        seq in any::<u64>(), sb in any::<u64>(), rb in any::<u64>(),
        edits in proptest::collection::vec((0usize..SIG_LEN, 1u8..=255), 1..4),
    ) {
        let s = Signature { desc: Desc { tag, dtype, op, root, count }, seq, send_bytes: sb, recv_bytes: rb };
        prop_assert_eq!(Signature::decode(&s.encode()).unwrap(), s);
        // Any edit either breaks the frame or changes a field: a mutated signature never
        // decodes to the original.
        let m = mutate(s.encode().to_vec(), &edits, 0);
        if m != s.encode().to_vec() {
            prop_assert_ne!(Signature::decode(&m).ok(), Some(s));
        }
    }

    #[test]
    fn hello_never_authenticates_without_the_secret(
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
        secret in any::<[u8; 16]>(), nonce in any::<[u8; 16]>(),
    ) {
        prop_assert!(root::parse_hello(&bytes, &secret, &nonce).is_err());
    }

    #[test]
    fn hello_with_a_wrong_secret_is_rejected(secret in any::<[u8; 16]>(), nonce in any::<[u8; 16]>(), flip in 0usize..16, rank in 0u32..8) {
        let hello = |key: &[u8; 16]| root::hello_message(key, &nonce, &[5; 16], 8, rank, "127.0.0.1:5000", "host");
        let mut wrong = secret;
        wrong[flip] ^= 1;
        let ok = root::parse_hello(&hello(&secret), &secret, &nonce);
        prop_assert_eq!(ok.map(|h| (h.nranks, h.rank, h.nonce)).ok(), Some((8, rank as usize, [5; 16])));
        prop_assert!(root::parse_hello(&hello(&wrong), &secret, &nonce).is_err());
    }

    /// Any byte of a hello changed on the way (its address, host, rank, nonce or proof) makes
    /// the root refuse it: the MAC covers every field the root acts on.
    #[test]
    fn a_tampered_hello_is_rejected(secret in any::<[u8; 16]>(), nonce in any::<[u8; 16]>(), at in any::<usize>(), x in 1u8..) {
        let mut h = root::hello_message(&secret, &nonce, &[5; 16], 8, 3, "127.0.0.1:5000", "host");
        let i = at % h.len();
        h[i] ^= x;
        prop_assert!(root::parse_hello(&h, &secret, &nonce).is_err(), "byte {} changed, hello accepted", i);
    }

    #[test]
    fn table_parser_handles_random_and_mutated_input(
        addrs in proptest::collection::vec((1u16.., "[a-z]{0,12}"), 1..6),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        cut in 0usize..8, random in proptest::collection::vec(any::<u8>(), 0..128),
    ) {
        let t = table(&addrs);
        let parsed = root::parse_table(&t, addrs.len()).unwrap();
        prop_assert_eq!(parsed.len(), addrs.len());
        for (p, (port, host)) in parsed.iter().zip(&addrs) {
            prop_assert_eq!(p.addr.port(), *port);
            prop_assert_eq!(&p.host, host);
        }
        let _ = root::parse_table(&mutate(t, &edits, cut), addrs.len());
        let _ = root::parse_table(&random, addrs.len());
    }

    #[test]
    fn unique_id_parsers_reject_garbage(bytes in any::<[u8; 32]>(), hex in "[0-9a-fA-Fx ]{0,300}") {
        let mut id = UniqueId { bytes: [0; 128] };
        id.bytes[..32].copy_from_slice(&bytes);
        if &bytes[..4] != b"OXID" {
            prop_assert!(id.decode().is_err());
        }
        let _ = UniqueId::from_hex(&hex);
    }

    #[test]
    fn wire_reader_is_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..64), ops in proptest::collection::vec(0u8..4, 0..8)) {
        let mut r = wire::Reader::new(&bytes);
        for o in ops {
            let _ = match o {
                0 => r.u32().map(|_| ()),
                1 => r.u64().map(|_| ()),
                2 => r.str(16).map(|_| ()),
                _ => r.bytes(7).map(|_| ()),
            };
        }
        let _ = r.finish();
    }
}

/// A frame header claiming 4 GiB is refused before anything is allocated.
#[test]
fn read_frame_bounds_lengths_before_allocating() {
    use std::io::Write;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut b, _) = l.accept().unwrap();
    a.write_all(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let e = wire::read_frame(&mut b, 1024, deadline).unwrap_err();
    assert!(e.message().contains("limit 1024"), "{e}");
    // A short frame followed by silence fails at the deadline instead of hanging.
    let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut d, _) = l.accept().unwrap();
    c.write_all(&[0, 0, 0, 9, 1]).unwrap();
    let t = std::time::Instant::now();
    let e = wire::read_frame(&mut d, 1024, t + std::time::Duration::from_millis(300)).unwrap_err();
    assert_eq!(e.kind(), oxccl::ErrorKind::Timeout, "{e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(2));
}
