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
