//! Tests of [`ThreadedTcpLink`](super::ThreadedTcpLink) against [`TcpLink`] ends and itself.

use super::super::tcp::tests::{bytes, exchange, socket_pairs};
use super::super::tcp::{TcpLink, MIN_STRIPE};
use super::super::Links;
use super::*;

/// What a drop waits for the send rings at most (a communicator's default timeout, capped).
const LINGER: Duration = Duration::from_secs(30);

fn threaded_pair(n: usize, stripe: usize, threads: [usize; 2]) -> (ThreadedTcpLink, ThreadedTcpLink) {
    let (a, b) = socket_pairs(n);
    (
        ThreadedTcpLink::new(a, stripe, 1, threads[0], LINGER).unwrap(),
        ThreadedTcpLink::new(b, stripe, 0, threads[1], LINGER).unwrap(),
    )
}

#[test]
fn streams_arrive_in_order_over_helper_threads() {
    // Both ends threaded, with thread counts that differ between the ends and divide the
    // sockets unevenly.
    for (socks, stripe, threads) in [
        (1, MIN_STRIPE, [1, 1]),
        (2, MIN_STRIPE, [1, 2]),
        (3, MIN_STRIPE, [2, 3]),
        (4, 192 << 10, [2, 4]),
        (8, MIN_STRIPE, [3, 1]),
    ] {
        let (mut a, mut b) = threaded_pair(socks, stripe, threads);
        for (i, &len) in [1usize, 7, 65_537, 1 << 20, 3 * (1 << 20) + 12_345].iter().enumerate() {
            let msg = bytes(len, (socks * 100 + i) as u64);
            for (sp, rp) in [(len, len), (4_099, 70_001), (MIN_STRIPE + 1, 1 << 21)] {
                let [ab, ba] = exchange(&mut a, &mut b, &msg, sp.max(1), rp.max(1));
                let what = format!("{socks} sockets, threads {threads:?}, {len} bytes, pieces {sp}/{rp}");
                assert!(ab == msg, "{what}: a->b differs");
                assert!(ba == msg, "{what}: b->a differs");
            }
        }
    }
}

#[test]
fn a_threaded_end_talks_to_an_engine_driven_end() {
    for (socks, threads) in [(1, 1), (4, 2)] {
        let (a, b) = socket_pairs(socks);
        let mut a = ThreadedTcpLink::new(a, MIN_STRIPE, 1, threads, LINGER).unwrap();
        let mut b = TcpLink::striped(b, MIN_STRIPE, 0).unwrap();
        for (i, &len) in [13usize, 200_001, 5 << 20].iter().enumerate() {
            let msg = bytes(len, 7 + i as u64);
            let [ab, ba] = exchange(&mut a, &mut b, &msg, 100_003, 77_777);
            assert!(ab == msg && ba == msg, "{socks} sockets, {threads} threads, {len} bytes differ");
        }
    }
}

#[test]
fn weighted_layouts_arrive_in_order_threaded_and_engine_driven() {
    // Uneven shares, a socket with two stripes in a row, and a threaded end facing an
    // engine-driven one (both with the same cycle).
    for (cycle, threads) in [(&[0u8, 1, 1][..], [2, 1]), (&[1, 0, 1, 1, 2, 2][..], [3, 2]), (&[0, 0, 1, 0][..], [1, 2])]
    {
        let n = *cycle.iter().max().unwrap() as usize + 1;
        let layout = Layout::weighted(n, MIN_STRIPE, cycle).unwrap();
        let (a, b) = socket_pairs(n);
        let mut ta = ThreadedTcpLink::with_layout(a, layout, 1, threads[0], LINGER).unwrap();
        let mut tb = ThreadedTcpLink::with_layout(b, layout, 0, threads[1], LINGER).unwrap();
        let (c, d) = socket_pairs(n);
        let mut tc = ThreadedTcpLink::with_layout(c, layout, 1, threads[0], LINGER).unwrap();
        let mut ed = TcpLink::with_layout(d, layout, 0).unwrap();
        for (i, &len) in [7usize, 65_537, 3 * (1 << 20) + 12_345].iter().enumerate() {
            let msg = bytes(len, 900 + i as u64);
            for (sp, rp) in [(len, len), (4_099, 70_001), (MIN_STRIPE + 1, 1 << 21)] {
                let [ab, ba] = exchange(&mut ta, &mut tb, &msg, sp, rp);
                assert!(ab == msg && ba == msg, "cycle {cycle:?}, {len} bytes, pieces {sp}/{rp}: threaded ends differ");
                let [cd, dc] = exchange(&mut tc, &mut ed, &msg, sp, rp);
                assert!(cd == msg && dc == msg, "cycle {cycle:?}, {len} bytes, pieces {sp}/{rp}: mixed ends differ");
            }
        }
    }
}

