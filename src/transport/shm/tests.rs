//! Unit tests of the shared-memory link (`shm.rs`), single copy included.

use super::*;

#[test]
fn open_checks_the_cookie_and_the_file() {
    let (mut seg, desc) = Segment::create(4096).unwrap();
    let ok = Segment::open(&desc).unwrap();
    assert_eq!(ok.capacity(), 4096);
    let mut bad = desc.clone();
    bad.cookie[0] ^= 1;
    assert!(Segment::open(&bad).is_err(), "a wrong cookie is refused");
    let mut wrong_len = desc.clone();
    wrong_len.len += 4096;
    assert!(Segment::open(&wrong_len).is_err(), "a wrong length is refused");
    seg.close_fd();
    assert!(Segment::open(&desc).is_err(), "a closed descriptor cannot be opened");
}

#[test]
fn pair_moves_bytes_both_ways_and_reports_shutdown() {
    let (mut a, mut b) = ShmLink::pair(4096).unwrap();
    assert_eq!(a.try_send(b"hello").unwrap(), 5);
    assert_eq!(b.try_send(b"world!").unwrap(), 6);
    let mut buf = [0u8; 16];
    assert_eq!(b.try_recv(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    let mut seen = Vec::new();
    let got = a.recv_in_place(16, &mut |x, y| {
        seen.extend_from_slice(x);
        seen.extend_from_slice(y);
        x.len() + y.len()
    });
    assert_eq!(got.unwrap(), Some(6));
    assert_eq!(seen, b"world!");
    // Nothing to read: arming for a read says "sleep", and a send wakes the sleeper.
    assert!(a.arm(Interest { read: true, write: false }).unwrap());
    b.try_send(b"x").unwrap();
    let mut pfd = libc::pollfd { fd: a.poll_fd().unwrap(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 5000) }, 1, "the doorbell arrived");
    assert!(!a.arm(Interest { read: true, write: false }).unwrap(), "data is there: do not sleep");
    assert_eq!(a.try_recv(&mut buf).unwrap(), 1);
    b.shutdown();
    assert!(a.try_recv(&mut buf).is_err());
    assert!(a.try_send(&[0u8; 8]).is_err());
}

#[test]
fn vectored_receive_splits_the_stream_across_the_ring_end() {
    let (mut a, mut b) = ShmLink::pair(4096).unwrap();
    let mut sink = [0u8; 4000];
    // Move the ring's position near its end, so the next bytes wrap around it.
    assert_eq!(a.try_send(&[0u8; 4000]).unwrap(), 4000);
    assert_eq!(b.try_recv(&mut sink).unwrap(), 4000);
    let stream: Vec<u8> = (0..300u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(a.try_send_vectored(&[&stream[..48], &stream[48..]]).unwrap(), 300);
    let (mut x, mut y) = ([0u8; 48], [0u8; 200]);
    assert_eq!(b.try_recv_vectored(&mut x, &mut y).unwrap(), 248);
    assert_eq!((&x[..], &y[..]), (&stream[..48], &stream[48..248]));
    let mut rest = [0u8; 52];
    assert_eq!(b.try_recv(&mut rest).unwrap(), 52);
    assert_eq!(&rest[..], &stream[248..]);
}

/// Single copy wherever the kernel permits it (`OXCCL_CMA=1`).
const FORCED: Option<crate::config::CmaSetting> =
    Some(crate::config::CmaSetting { min: crate::config::CMA_DEFAULT_MIN, forced: true });

/// Sends `msg` from `a` to `b` the way the engine does (the untaken rest again until all is
/// taken), `b` reading with `try_recv` (or reducing in place as a byte sum, when
/// `in_place`); returns what `b` got.
fn transfer(a: &mut ShmLink, b: &mut ShmLink, msg: &[u8], in_place: bool) -> Vec<u8> {
    let (mut sent, mut got) = (0, vec![0u8; msg.len()]);
    let mut have = 0;
    let t = std::time::Instant::now();
    while sent < msg.len() || have < msg.len() {
        assert!(t.elapsed().as_secs() < 20, "stuck at {sent}/{have} of {}", msg.len());
        if sent < msg.len() {
            sent += a.try_send(&msg[sent..]).unwrap();
        }
        if in_place {
            let dst = &mut got[have..];
            let n = b
                .recv_in_place(dst.len(), &mut |x, y| {
                    let k = x.len() + y.len();
                    let src = x.iter().chain(y.iter());
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d = d.wrapping_add(*s));
                    k
                })
                .unwrap()
                .unwrap();
            have += n;
        } else {
            have += b.try_recv(&mut got[have..]).unwrap();
        }
    }
    got
}

#[test]
fn large_sends_go_by_single_copy_in_stream_order() {
    let (mut a, mut b) = ShmLink::pair_with(4096, FORCED).unwrap();
    assert_eq!(a.single_copy(), (true, true), "this process may read itself");
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 13 % 251) as u8).collect();
    // A small message through the ring, then a large one posted behind it: nothing of the
    // large one is taken before the receiver copied it.
    assert_eq!(a.try_send(b"head").unwrap(), 4);
    assert_eq!(a.try_send(&big).unwrap(), 0, "posted, not yet copied");
    let mut first = [0u8; 10];
    assert_eq!(b.try_recv(&mut first).unwrap(), 10, "ring bytes, then the segment");
    assert_eq!((&first[..4], &first[4..]), (&b"head"[..], &big[..6]));
    assert_eq!(a.try_send(&big).unwrap(), 6, "taken as far as copied");
    let rest = transfer(&mut a, &mut b, &big[6..], false);
    assert_eq!(rest, &big[6..]);
    // Reduction straight out of the link, through the bounce buffer.
    let sum = transfer(&mut a, &mut b, &big, true);
    assert_eq!(sum, big);
    // Ring traffic after the segment.
    assert_eq!(transfer(&mut a, &mut b, b"tail", false), b"tail");
}

