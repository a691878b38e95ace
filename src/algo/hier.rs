//! Hierarchical all-reduce for ranks spread over several hosts.
//!
//! Ranks are grouped by host; the lowest rank of each group is its *leader*. Three phases,
//! pipelined chunk by chunk:
//!
//! 1. **intra-host reduce**: every other rank of the host sends its buffer to the leader (shared
//!    memory), which folds the contributions into its receive buffer in rank order;
//! 2. **inter-host all-reduce**: the leaders run the ring all-reduce of [`super::ring`] among
//!    themselves (TCP), in place on those receive buffers; a ring step on a byte range waits only
//!    for the intra-host reductions of the chunks it overlaps;
//! 3. **intra-host broadcast**: the leader sends each final chunk to the host's other ranks as
//!    soon as the ring has produced it.
//!
//! Only one copy of each value is ever computed (by the ring), so every rank ends with the same
//! bits. `Avg` divides once, in the ring's last reduction, by the communicator's rank count.

use super::{chunks, ring, Action, Buf, Plan, Region, Step};

/// Host index of every rank (numbered by first appearance) from the ranks' host identities.
pub fn host_groups(hosts: &[String]) -> Vec<usize> {
    let mut seen: Vec<&String> = Vec::new();
    hosts
        .iter()
        .map(|h| {
            seen.iter().position(|s| *s == h).unwrap_or_else(|| {
                seen.push(h);
                seen.len() - 1
            })
        })
        .collect()
}

/// The ring order for host groups `groups` (see [`host_groups`]): ranks sorted by host, in
/// rank order within a host, hosts in order of their first rank. Each host's ranks are then
/// contiguous in rings, chains and trees, so a ring crosses between hosts once per host.
pub fn ring_order(groups: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&r| groups[r]);
    order
}

/// Whether the hierarchical schedule applies: ranks span several hosts and at least one host
/// holds more than one rank (all on one host, or one rank per host, is a plain ring).
pub fn applies(groups: &[usize]) -> bool {
    let hosts = groups.iter().max().map_or(0, |&m| m + 1);
    hosts > 1 && hosts < groups.len()
}

/// Builds rank `rank`'s plan for `count` elements of `elem` bytes, `groups[r]` being rank r's
/// host index (see [`host_groups`]), with chunks of at most `chunk_bytes`.
pub fn all_reduce(rank: usize, groups: &[usize], count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if count == 0 {
        return plan;
    }
    let host = groups[rank];
    let local: Vec<usize> = (0..groups.len()).filter(|&r| groups[r] == host).collect();
    let leader = local[0];
    let leaders: Vec<usize> = (0..groups.len()).filter(|&r| groups[..r].iter().all(|&g| g != groups[r])).collect();
    let chunk_elems = (chunk_bytes / elem).max(1);
    let byte_chunks: Vec<Region> =
        chunks(count, chunk_elems).map(|(first, len)| Region::recv(first * elem, len * elem)).collect();

    if rank != leader {
        for c in &byte_chunks {
            plan.push(Step::Send { peer: leader, src: Region { buf: Buf::Send, ..*c } }, vec![]);
        }
        for c in &byte_chunks {
            plan.push(Step::Recv { peer: leader, dst: *c, action: Action::Store }, vec![]);
        }
        return plan;
    }

    // 1. Fold the host's other ranks into the receive buffer, chunk by chunk, in rank order.
    let members = &local[1..];
    let ready = fold_members(&mut plan, members, &byte_chunks, total);
    // 2. Ring all-reduce among the leaders, in place on the receive buffer.
    let me = leaders.iter().position(|&l| l == rank).expect("a leader is in the leader list");
    let sub = ring::all_reduce(me, leaders.len(), count, elem, chunk_bytes);
    let chunk = chunk_elems * elem;
    let writers = append_ring(&mut plan, sub, &leaders, &|r| chunk_deps(r, chunk, &ready));
    // 3. Broadcast each final chunk to the host's other ranks.
    for c in &byte_chunks {
        let mut deps: Vec<usize> =
            writers.iter().filter(|(w, _)| w.off < c.off + c.len && c.off < w.off + w.len).map(|&(_, i)| i).collect();
        if deps.is_empty() {
            deps.extend(chunk_deps(c, chunk, &ready));
        }
        for &m in members {
            plan.push(Step::Send { peer: m, src: *c }, deps.clone());
        }
    }
    plan
}

/// A leader's fold of its host's other ranks (`members`) into the receive buffer, chunk by
/// chunk in rank order (a copy of its own input when it has none): the step that makes each
/// chunk ready.
fn fold_members(plan: &mut Plan, members: &[usize], byte_chunks: &[Region], total: usize) -> Vec<usize> {
    let mut ready: Vec<usize> = Vec::with_capacity(byte_chunks.len());
    if members.is_empty() {
        let copy = plan.push(Step::Copy { src: Region::send(0, total), dst: Region::recv(0, total) }, vec![]);
        ready.resize(byte_chunks.len(), copy);
    }
    for c in byte_chunks.iter().filter(|_| !members.is_empty()) {
        let mut last = None;
        for &m in members {
            let with = if last.is_none() { Region { buf: Buf::Send, ..*c } } else { *c };
            let i =
                plan.push(Step::Recv { peer: m, dst: *c, action: Action::Reduce { with } }, last.into_iter().collect());
            last = Some(i);
        }
        ready.push(last.expect("members is not empty"));
    }
    ready
}

