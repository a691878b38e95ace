//! The all-reduce correctness check shared by the multi-process tests: every rank's input is
//! generated deterministically, the result is compared element by element with a reference
//! computed here in f64 from all ranks' inputs.

use oxccl::{Communicator, DataType, ReduceOp};

/// Relative precision of each type (unit roundoff, doubled for safety on narrow types).
pub fn eps(t: DataType) -> f64 {
    match t {
        DataType::Float8e4m3 => 0.125,
        DataType::Float8e5m2 => 0.25,
        DataType::Float16 => 2f64.powi(-10),
        DataType::Bfloat16 => 2f64.powi(-7),
        DataType::Float32 => 2f64.powi(-23),
        DataType::Float64 => 2f64.powi(-52),
        _ => 0.0,
    }
}

pub fn unsigned(t: DataType) -> bool {
    matches!(t, DataType::Uint8 | DataType::Uint32 | DataType::Uint64)
}

/// Expected value and allowed error for element `i`.
pub fn reference(t: DataType, op: ReduceOp, n: usize, i: usize, seed: usize) -> (f64, f64) {
    let xs: Vec<f64> = (0..n).map(|r| super::input(r, i, seed, unsigned(t), op == ReduceOp::Prod)).collect();
    let abs_sum: f64 = xs.iter().map(|x| x.abs()).sum();
    match op {
        ReduceOp::Sum => (xs.iter().sum(), n as f64 * eps(t) * abs_sum),
        ReduceOp::Prod => (xs.iter().product(), 0.0),
        ReduceOp::Max => (xs.iter().cloned().fold(f64::MIN, f64::max), 0.0),
        ReduceOp::Min => (xs.iter().cloned().fold(f64::MAX, f64::min), 0.0),
        ReduceOp::Avg => {
            let s: f64 = xs.iter().sum();
            if t.is_float() {
                (s / n as f64, (n as f64 * eps(t) * abs_sum) / n as f64 + eps(t) * (s / n as f64).abs())
            } else {
                ((s / n as f64).trunc(), 0.0)
            }
        }
    }
}

pub fn check_case(
    comm: &Communicator,
    t: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: usize,
) -> Result<(), String> {
    check_case_in(comm, t, op, count, in_place, seed, [false, false])
}

/// A test buffer: on the heap, or at an odd-cache-line offset inside shareable host memory
/// (`oxccl::SharedBuffer`, what `ncclMemAlloc` returns), which the host arena reads in place.
enum Buf {
    Heap(Vec<u8>),
    Shared(oxccl::SharedBuffer, usize),
}

impl Buf {
    const OFF: usize = 192;
    fn new(bytes: &[u8], shared: bool) -> Buf {
        if !shared {
            return Buf::Heap(bytes.to_vec());
        }
        let b = oxccl::SharedBuffer::new(bytes.len() + 2 * Self::OFF).expect("shareable memory");
        // SAFETY: the buffer holds OFF + len bytes past its start.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.as_ptr().add(Self::OFF), bytes.len()) };
        Buf::Shared(b, bytes.len())
    }
    fn ptr(&mut self) -> *mut u8 {
        match self {
            Buf::Heap(v) => v.as_mut_ptr(),
            // SAFETY: OFF lies inside the buffer.
            Buf::Shared(b, _) => unsafe { b.as_ptr().add(Self::OFF) },
        }
    }
    fn bytes(&mut self) -> Vec<u8> {
        match self {
            Buf::Heap(v) => v.clone(),
            // SAFETY: `len` initialised bytes at OFF, not written meanwhile.
            Buf::Shared(b, len) => unsafe { std::slice::from_raw_parts(b.as_ptr().add(Self::OFF), *len).to_vec() },
        }
    }
}

/// [`check_case`] with the send and receive buffers in shareable host memory where `shared`
/// says (`[send, recv]`; in place, the one buffer is shared if either is).
pub fn check_case_in(
    comm: &Communicator,
    t: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: usize,
    shared: [bool; 2],
) -> Result<(), String> {
    let (rank, n) = (comm.rank(), comm.size());
    let vals: Vec<f64> = (0..count).map(|i| super::input(rank, i, seed, unsigned(t), op == ReduceOp::Prod)).collect();
    let mut input = vec![0u8; count * t.size()];
    oxccl::reduce::from_f64(t, &vals, &mut input);
    let mut send = Buf::new(&input, shared[0] || (in_place && shared[1]));
    let mut recv = if in_place { Buf::new(&[], false) } else { Buf::new(&vec![0xA5u8; input.len()], shared[1]) };
    let r = if in_place {
        let p = send.ptr();
        // SAFETY: the buffer holds count elements; in place.
        unsafe { comm.all_reduce_raw(p, p, count, t, op) }
    } else {
        // SAFETY: both buffers hold count elements and do not overlap.
        unsafe { comm.all_reduce_raw(send.ptr(), recv.ptr(), count, t, op) }
    };
    r.map_err(|e| format!("{t:?} {op:?} count {count} shared {shared:?}: {e}"))?;
    let got = oxccl::reduce::to_f64(t, &if in_place { send.bytes() } else { recv.bytes() });
    for (i, g) in got.iter().enumerate() {
        let (want, tol) = reference(t, op, n, i, seed);
        if (g - want).abs() > tol {
            return Err(format!("rank {rank}: {t:?} {op:?} count {count} in_place {in_place} shared {shared:?}: element {i} is {g}, want {want} (tolerance {tol})"));
        }
    }
    Ok(())
}

/// Runs the whole type × op matrix, in place and out of place, for each of `counts`.
pub fn check_matrix(comm: &Communicator, counts: &[usize]) -> Result<(), String> {
    let mut seed = 0;
    for &count in counts {
        for t in DataType::ALL {
            for op in ReduceOp::ALL {
                for in_place in [false, true] {
                    seed += 1;
                    check_case(comm, t, op, count, in_place, seed)?;
                }
            }
        }
    }
    Ok(())
}