#[test]
fn in_place_reads_stop_at_stripe_ends_and_see_every_byte() {
    let (mut a, mut b) = threaded_pair(3, MIN_STRIPE, [2, 1]);
    let msg = bytes(5 * MIN_STRIPE + 999, 42);
    let mut sent = 0;
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < msg.len() {
        assert!(Instant::now() < deadline, "stalled at {} of {}", got.len(), msg.len());
        if sent < msg.len() {
            sent += b.try_send(&msg[sent..]).unwrap();
        }
        let before = got.len();
        let used = a
            .recv_in_place(msg.len() - got.len(), &mut |x, y| {
                got.extend_from_slice(x);
                got.extend_from_slice(y);
                x.len() + y.len()
            })
            .unwrap()
            .unwrap();
        assert_eq!(used, got.len() - before);
        // A view never crosses a stripe boundary (it comes from one socket's ring).
        assert!(before / MIN_STRIPE == (got.len().max(1) - 1) / MIN_STRIPE || used == 0);
    }
    assert!(got == msg);
}

#[test]
fn in_place_elements_may_straddle_a_stripe_boundary() {
    // As the engine's reductions do: only whole 8-byte elements are used, one of them
    // possibly split between the two views. The stream is offset by 3 bytes so elements
    // straddle every stripe boundary.
    let (mut a, mut b) = threaded_pair(3, MIN_STRIPE, [2, 2]);
    let lead = bytes(3, 1);
    let msg = bytes(4 * MIN_STRIPE + 8 * 1001, 77);
    let mut stream = lead.clone();
    stream.extend_from_slice(&msg);
    let mut sent = 0;
    let mut first = [0u8; 3];
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got_lead = 0;
    let mut got = Vec::new();
    while got.len() < msg.len() {
        assert!(Instant::now() < deadline, "stalled at {} of {}", got.len(), msg.len());
        if sent < stream.len() {
            sent += b.try_send(&stream[sent..]).unwrap();
        }
        if got_lead < 3 {
            got_lead += a.try_recv(&mut first[got_lead..]).unwrap();
            continue;
        }
        let used = a
            .recv_in_place(msg.len() - got.len(), &mut |x, y| {
                if x.len() >= 8 {
                    let n = x.len() / 8 * 8;
                    got.extend_from_slice(&x[..n]);
                    n
                } else if x.len() + y.len() >= 8 {
                    got.extend_from_slice(x);
                    got.extend_from_slice(&y[..8 - x.len()]);
                    8
                } else {
                    0
                }
            })
            .unwrap()
            .unwrap();
        if used == 0 {
            // What the engine does when nothing moved: arm, and sleep only when told to.
            if a.arm(Interest { read: true, write: false }).unwrap() {
                Links::wait(&[(&a as &dyn Link, Interest { read: true, write: false })], None, Duration::from_secs(5))
                    .unwrap();
            }
        }
    }
    assert_eq!(first.to_vec(), lead);
    assert!(got == msg, "elements differ");
}

#[test]
fn a_peer_that_closes_within_an_element_fails_in_place_reads() {
    // The peer leaves 3 bytes (less than an element) and closes: an in-place reduction can
    // never use them, so the link must fail rather than report "nothing yet" forever.
    for (socks, lead) in [(1, 0), (2, MIN_STRIPE - 2)] {
        let (mut a, b) = threaded_pair(socks, MIN_STRIPE, [1, 1]);
        let mut b = b;
        let data = bytes(lead + 3, 5);
        let mut sent = 0;
        while sent < data.len() {
            sent += b.try_send(&data[sent..]).unwrap();
        }
        drop(b);
        let mut skip = vec![0u8; lead];
        let mut got = 0;
        let deadline = Instant::now() + Duration::from_secs(10);
        while got < lead {
            got += a.try_recv(&mut skip[got..]).unwrap();
            assert!(Instant::now() < deadline);
        }
        let err = loop {
            assert!(Instant::now() < deadline, "{socks} sockets: no error within 10 s");
            let r = a.recv_in_place(8, &mut |x, y| if x.len() + y.len() >= 8 { 8 } else { 0 });
            match r {
                Ok(Some(0)) => std::thread::sleep(Duration::from_millis(1)),
                Ok(n) => panic!("used {n:?} bytes of 3"),
                Err(e) => break e,
            }
        };
        assert!(err.message().contains("closed"), "{}", err.message());
    }
}