/// The parts of a link before either end is built: a connected loopback socket pair and a new
/// segment of `cap` bytes with its descriptor (the tests open it and build the ends themselves).
fn unbuilt(cap: usize) -> (TcpStream, TcpStream, Segment, Descriptor) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let s0 = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s1, _) = l.accept().unwrap();
    let (seg, desc) = Segment::create(cap).unwrap();
    (s0, s1, seg, desc)
}

#[test]
fn a_single_copy_posted_before_the_receiving_end_exists_is_received() {
    // The opener records its verdict when it maps the segment, so the creator may post its
    // first large send before the opener's end of the link is built (ranks of a fresh
    // communicator run ahead of each other): the opener must still see that post.
    let (s0, s1, mut seg, desc) = unbuilt(4096);
    let other = Segment::open_with(&desc, FORCED).unwrap();
    seg.close_fd();
    let mut a = ShmLink::new_with(seg, true, s0, 1, FORCED).unwrap();
    assert!(a.single_copy().0, "this process may read itself");
    let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 249) as u8).collect();
    assert_eq!(a.try_send(&big).unwrap(), 0, "posted, not yet copied");
    let mut b = ShmLink::new_with(other, false, s1, 0, FORCED).unwrap();
    let mut got = vec![0u8; big.len()];
    let (mut have, mut sent, mut rounds) = (0, 0, 0);
    while have < big.len() {
        rounds += 1;
        assert!(rounds < 10_000, "the receiver never saw the post: {have} of {} bytes", big.len());
        have += b.try_recv(&mut got[have..]).unwrap();
        sent += a.try_send(&big[sent..]).unwrap();
    }
    assert_eq!(got, big);
}

#[test]
fn refused_single_copy_falls_back_to_the_ring() {
    let (s0, s1, mut seg, desc) = unbuilt(4096);
    // The creator's published header address is wrong: the opener's probe of it fails
    // (the kernel refuses the read), so the creator-to-opener direction uses the ring.
    seg.cma_header().corrupt_side(0);
    let other = Segment::open_with(&desc, FORCED).unwrap();
    seg.close_fd();
    let (mut a, mut b) =
        (ShmLink::new_with(seg, true, s0, 1, FORCED).unwrap(), ShmLink::new_with(other, false, s1, 0, FORCED).unwrap());
    assert_eq!(a.single_copy(), (false, true));
    assert_eq!(b.single_copy(), (true, false));
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    assert_eq!(transfer(&mut a, &mut b, &big, false), big);
    assert_eq!(transfer(&mut b, &mut a, &big, false), big);
    assert_eq!(transfer(&mut a, &mut b, &big, true), big);
}

#[test]
fn single_copy_off_or_timed_is_decided_at_connect() {
    let (mut a, mut b) = ShmLink::pair_with(1 << 16, None).unwrap();
    assert_eq!((a.single_copy(), b.single_copy()), ((false, false), (false, false)), "OXCCL_CMA=0");
    let big = vec![5u8; 100_000];
    assert_eq!(transfer(&mut a, &mut b, &big, false), big);
    // Automatic: either way, both ends of a direction agree and the bytes arrive.
    let (mut a, mut b) =
        ShmLink::pair_with(1 << 16, Some(crate::config::CmaSetting { min: 1024, forced: false })).unwrap();
    assert_eq!(a.single_copy().0, b.single_copy().1);
    assert_eq!(transfer(&mut a, &mut b, &big, false), big);
}

#[test]
fn dead_peer_is_an_error_when_waiting() {
    let (mut a, b) = ShmLink::pair(4096).unwrap();
    drop(b);
    let e = a.arm(Interest { read: true, write: false }).unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::Remote, "{e}");
}

#[test]
fn the_default_ring_is_small_only_for_two_ranks_with_a_cpu_each() {
    assert_eq!(default_ring(2, false), RING_PAIR);
    // Two ranks sharing one CPU, more ranks (crowded or not), or one: the large ring.
    assert_eq!(default_ring(2, true), RING_DEFAULT);
    assert_eq!(default_ring(4, true), RING_DEFAULT);
    assert_eq!(default_ring(3, false), RING_DEFAULT);
    assert_eq!(default_ring(1, false), RING_DEFAULT);
    assert!(RING_PAIR.is_power_of_two() && RING_PAIR < RING_DEFAULT);
}
