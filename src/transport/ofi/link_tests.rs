//! Two ofi links joined over loopback through libfabric's TCP provider.

use super::*;
use crate::transport::tcp::tests::{bytes, exchange, socket_pairs};

/// A pair of links over `tcp;ofi_rxm` on 127.0.0.1; `None` (after a SKIPPED line) where
/// libfabric or that provider is missing.
fn pair(chunk: usize, depth: usize) -> Option<(OfiLink, OfiLink)> {
    use std::io::Write;
    let skip = |why: String| {
        let _ = std::io::stderr().write_all(format!("SKIPPED: ofi link tests: {why}\n").as_bytes());
    };
    if let Err(why) = super::super::loaded() {
        skip(why);
        return None;
    }
    // Two rails (endpoints) of this process, on two loopback addresses, as two hosts'd have.
    let open = |ip: &str| Rail::get(Some("tcp;ofi_rxm"), Some(ip));
    let (ra, rb) = match (open("127.0.0.1"), open("127.0.0.2")) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            skip(format!("no tcp;ofi_rxm endpoint on 127.0.0.1/127.0.0.2: {}", e.message()));
            return None;
        }
    };
    assert_eq!(ra.provider, "tcp;ofi_rxm");
    let (pa, pb) = (super::super::rail::new_prefix().unwrap(), super::super::rail::new_prefix().unwrap());
    let fa = ra.core.lock().insert(&rb.addr).unwrap();
    let fb = rb.core.lock().insert(&ra.addr).unwrap();
    let to_b = PeerAddr { fi_addr: fa, name: "b".into(), send_prefix: pb, recv_prefix: pa };
    let to_a = PeerAddr { fi_addr: fb, name: "a".into(), send_prefix: pa, recv_prefix: pb };
    let (sa, sb) = socket_pairs(1);
    let linger = Duration::from_secs(10);
    let la = OfiLink::new(vec![(ra, to_b)], vec![0], chunk, vec![depth], sa, 1, linger).unwrap();
    let lb = OfiLink::new(vec![(rb, to_a)], vec![0], chunk, vec![depth], sb, 0, linger).unwrap();
    Some((la, lb))
}

#[test]
fn an_address_of_another_length_than_the_providers_is_refused_before_libfabric_reads_it() {
    if super::super::loaded().is_err() {
        let _ = pair(4096, 1); // prints the SKIPPED line
        return;
    }
    let Ok(mut a) = Endpoint::open(Some("tcp;ofi_rxm"), Some("127.0.0.1")) else {
        let _ = pair(4096, 1); // prints the SKIPPED line
        return;
    };
    let real = a.name().unwrap();
    for len in [0, 1, real.len() - 1, real.len() + 1, 4096] {
        let e = a.insert(&vec![0u8; len]).expect_err("a wrong length is refused");
        assert!(e.message().contains(&format!("address is {len} bytes")), "{e}");
    }
    a.insert(&real).expect("an address of the provider's length is taken");
}

#[test]
fn streams_arrive_in_order_both_ways_for_odd_sizes_and_pieces() {
    let Some((mut a, mut b)) = pair(64 << 10, 3) else { return };
    for (i, &len) in [1usize, 7, 4096, 65_535, 65_537, 1 << 20, 3 * (1 << 20) + 12_345].iter().enumerate() {
        let msg = bytes(len, i as u64 + 7);
        for (sp, rp) in [(len, len), (4_099, 70_001), (100_000, 333)] {
            let [ab, ba] = exchange(&mut a, &mut b, &msg, sp.max(1), rp.max(1));
            assert!(ab == msg, "{len} bytes, pieces {sp}/{rp}: a->b differs");
            assert!(ba == msg, "{len} bytes, pieces {sp}/{rp}: b->a differs");
        }
    }
    assert!(a.describe().contains("OFI tcp;ofi_rxm"), "{}", a.describe());
}

#[test]
fn in_place_reads_see_the_stream_in_order_across_messages() {
    let Some((mut a, mut b)) = pair(4096, 2) else { return };
    let msg = bytes(10_000, 3);
    read_in_place(&mut a, &mut b, &msg, usize::MAX);
}