#[test]
fn dropping_a_link_delivers_what_it_took_then_the_peer_sees_the_close() {
    for socks in [1, 4] {
        let (mut a, mut b) = threaded_pair(socks, MIN_STRIPE, [2, 2]);
        let msg = bytes(3 << 20, socks as u64);
        // `b` takes as much as its rings hold and is dropped at once; the drop must flush.
        let sender = std::thread::spawn(move || {
            let mut sent = 0;
            while sent < msg.len() {
                sent += b.try_send(&msg[sent..]).unwrap();
                std::thread::yield_now();
            }
            drop(b);
            msg
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 100_000];
        let deadline = Instant::now() + Duration::from_secs(20);
        let err = loop {
            assert!(Instant::now() < deadline, "no end of stream within 20 s");
            match a.try_recv(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
        };
        let msg = sender.join().unwrap();
        assert!(got == msg, "{socks} sockets: got {} of {} bytes before the error", got.len(), msg.len());
        assert!(err.message().contains("closed"), "{}", err.message());
    }
}

#[test]
fn a_shut_down_link_still_hands_over_what_it_took() {
    // Like a socket's kernel buffer: bytes the engine counted as sent reach the peer even
    // when the link is shut down (an error elsewhere) right after, then the stream ends.
    let (mut a, mut b) = threaded_pair(2, MIN_STRIPE, [1, 2]);
    let msg = bytes(1 << 20, 3);
    let mut sent = 0;
    while sent < msg.len() {
        sent += a.try_send(&msg[sent..]).unwrap();
    }
    a.shutdown();
    assert!(a.try_send(b"more").is_err(), "a shut-down link takes no more bytes");
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65_536];
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        assert!(Instant::now() < deadline, "no end of stream within 10 s");
        match b.try_recv(&mut buf) {
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    assert!(got == msg, "got {} of {} bytes", got.len(), msg.len());
    assert!(err.message().contains("closed"), "{}", err.message());
}

#[test]
fn the_engine_sleeps_until_a_helper_has_bytes_for_it() {
    let (mut a, mut b) = threaded_pair(2, MIN_STRIPE, [1, 1]);
    let read = Interest { read: true, write: false };
    assert!(a.arm(read).unwrap(), "nothing to read: may sleep");
    let start = Instant::now();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(b.try_send(b"x").unwrap(), 1);
        b
    });
    Links::wait(&[(&a as &dyn Link, read)], None, Duration::from_secs(10)).unwrap();
    let waited = start.elapsed();
    assert!(waited < Duration::from_secs(5), "woke only after {waited:?}");
    let mut got = [0u8; 1];
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.try_recv(&mut got).unwrap() == 0 {
        assert!(Instant::now() < deadline);
    }
    assert_eq!(&got, b"x");
    assert!(!a.arm(Interest { read: false, write: true }).unwrap(), "room to write: do not sleep");
    drop(t.join().unwrap());
}

#[test]
fn shutdown_ends_helpers_blocked_on_a_peer_that_does_not_read() {
    let (mut a, b) = threaded_pair(2, MIN_STRIPE, [2, 2]);
    let msg = vec![5u8; 64 << 20];
    // Fill the rings and the kernel buffers: `b` never reads.
    let mut sent = 0;
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        sent += a.try_send(&msg[sent..]).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(sent < msg.len(), "64 MiB fit into buffers of a peer that reads nothing");
    let start = Instant::now();
    a.shutdown();
    drop(a);
    drop(b);
    assert!(start.elapsed() < Duration::from_secs(5), "shutdown and drop took {:?}", start.elapsed());
}

/// Two threaded links over `n` data sockets on two rails (socket `s` on rail `s mod 2`), each
/// with one spare per socket, all on loopback.
fn railed_pair(n: usize, threads: usize) -> (ThreadedTcpLink, ThreadedTcpLink) {
    railed(n, 2, threads)
}

/// Two threaded links over `n` data sockets on `rails` rails (socket `s` on rail
/// `s mod rails`), each with a spare per socket on every other rail, all on loopback.
fn railed(n: usize, rails: usize, threads: usize) -> (ThreadedTcpLink, ThreadedTcpLink) {
    // Failures are reported by the test, not found by the timeout: a long one cannot fire.
    railed_with(n, rails, threads, Duration::from_secs(5))
}

