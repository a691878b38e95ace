//! `Communicator::split` / `shrink` (ncclCommSplit / ncclCommShrink) on ranks run as threads:
//! the parent is in-memory, the children rendezvous over loopback TCP.

use oxccl::{Communicator, ReduceOp};

fn on_loopback() {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
}

#[test]
fn split_by_color_orders_by_key_and_children_reduce() {
    on_loopback();
    let n = 5;
    let comms = Communicator::in_memory(n);
    // color: parity, rank 4 takes no color; key: reverse rank order.
    let color = |r: usize| if r == 4 { None } else { Some((r % 2) as u32) };
    let results: Vec<Option<(usize, usize, f64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let child = c.split(color(c.rank()), -(c.rank() as i32)).unwrap()?;
                    let mut v = [c.rank() as f64 + 0.5];
                    child.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                    Some((child.rank(), child.size(), v[0]))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, got) in results.iter().enumerate() {
        let Some(col) = color(r) else {
            assert!(got.is_none(), "rank {r} had no color but got a child");
            continue;
        };
        let mut members: Vec<usize> = (0..n).filter(|&q| color(q) == Some(col)).collect();
        members.reverse();
        let want_sum: f64 = members.iter().map(|&q| q as f64 + 0.5).sum();
        let (cr, cn, sum) = got.expect("a colored rank gets a child");
        assert_eq!((cr, cn), (members.iter().position(|&q| q == r).unwrap(), members.len()), "rank {r}");
        assert_eq!(sum, want_sum, "rank {r}");
    }
}

#[test]
fn shrink_excludes_ranks_that_do_not_call_it() {
    on_loopback();
    let n = 4;
    let comms = Communicator::in_memory(n);
    let exclude = [1usize];
    let results: Vec<Option<(usize, usize, i64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    if exclude.contains(&c.rank()) {
                        return None;
                    }
                    let child = c.shrink(&exclude).unwrap();
                    let mut v = [(c.rank() as i64 + 1) * 10];
                    child.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                    Some((child.rank(), child.size(), v[0]))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let survivors: Vec<usize> = (0..n).filter(|r| !exclude.contains(r)).collect();
    let want: i64 = survivors.iter().map(|&r| (r as i64 + 1) * 10).sum();
    for (i, &r) in survivors.iter().enumerate() {
        assert_eq!(results[r], Some((i, survivors.len(), want)), "rank {r}");
    }
    assert!(comms[0].shrink(&[0]).is_err(), "a rank in its own exclude list must be refused");
    assert!(comms[0].shrink(&[9]).is_err(), "an out-of-range rank must be refused");
}

#[test]
fn shrink_of_a_healthy_tcp_parent_twice_keeps_the_parent_usable() {
    on_loopback();
    let n = 3;
    let id = oxccl::UniqueId::new().unwrap();
    // Per rank: ((size, rank, sum) per shrink, parent sum afterwards).
    type RankResult = (Vec<(usize, usize, f64)>, f64);
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let id = &id;
                s.spawn(move || {
                    let c = Communicator::init_rank(n, id, r).unwrap();
                    let mut kids = Vec::new();
                    if r != 1 {
                        // Two shrinks of one parent with the same members: separate rendezvous.
                        for round in 0..2 {
                            let child = c.shrink(&[1]).unwrap();
                            let mut v = [r as f64 * 10.0 + round as f64];
                            child.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                            kids.push((child.rank(), child.size(), v[0]));
                        }
                    }
                    // The parent, excluded rank included, still works.
                    let mut v = [r as f64 + 1.0];
                    c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                    (kids, v[0])
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (kids, parent_sum)) in results.iter().enumerate() {
        assert_eq!(*parent_sum, 6.0, "rank {r}: parent all-reduce after the shrinks");
        if r == 1 {
            assert!(kids.is_empty());
            continue;
        }
        let want: Vec<(usize, usize, f64)> = (0..2).map(|round| (r / 2, 2, 20.0 + 2.0 * round as f64)).collect();
        assert_eq!(kids, &want, "rank {r}");
    }
}