/// The steps in `ready` (one per chunk of `chunk` bytes) that make the bytes of `r` ready.
fn chunk_deps(r: &Region, chunk: usize, ready: &[usize]) -> Vec<usize> {
    let first = r.off / chunk;
    let last = (r.off + r.len.max(1) - 1) / chunk;
    (first..=last.min(ready.len() - 1)).map(|c| ready[c]).collect()
}

/// Appends the leaders' ring plan `sub` (ranks are positions in `leaders`) to `plan`, in place
/// on the receive buffer, each step also waiting for `ready_of` its bytes; returns the ring's
/// receive steps with the bytes they write.
fn append_ring(
    plan: &mut Plan,
    sub: Plan,
    leaders: &[usize],
    ready_of: &dyn Fn(&Region) -> Vec<usize>,
) -> Vec<(Region, usize)> {
    let base = plan.nodes.len();
    let mut writers: Vec<(Region, usize)> = Vec::new();
    for node in sub.nodes {
        let mut deps: Vec<usize> = node.deps.iter().map(|d| d + base).collect();
        let step = match node.step {
            Step::Send { peer, src } => {
                let src = to_recv(src);
                deps.extend(ready_of(&src));
                Step::Send { peer: leaders[peer], src }
            }
            Step::Recv { peer, dst, action } => {
                let action = match action {
                    Action::Store => Action::Store,
                    Action::Reduce { with } => Action::Reduce { with: to_recv(with) },
                    Action::ReduceFinal { with } => Action::ReduceFinal { with: to_recv(with) },
                };
                deps.extend(ready_of(&dst));
                writers.push((dst, plan.nodes.len()));
                Step::Recv { peer: leaders[peer], dst, action }
            }
            other => other,
        };
        deps.sort_unstable();
        deps.dedup();
        plan.push(step, deps);
    }
    writers
}

/// The same bytes in the receive buffer (the leaders' ring runs in place).
fn to_recv(r: Region) -> Region {
    Region { buf: Buf::Recv, ..r }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_applicability() {
        let h = |v: &[&str]| host_groups(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(h(&["a", "b", "a", "c", "b"]), vec![0, 1, 0, 2, 1]);
        assert!(applies(&h(&["a", "b", "a"])));
        assert!(!applies(&h(&["a", "a", "a"])), "one host: plain ring");
        assert!(!applies(&h(&["a", "b", "c"])), "one rank per host: plain ring");
    }

    #[test]
    fn ring_order_keeps_each_host_contiguous() {
        let h = |v: &[&str]| host_groups(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        // Ranks placed round-robin over 3 hosts.
        let g = h(&["a", "b", "c", "a", "b", "c", "a"]);
        let order = ring_order(&g);
        assert_eq!(order, vec![0, 3, 6, 1, 4, 2, 5]);
        // One inter-host hop per host around the ring.
        let hops = (0..order.len()).filter(|&i| g[order[i]] != g[order[(i + 1) % order.len()]]).count();
        assert_eq!(hops, 3);
        // Already grouped, or one host: the identity.
        assert_eq!(ring_order(&h(&["a", "a", "b", "b"])), vec![0, 1, 2, 3]);
        assert_eq!(ring_order(&h(&["x"; 5])), vec![0, 1, 2, 3, 4]);
        // The first host in the order is the one of rank 0.
        assert_eq!(ring_order(&h(&["b", "a", "b", "a"])), vec![0, 2, 1, 3]);
    }

    #[test]
    fn messages_pair_up() {
        // Per ordered pair, the sender's sends match the receiver's receives in count and length.
        let groups = [0, 1, 0, 2, 1, 0];
        let plans: Vec<Plan> = (0..groups.len()).map(|r| all_reduce(r, &groups, 1001, 4, 256)).collect();
        for (a, pa) in plans.iter().enumerate() {
            for (b, pb) in plans.iter().enumerate() {
                let sends = crate::algo::message_lens(pa, b, true);
                let recvs = crate::algo::message_lens(pb, a, false);
                assert_eq!(sends, recvs, "{a} -> {b}");
            }
        }
        // Non-leaders talk only to their leader; leaders 0, 1, 3 form the ring.
        assert_eq!(plans[2].peers(), vec![0]);
        assert_eq!(plans[4].peers(), vec![1]);
        assert_eq!(plans[0].peers(), vec![1, 2, 3, 5]);
        assert_eq!(plans[3].peers(), vec![0, 1]);
    }
}