/// As [`railed`], with `OXCCL_RAIL_TIMEOUT_MS` `timeout`.
fn railed_with(n: usize, rails: usize, threads: usize, timeout: Duration) -> (ThreadedTcpLink, ThreadedTcpLink) {
    let (mut a, mut b) = socket_pairs(rails * n);
    let (sa, sb) = (a.split_off(n), b.split_off(n));
    let plan =
        |spares, me| RailPlan { rails, names: (0..rails).map(|r| format!("rail{r}")).collect(), spares, timeout, me };
    let l = Layout::weighted(n, MIN_STRIPE, &(0..n as u8).chain([1]).collect::<Vec<_>>()).unwrap();
    (
        ThreadedTcpLink::with_rails(a, l, 1, threads, LINGER, Some(plan(sa, 0))).unwrap(),
        ThreadedTcpLink::with_rails(b, l, 0, threads, LINGER, Some(plan(sb, 1))).unwrap(),
    )
}

/// Sends `msg` both ways between `a` and `b`; once `a` has sent `at` bytes, runs `hit(a)`.
/// Returns what each end received, or the first error.
fn pump(
    a: &mut ThreadedTcpLink,
    b: &mut ThreadedTcpLink,
    msg: &[u8],
    at: usize,
    hit: &dyn Fn(&ThreadedTcpLink),
) -> Result<[Vec<u8>; 2]> {
    let (mut got, mut sent, mut hit_done) = ([Vec::new(), Vec::new()], [0usize; 2], false);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = vec![0u8; 300_007];
    while got.iter().any(|g| g.len() < msg.len()) {
        if Instant::now() > deadline {
            return Err(Error::timeout(format!("stalled: sent {sent:?}, got {}/{}", got[0].len(), got[1].len())));
        }
        if !hit_done && sent[0] >= at {
            hit(a);
            hit_done = true;
        }
        let mut moved = 0;
        for side in 0..2 {
            let (tx, rx): (&mut ThreadedTcpLink, &mut ThreadedTcpLink) =
                if side == 0 { (&mut *a, &mut *b) } else { (&mut *b, &mut *a) };
            let end = (sent[side] + 1_000_003).min(msg.len());
            let n = tx.try_send(&msg[sent[side]..end])?;
            sent[side] += n;
            let want = buf.len().min(msg.len() - got[1 - side].len());
            let m = rx.try_recv(&mut buf[..want])?;
            got[1 - side].extend_from_slice(&buf[..m]);
            moved += n + m;
        }
        if moved == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(got)
}

/// The error `l` (end `end`, which receives nothing more) reports within 10 s.
fn first_error(l: &mut ThreadedTcpLink, end: &str) -> Error {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match l.try_recv(&mut [0u8; 64]) {
            Err(e) => return e,
            Ok(n) => assert!(n == 0 && Instant::now() < deadline, "{end}: no error within 10 s"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_failed_rail_moves_to_its_spares_and_every_byte_arrives_once() {
    for (socks, threads) in [(2, 2), (4, 2)] {
        let (mut a, mut b) = railed_pair(socks, threads);
        let msg = bytes(24 << 20, socks as u64);
        let fail1 = |l: &ThreadedTcpLink| l.ctl.as_ref().unwrap().fail_rail(1);
        let [ab, ba] = pump(&mut a, &mut b, &msg, 6 << 20, &fail1).unwrap();
        assert!(ab == msg && ba == msg, "{socks} sockets: the streams differ after the failover");
        // The link carries on, every socket now on rail 0.
        let more = bytes(3 << 20, 99);
        let [ab, ba] = pump(&mut a, &mut b, &more, usize::MAX, &|_| {}).unwrap();
        assert!(ab == more && ba == more, "{socks} sockets: the streams differ after the failover");
        // Rail 0 is the last one: its loss fails the link at both ends, naming the peer.
        a.ctl.as_ref().unwrap().fail_rail(0);
        for (end, l) in [("a", &mut a), ("b", &mut b)] {
            let e = first_error(l, end);
            // The end that found no rail left names the rails; the other sees the link end.
            let (peer, says) =
                if end == "a" { ("peer rank 1", "(rails rail0, rail1)") } else { ("peer rank 0", "closed") };
            assert!(e.message().contains(peer) && e.message().contains(says), "{end}: {}", e.message());
        }
    }
}

#[test]
fn spares_cover_every_other_rail_and_the_first_one_not_lost_is_picked() {
    // 3 sockets over 3 rails: socket s's spares run on the rails after its own, in turn.
    let rails: Vec<Vec<usize>> = (0..3).map(|s| (0..2).map(|k| spare_rail(k * 3 + s, 3, 3)).collect()).collect();
    assert_eq!(rails, [[1, 2], [2, 0], [0, 1]]);
    // Two rails: one spare per socket, on the other rail (as with one spare per socket).
    assert_eq!((0..4).map(|j| spare_rail(j, 4, 2)).collect::<Vec<_>>(), [1, 0, 1, 0]);
    let lost = |l: &[usize]| (0..3).map(|r| l.contains(&r)).collect::<Vec<bool>>();
    assert_eq!(failover::pick_spare(1, 3, &lost(&[1])), Some(1)); // socket 1: rail1 -> rail2
    assert_eq!(failover::pick_spare(1, 3, &lost(&[1, 2])), Some(4)); // then rail2 -> rail0
    assert_eq!(failover::pick_spare(2, 3, &lost(&[1, 2])), Some(2)); // socket 2: rail2 -> rail0
    assert_eq!(failover::pick_spare(0, 3, &lost(&[0, 1, 2])), None);
}

#[test]
fn three_rails_lose_two_in_turn_and_every_byte_arrives_once() {
    for (socks, threads) in [(3, 3), (6, 2)] {
        let (mut a, mut b) = railed(socks, 3, threads);
        let msg = bytes(12 << 20, socks as u64);
        let fail = |r: usize| move |l: &ThreadedTcpLink| l.ctl.as_ref().unwrap().fail_rail(r);
        // rail1 found failed by one end, then rail2 by the other.
        // (A rail failed by the test still works on loopback: the streams may end before the
        // recovery does, so both ends are waited for, up to 10 s.)
        let settled = |a: &ThreadedTcpLink, b: &ThreadedTcpLink, want: &[usize]| {
            let deadline = Instant::now() + Duration::from_secs(10);
            for l in [a, b] {
                let ctl = l.ctl.as_ref().unwrap();
                while ctl.rails_in_use() != want {
                    assert!(Instant::now() < deadline, "{socks} sockets: on rails {:?}", ctl.rails_in_use());
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        let [ab, ba] = pump(&mut a, &mut b, &msg, 4 << 20, &fail(1)).unwrap();
        assert!(ab == msg && ba == msg, "{socks} sockets: the streams differ after losing rail1");
        settled(&a, &b, &[0, 2]);
        let [ab, ba] = pump(&mut b, &mut a, &msg, 4 << 20, &fail(2)).unwrap();
        assert!(ab == msg && ba == msg, "{socks} sockets: the streams differ after losing rail2");
        settled(&a, &b, &[0]);
        let more = bytes(3 << 20, 99);
        let [ab, ba] = pump(&mut a, &mut b, &more, usize::MAX, &|_| {}).unwrap();
        assert!(ab == more && ba == more, "{socks} sockets: the streams differ on the last rail");
        // rail0 is the last one: its loss fails the link at both ends, naming the peer.
        a.ctl.as_ref().unwrap().fail_rail(0);
        for (end, l) in [("a", &mut a), ("b", &mut b)] {
            let e = first_error(l, end);
            let (peer, says) = if end == "a" {
                ("peer rank 1", "it was the last rail; lost before: rail1, rail2")
            } else {
                ("peer rank 0", "closed")
            };
            assert!(e.message().contains(peer) && e.message().contains(says), "{end}: {}", e.message());
        }
    }
}

#[test]
fn a_live_peer_that_does_not_read_is_not_taken_for_a_dead_rail() {
    // 200 ms rail timeout; `b` reads nothing for 2 s while `a` fills every window (its bytes
    // then wait unsent, and the kernel probes `b`'s closed windows, which `b` answers).
    let (mut a, mut b) = railed_with(2, 2, 2, Duration::from_millis(200));
    let msg = bytes(48 << 20, 5);
    let (mut sent, start) = (0, Instant::now());
    while start.elapsed() < Duration::from_secs(2) {
        sent += a.try_send(&msg[sent..]).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    for (end, l) in [("a", &a), ("b", &b)] {
        let ctl = l.ctl.as_ref().unwrap();
        assert!(ctl.rails_in_use() == [0, 1], "{end}: a socket moved: rails {:?}", ctl.rails_in_use());
        assert!(!ctl.reported(), "{end}: a socket was reported failed");
    }
    assert!(sent < msg.len(), "48 MiB fit into the buffers of a peer that reads nothing");
    // Then everything arrives.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < msg.len() {
        assert!(Instant::now() < deadline, "stalled at {} of {}", got.len(), msg.len());
        sent += a.try_send(&msg[sent..]).unwrap();
        let m = b.try_recv(&mut buf).unwrap();
        got.extend_from_slice(&buf[..m]);
        if m == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    assert!(got == msg, "the stream differs");
}
