//! `ncclCommGrow` / `ncclCommGetUniqueId` (`Communicator::grow`, `grow_unique_id`,
//! `join_grow`): 2 rank processes grow to 4, the grow id passed to the joining processes out of
//! band (a file); all-reduce on the grown communicator checked against an f64 reference, and
//! the parent still usable. Ranks are copies of this test binary (see tests/common).

mod common;

use oxccl::{Communicator, ErrorKind, ReduceOp, UniqueId};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const OLD: usize = 2;
const NEW: usize = 4;
const ELEMS: usize = 100_003;

fn input(r: usize, i: usize) -> f32 {
    ((i * 3 + r * 17) % 29) as f32 - 14.0
}

fn check_sum(recv: &[f32], ranks: usize, what: &str) {
    for (i, &v) in recv.iter().enumerate() {
        let want: f64 = (0..ranks).map(|r| f64::from(input(r, i))).sum();
        assert_eq!(f64::from(v), want, "{what} at {i}");
    }
}

/// One rank: ranks 0..OLD form the parent, rank 0 makes the grow id and writes it to
/// `GROW_FILE`; ranks OLD..NEW read it and join. Prints `GROWN rank=<r> size=<n>`.
#[test]
fn grow_child() {
    let Some((rank, _, id)) = common::child_role() else { return };
    let file = PathBuf::from(std::env::var("GROW_FILE").expect("GROW_FILE"));
    let send: Vec<f32> = (0..ELEMS).map(|i| input(rank, i)).collect();
    let mut recv = vec![0f32; ELEMS];
    let (grown, parent) = if rank < OLD {
        let parent = Communicator::init_rank(OLD, &UniqueId::from_hex(&id).expect("id"), rank).expect("init");
        parent.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("parent all-reduce");
        check_sum(&recv, OLD, "parent");
        // Rank 0 coordinates and passes its id; rank 1 passes none (as in NCCL's example).
        let id = if rank == 0 {
            let g = parent.grow_unique_id().expect("grow id");
            let tmp = file.with_extension("tmp");
            std::fs::write(&tmp, g.to_hex()).expect("write the grow id");
            std::fs::rename(&tmp, &file).expect("publish the grow id");
            Some(g)
        } else {
            None
        };
        (parent.grow(NEW, id.as_ref()).expect("grow"), Some(parent))
    } else {
        let start = Instant::now();
        let hex = loop {
            if let Ok(h) = std::fs::read_to_string(&file) {
                break h;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no grow id after 30 s");
            std::thread::sleep(Duration::from_millis(10));
        };
        (Communicator::join_grow(NEW, &UniqueId::from_hex(&hex).expect("grow id"), rank).expect("join"), None)
    };
    assert_eq!((grown.rank(), grown.size()), (rank, NEW), "existing ranks keep their ranks");
    grown.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("grown all-reduce");
    check_sum(&recv, NEW, "grown");
    let mut x = [rank as f64 + 0.25];
    grown.all_reduce_in_place(&mut x, ReduceOp::Max).expect("grown max");
    assert_eq!(x[0], (NEW - 1) as f64 + 0.25);
    if let Some(p) = parent {
        p.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("parent after grow");
        check_sum(&recv, OLD, "parent after grow");
    }
    eprintln!("GROWN rank={} size={}", grown.rank(), grown.size());
}

#[test]
fn two_processes_grow_to_four() {
    let dir = std::env::temp_dir().join(format!("oxccl-grow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("grow-id");
    let env = vec![("GROW_FILE", file.display().to_string()), ("OXCCL_TIMEOUT_MS", "20000".to_string())];
    let out = common::run_ranks("grow_child", NEW, &env, Duration::from_secs(50));
    let _ = std::fs::remove_dir_all(&dir);
    common::assert_all_ok(&out);
    for (r, (_, err)) in out.iter().enumerate() {
        assert!(err.contains(&format!("GROWN rank={r} size={NEW}")), "rank {r}:\n{err}");
    }
}

#[test]
fn grow_needs_a_larger_size_and_exactly_one_id() {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let comms = Communicator::in_memory(2);
    let e = comms[0].grow(2, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // Nobody called grow_unique_id: both ranks get a clear error, nothing hangs.
    let errs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || c.grow(3, None).unwrap_err())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.message().contains("ncclCommGetUniqueId"), "{e}");
    }
    // Two different ids: refused on both.
    let errs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> =
            comms.iter().map(|c| s.spawn(move || c.grow(3, Some(&c.grow_unique_id().unwrap())).unwrap_err())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(e.message().contains("different grow ids"), "{e}");
    }
}