#[test]
fn a_dead_peer_is_an_error_when_the_engine_waits() {
    let Some((mut a, b)) = pair(4096, 2) else { return };
    b.shutdown();
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match a.arm(Interest { read: true, write: false }) {
            Err(e) => {
                assert!(e.message().contains("closed the connection"), "{}", e.message());
                break;
            }
            Ok(_) => assert!(Instant::now() < deadline, "no error within 5 s"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_dropped_link_delivers_what_it_counted_as_sent() {
    let Some((mut a, mut b)) = pair(256 << 10, 4) else { return };
    let msg = bytes(900_000, 11);
    let mut sent = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = vec![0u8; msg.len()];
    let mut n = 0;
    // Send all (the receiver takes a little so the window keeps moving), then drop the sender
    // at once: its last messages are still in flight.
    while sent < msg.len() {
        assert!(Instant::now() < deadline);
        sent += a.try_send(&msg[sent..]).unwrap();
        n += b.try_recv(&mut got[n..(n + 1000).min(msg.len())]).unwrap();
    }
    let t = std::thread::spawn(move || drop(a));
    while n < msg.len() {
        assert!(Instant::now() < deadline, "received {n} of {}", msg.len());
        n += b.try_recv(&mut got[n..]).unwrap();
    }
    t.join().unwrap();
    assert!(got == msg);
}

/// Two links striped over two rails each (a on 127.0.0.1 and 127.0.0.3, b on 127.0.0.2 and
/// 127.0.0.4), messages spread by `cycle`; `None` (after a SKIPPED line) without the provider.
fn striped(chunk: usize, depth: usize, cycle: &[u8]) -> Option<(OfiLink, OfiLink)> {
    striped_into(chunk, depth, cycle, None)
}

/// As [`striped`], but where `hole` is given, `a`'s rail-1 peer is that address instead of
/// `b`'s (a sends its rail-1 messages there; b still expects them on its rail 1).
fn striped_into(chunk: usize, depth: usize, cycle: &[u8], hole: Option<&[u8]>) -> Option<(OfiLink, OfiLink)> {
    if super::super::loaded().is_err() {
        let _ = pair(4096, 1); // prints the SKIPPED line
        return None;
    }
    // (libfabric is loaded before any endpoint opens: the shim's calls go through it.)
    let open = |ip: &str| Rail::get(Some("tcp;ofi_rxm"), Some(ip)).ok();
    let rails: Vec<Arc<Rail>> =
        ["127.0.0.1", "127.0.0.3", "127.0.0.2", "127.0.0.4"].iter().filter_map(|ip| open(ip)).collect();
    if rails.len() < 4 {
        let _ = pair(4096, 1); // prints the SKIPPED line
        return None;
    }
    let mut to_b = Vec::new();
    let mut to_a = Vec::new();
    for r in 0..2 {
        let (ra, rb) = (&rails[r], &rails[2 + r]);
        let (pa, pb) = (super::super::rail::new_prefix().unwrap(), super::super::rail::new_prefix().unwrap());
        let to = if r == 1 { hole.unwrap_or(&rb.addr) } else { &rb.addr };
        let fa = ra.core.lock().insert(to).unwrap();
        let fb = rb.core.lock().insert(&ra.addr).unwrap();
        to_b.push((ra.clone(), PeerAddr { fi_addr: fa, name: format!("b{r}"), send_prefix: pb, recv_prefix: pa }));
        to_a.push((rb.clone(), PeerAddr { fi_addr: fb, name: format!("a{r}"), send_prefix: pa, recv_prefix: pb }));
    }
    // One credit connection per rail.
    let (sa, sb) = socket_pairs(2);
    let linger = Duration::from_secs(10);
    let la = OfiLink::new(to_b, cycle.to_vec(), chunk, vec![depth; 2], sa, 1, linger).unwrap();
    let lb = OfiLink::new(to_a, cycle.to_vec(), chunk, vec![depth; 2], sb, 0, linger).unwrap();
    assert_eq!((la.rails(), lb.rails()), (2, 2));
    Some((la, lb))
}

#[test]
fn a_stream_striped_over_two_rails_arrives_in_order_both_ways() {
    // Equal shares, and one rail taking two messages of three.
    for cycle in [&[0u8, 1][..], &[1, 0, 1]] {
        let Some((mut a, mut b)) = striped(16 << 10, 2, cycle) else { return };
        for (i, &len) in [1usize, 5, 16 << 10, (16 << 10) + 1, 200_003].iter().enumerate() {
            let msg = bytes(len, i as u64 + 31);
            for (sp, rp) in [(len, len), (4_099, 70_001), (20_000, 333)] {
                let [ab, ba] = exchange(&mut a, &mut b, &msg, sp.max(1), rp.max(1));
                assert!(ab == msg, "cycle {cycle:?}, {len} bytes, pieces {sp}/{rp}: a->b differs");
                assert!(ba == msg, "cycle {cycle:?}, {len} bytes, pieces {sp}/{rp}: b->a differs");
            }
        }
        // Both rails carried messages.
        for on in &a.rails {
            let st = on.rail.core.lock();
            assert!(st.peers[&on.id].send_seq > 0, "cycle {cycle:?}: a rail unused");
        }
    }
}

#[test]
fn in_place_reads_of_a_striped_stream_span_the_rails() {
    let Some((mut a, mut b)) = striped(4096, 2, &[0, 1]) else { return };
    let msg = bytes(30_000, 5);
    read_in_place(&mut a, &mut b, &msg, 3000);
}

/// Sends `msg` from `a` in pieces of at most `piece` bytes while `b` reads it in place, 3000
/// bytes offered at a time; asserts that `b` read exactly `msg`.
fn read_in_place(a: &mut OfiLink, b: &mut OfiLink, msg: &[u8], piece: usize) {
    let mut got = Vec::new();
    let mut sent = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < msg.len() {
        assert!(Instant::now() < deadline, "stalled at {} of {}", got.len(), msg.len());
        if sent < msg.len() {
            sent += a.try_send(&msg[sent..sent.saturating_add(piece).min(msg.len())]).unwrap();
        }
        // Take 5 bytes fewer than offered when two slices come: a partial consumption.
        b.recv_in_place(3000, &mut |x, y| {
            let take = (x.len() + y.len()).saturating_sub(if y.is_empty() { 0 } else { 5 });
            got.extend_from_slice(&x[..take.min(x.len())]);
            got.extend_from_slice(&y[..take.saturating_sub(x.len())]);
            take
        })
        .unwrap();
    }
    assert!(got == msg);
}

/// Sends `msg` both ways between `a` and `b`, calling `arm` on both between pieces (where a
/// failover is found and carried out), and `inject` once `at` bytes reached `b`; returns what
/// each end received.
fn exchange_arming(
    a: &mut OfiLink,
    b: &mut OfiLink,
    msg: &[u8],
    at: usize,
    inject: &mut dyn FnMut(&mut OfiLink, &mut OfiLink),
) -> [Vec<u8>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    let mut sent = [0usize; 2];
    let mut injected = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    let both = Interest { read: true, write: true };
    while out.iter().any(|o| o.len() < msg.len()) {
        assert!(Instant::now() < deadline, "stalled: sent {sent:?}, received {}/{}", out[0].len(), out[1].len());
        if !injected && out[1].len() >= at {
            injected = true;
            inject(a, b);
        }
        for side in 0..2 {
            let (tx, rx) = if side == 0 { (&mut *a, &mut *b) } else { (&mut *b, &mut *a) };
            if sent[side] < msg.len() {
                sent[side] += tx.try_send(&msg[sent[side]..(sent[side] + 7_000).min(msg.len())]).unwrap();
            }
            let got = &mut out[1 - side];
            let mut buf = vec![0u8; 9_000.min(msg.len() - got.len())];
            let n = rx.try_recv(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
            tx.arm(both).unwrap();
        }
    }
    out
}

/// Marks link `l`'s state of stripe share `r` failed, as an error completion does.
fn break_share(l: &OfiLink, r: usize, why: &str) {
    let on = &l.rails[r];
    on.rail.core.lock().peers.get_mut(&on.id).unwrap().broken = Some(why.into());
}

#[test]
fn a_failed_rail_moves_its_share_and_the_stream_stays_exact_until_the_last_rail_fails() {
    let Some((mut a, mut b)) = striped(16 << 10, 3, &[0, 1]) else { return };
    let msg = bytes(700_001, 41);
    // The receiving end's rail 1 fails a third of the way in: b moves its share of rail 1 to
    // rail 0 and tells a, which moves its own and sends again what b had not received.
    let [ab, ba] = exchange_arming(&mut a, &mut b, &msg, 233_000, &mut |_, b| break_share(b, 1, "injected"));
    assert!(ab == msg, "a->b differs after the failover");
    assert!(ba == msg, "b->a differs after the failover");
    for (who, l) in [("a", &a), ("b", &b)] {
        assert_eq!((l.rails[1].carrier, l.rails[1].gen), (0, 1), "{who}: rail 1's share not moved once");
        assert!(l.phys[1].dead.is_some() && l.phys[0].dead.is_none(), "{who}");
        assert!(Arc::ptr_eq(&l.rails[1].rail, &l.phys[0].rail), "{who}: rail 1's share not on rail 0's endpoint");
    }
    // The link goes on over one rail, in place too.
    let [ab, ba] = exchange_arming(&mut a, &mut b, &msg[..100_003], usize::MAX, &mut |_, _| {});
    assert!(ab == msg[..100_003] && ba == msg[..100_003], "after the failover");
    read_in_place(&mut a, &mut b, &msg[..50_000], 3000);
    // The sending end's last rail fails: the link fails, naming the peer and both rails.
    break_share(&a, 0, "injected again");
    let e = a.arm(Interest { read: true, write: false }).expect_err("the last rail failed");
    let m = e.message();
    assert!(m.contains("peer rank 1") && m.contains("its last OFI rail"), "{m}");
    assert!(m.contains("injected again") && m.contains("the peer found it failed"), "{m}");
}

#[test]
fn a_rail_that_takes_no_sends_is_failed_over_after_the_rail_timeout() {
    if super::super::loaded().is_err() {
        let _ = pair(4096, 1); // prints the SKIPPED line
        return;
    }
    // An endpoint nobody ever reads the completion queue of: the provider never completes the
    // connection to it, so sends to it stay in flight without an error, as over a dead NIC.
    let Ok(mut hole) = Endpoint::open(Some("tcp;ofi_rxm"), Some("127.0.0.5")) else {
        let _ = pair(4096, 1); // prints the SKIPPED line
        return;
    };
    let addr = hole.name().unwrap();
    std::mem::forget(hole); // never closed (libfabric 1.17's rxm may crash closing it)
    let Some((mut a, mut b)) = striped_into(16 << 10, 2, &[0, 1], Some(&addr)) else { return };
    let t = Duration::from_millis(300);
    a.set_failover(0, vec!["a0".into(), "a1".into()], t);
    b.set_failover(1, vec!["b0".into(), "b1".into()], t);
    // One way, a to b (a's receives on rail 1 are directed to the hole too).
    let msg = bytes(300_007, 43);
    let start = Instant::now();
    let (mut sent, mut got) = (0, Vec::new());
    let both = Interest { read: true, write: true };
    while got.len() < msg.len() {
        assert!(start.elapsed() < Duration::from_secs(20), "stalled: sent {sent}, received {}", got.len());
        if sent < msg.len() {
            sent += a.try_send(&msg[sent..(sent + 7_000).min(msg.len())]).unwrap();
        }
        let mut buf = vec![0u8; 9_000.min(msg.len() - got.len())];
        let n = b.try_recv(&mut buf).unwrap();
        got.extend_from_slice(&buf[..n]);
        a.arm(both).unwrap();
        b.arm(Interest { read: true, write: false }).unwrap();
    }
    assert!(got == msg, "the stream differs after the failover");
    assert!(start.elapsed() >= t, "done in {:?}, before the rail timeout", start.elapsed());
    for (who, l) in [("a", &a), ("b", &b)] {
        assert_eq!((l.rails[1].carrier, l.rails[1].gen), (0, 1), "{who}: rail 1's share not moved once");
    }
    // a found it (the provider never connects to the hole, so it refuses a's sends there) and
    // told b.
    let why = [a.phys[1].dead.clone().unwrap(), b.phys[1].dead.clone().unwrap()];
    assert!(why[0].contains("for 300 ms") && why[1] == "the peer found it failed", "{why:?}");
}

#[test]
fn a_rail_whose_credit_connection_ends_is_failed_over_and_the_stream_goes_on_exactly_on_the_other() {
    let Some((mut a, mut b)) = striped(16 << 10, 3, &[0, 1]) else { return };
    let msg = bytes(700_001, 47);
    // A third of the way in, rail 0's credit connection (the pair's own) ends at a (as a reset
    // would end it); both ends see it end, write on rail 1's from then on, and fail rail 0 over
    // once it has been gone for the grace (waited out here, with the stream mid-way).
    let [ab, ba] = exchange_arming(&mut a, &mut b, &msg, 233_000, &mut |a, b| {
        a.conns[0].sock.shutdown(std::net::Shutdown::Both).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while a.conns[0].ended.is_none() || b.conns[0].ended.is_none() {
            assert!(Instant::now() < deadline, "the end of rail 0's credit connection not seen in 5 s");
            for l in [&mut *a, &mut *b] {
                l.arm(Interest { read: true, write: true }).unwrap();
            }
        }
        std::thread::sleep(CONN_GRACE + Duration::from_millis(50));
    });
    assert!(ab == msg, "a->b differs after the failover");
    assert!(ba == msg, "b->a differs after the failover");
    for (who, l) in [("a", &a), ("b", &b)] {
        assert_eq!((l.rails[0].carrier, l.rails[0].gen), (1, 1), "{who}: rail 0's share not moved once");
        assert_eq!((l.rails[1].carrier, l.rails[1].gen), (1, 0), "{who}: rail 1's share moved");
        assert!(l.phys[0].dead.is_some() && l.phys[1].dead.is_none(), "{who}: {:?}", l.phys[0].dead);
        assert!(l.conns[0].ended.is_some() && l.conns[1].ended.is_none(), "{who}");
        assert_eq!(l.cur, 1, "{who}: still writes on rail 0's connection");
        for r in 0..2 {
            assert!(Arc::ptr_eq(&l.rails[r].rail, &l.phys[1].rail), "{who}: share {r} not on rail 1's endpoint");
        }
    }
    // a saw its own connection end; b either saw it end too or was told first.
    let why = [a.phys[0].dead.clone().unwrap(), b.phys[0].dead.clone().unwrap()];
    assert!(why[0] == "its credit connection was closed", "{why:?}");
    assert!(why[1] == "its credit connection was closed" || why[1] == "the peer found it failed", "{why:?}");
    // The link goes on over rail 1 alone, both ways and in place.
    let sent: Vec<u64> = [&a, &b].iter().map(|l| l.with(0, false, |x, _| Ok(x.send_seq)).unwrap()).collect();
    let [ab, ba] = exchange_arming(&mut a, &mut b, &msg[..300_007], usize::MAX, &mut |_, _| {});
    assert!(ab == msg[..300_007] && ba == msg[..300_007], "after the failover");
    read_in_place(&mut a, &mut b, &msg[..50_000], 3000);
    for (k, l) in [&a, &b].iter().enumerate() {
        // Rail 0's share still carries its stripes (now on rail 1's endpoint).
        assert!(l.with(0, false, |x, _| Ok(x.send_seq)).unwrap() > sent[k]);
    }
}
