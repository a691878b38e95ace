//! Turning a host call's [`Route`] into this rank's plan: which builder of `algo` makes it, the
//! key it is cached under ([`crate::algo::cache`]), and what the caller logs about the choice.
//! Pure, as the rest of `select`: the caller looks the key up, builds on a miss, and logs.

use super::{model_bytes, pair_stream_chunk, special_chunk, Request, Route};
use crate::algo::cache::Key;
use crate::algo::tuning::{Algo, Choice};
use crate::algo::{self, Collective, Plan};

/// What this rank's plan depends on besides the [`Request`].
#[derive(Clone, Copy, Debug)]
pub struct PlanInputs<'a> {
    /// This rank.
    pub rank: usize,
    /// NCCL's count argument.
    pub count: usize,
    /// Bytes per element.
    pub elem: usize,
    /// Whether the call is in place (NCCL's in-place layout).
    pub in_place: bool,
    /// The communicator's ring order ([`algo::build_on`]).
    pub ring: &'a [usize],
    /// Each rank's host group.
    pub groups: &'a [usize],
    /// The host groups when the hierarchical plan applies ([`algo::hier::applies`]).
    pub hier_groups: Option<&'a [usize]>,
}

/// A route turned into a plan: the cache key, what to log, and the builder to run on a miss.
pub struct PlanRecipe<'a> {
    /// The plan cache's key for this plan.
    pub key: Key,
    /// The choice the caller logs before looking the plan up: its label, the bytes the cost
    /// model saw, and the algorithm and chunk (routes that build a fixed plan without a choice
    /// have none).
    pub choice: Option<(&'static str, usize, Choice)>,
    /// Whether the plan comes from the cost model's builders (then a debug build validates it).
    pub tuned: bool,
    /// Builds the plan (`None`: the algorithm has no plan for this collective).
    pub build: Box<dyn FnOnce() -> Option<Plan> + 'a>,
    /// What to log (at INFO) when the plan is built, for routes that build a fixed plan
    /// without a cost-model choice.
    pub note: Option<Note>,
}

/// What a fixed-plan route says when its plan is built (not found in the cache).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Note {
    /// [`Route::Hierarchical`].
    Hierarchical,
    /// [`Route::Deterministic`].
    Deterministic,
    /// [`Route::Compressed`], in this encoding.
    Compressed(algo::Encoding),
}

impl Note {
    /// The line for a call on `count` elements of `coll`.
    pub fn text(self, coll: Collective, count: usize) -> String {
        match self {
            Note::Hierarchical => format!("all_reduce of {count} elements: hierarchical over hosts"),
            Note::Deterministic => format!("{} of {count} elements: fixed-order schedule", coll.name()),
            Note::Compressed(enc) => format!(
                "{} of {count} f32 elements: compressed between hosts as {} ({} B per element)",
                coll.name(),
                enc.name(),
                enc.size(1 << 20) as f64 / f64::from(1 << 20)
            ),
        }
    }
}

impl PlanRecipe<'_> {
    fn fixed(key: Key, build: Box<dyn FnOnce() -> Option<Plan> + '_>, note: Note) -> PlanRecipe<'_> {
        PlanRecipe { key, choice: None, tuned: false, build, note: Some(note) }
    }
}

/// The recipe of `route` (what [`super::select`] chose for `req`) on this rank; `None` when the
/// route needs what `at` lacks (the hierarchical route without host groups).
pub fn recipe<'a>(req: &Request, route: Route, at: &PlanInputs<'a>) -> Option<PlanRecipe<'a>> {
    let PlanInputs { rank, count, elem, in_place, .. } = *at;
    let (coll, n, t) = (req.coll, req.nranks, req.transport);
    let bytes = count * elem;
    Some(match route {
        Route::OneShot => {
            // The one-shot exchange is recursive doubling's single round on two ranks.
            let chunk = special_chunk(req);
            PlanRecipe {
                key: ("all_reduce/oneshot", [count, elem, chunk, 0]),
                choice: Some((route.name(), bytes, Choice::fixed(coll, Algo::Rd, bytes, n, chunk, t))),
                tuned: false,
                build: Box::new(move || Some(algo::oneshot::all_reduce(rank, count, elem, chunk))),
                note: None,
            }
        }
        Route::PairStream => {
            let chunk = pair_stream_chunk(bytes, req.chunk);
            PlanRecipe {
                key: ("all_reduce/pair-stream", [count, elem, chunk, 0]),
                choice: Some((route.name(), bytes, Choice::fixed(coll, Algo::Ring, bytes, n, chunk, t))),
                tuned: false,
                build: Box::new(move || Some(algo::ring::all_reduce_ahead(rank, n, count, elem, chunk, 0))),
                note: None,
            }
        }
        Route::Hierarchical => {
            let groups = at.hier_groups?;
            let chunk = special_chunk(req);
            let build = Box::new(move || Some(algo::hier::all_reduce(rank, groups, count, elem, chunk)));
            PlanRecipe::fixed(("all_reduce/hier", [count, elem, chunk, 0]), build, Note::Hierarchical)
        }
        Route::Deterministic(chunk) => {
            let shape = (coll.rank_arg().unwrap_or(0) << 1) | usize::from(in_place);
            let name = match coll {
                Collective::ReduceScatter => "reduce_scatter/det",
                Collective::Reduce { .. } => "reduce/det",
                _ => "all_reduce/det",
            };
            let build = Box::new(move || {
                Some(match coll {
                    Collective::ReduceScatter => algo::det::reduce_scatter(rank, n, count, elem, chunk, in_place),
                    Collective::Reduce { root } => algo::det::reduce(rank, n, count, elem, chunk, root),
                    _ => algo::det::all_reduce(rank, n, count, elem, chunk),
                })
            });
            PlanRecipe::fixed((name, [count, elem, chunk, shape]), build, Note::Deterministic)
        }
        Route::Compressed(enc, chunk) if matches!(coll, Collective::ReduceScatter) => {
            let groups = at.groups;
            let build =
                Box::new(move || Some(algo::compress::reduce_scatter(rank, groups, count, chunk, enc, in_place)));
            let key = ("reduce_scatter/compressed", [count, enc as usize, chunk, usize::from(in_place)]);
            PlanRecipe::fixed(key, build, Note::Compressed(enc))
        }
        Route::Compressed(enc, chunk) if matches!(coll, Collective::Reduce { .. }) => {
            let (root, groups) = (coll.rank_arg().unwrap_or(0), at.groups);
            let build = Box::new(move || Some(algo::compress::reduce(rank, groups, count, chunk, enc, root)));
            let key = ("reduce/compressed", [count, enc as usize, chunk, root]);
            PlanRecipe::fixed(key, build, Note::Compressed(enc))
        }
        Route::Compressed(enc, chunk) => {
            let groups = at.groups;
            let build = Box::new(move || Some(algo::compress::all_reduce(rank, groups, count, chunk, enc)));
            PlanRecipe::fixed(("all_reduce/compressed", [count, enc as usize, chunk, 0]), build, Note::Compressed(enc))
        }
        Route::Tuned(choice) => {
            let shape = (coll.rank_arg().unwrap_or(0) << 8) | ((choice.algo as usize) << 1) | usize::from(in_place);
            let ring = at.ring;
            PlanRecipe {
                key: (coll.name(), [count, elem, shape, choice.chunk]),
                choice: Some((choice.algo.name(), model_bytes(coll, n, bytes), choice)),
                tuned: true,
                build: Box::new(move || {
                    algo::build_on(coll, choice.algo, ring, rank, count, elem, choice.chunk, in_place)
                }),
                note: None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(nranks: usize, bytes: usize) -> Request {
        super::super::tests::req(Collective::AllReduce, bytes, nranks)
    }

    /// Each route's recipe builds what that route's builder in `algo` builds, under a key that
    /// tells the routes apart.
    #[test]
    fn a_recipe_builds_its_routes_plan() {
        let (count, elem) = (1000, 4);
        let ring = [0, 1, 2, 3];
        let groups = [0, 0, 1, 1];
        let at =
            PlanInputs { rank: 1, count, elem, in_place: false, ring: &ring[..2], groups: &groups, hier_groups: None };
        let two = req(2, count * elem);
        let one = recipe(&two, super::super::select(&two), &at).unwrap();
        assert_eq!(one.key.0, "all_reduce/oneshot");
        assert_eq!(one.choice.map(|c| c.0), Some("oneshot"));
        let chunk = special_chunk(&two);
        assert_eq!((one.build)(), Some(algo::oneshot::all_reduce(1, count, elem, chunk)));
        // The hierarchical route needs host groups.
        let at4 = PlanInputs { ring: &ring, ..at };
        assert!(recipe(&req(4, count * elem), Route::Hierarchical, &at4).is_none());
        let hier =
            recipe(&req(4, count * elem), Route::Hierarchical, &PlanInputs { hier_groups: Some(&groups), ..at4 });
        let hier = hier.unwrap();
        assert_eq!(hier.note, Some(Note::Hierarchical));
        assert_eq!((hier.build)(), Some(algo::hier::all_reduce(1, &groups, count, elem, chunk)));
        // The cost model's choice: built on the ring order, validated, keyed by its algorithm.
        let four = req(4, count * elem);
        let Route::Tuned(c) = super::super::select(&four) else { panic!("expected the cost model's route") };
        let tuned = recipe(&four, Route::Tuned(c), &at4).unwrap();
        assert!(tuned.tuned && tuned.note.is_none());
        assert_eq!(tuned.choice.map(|x| x.2), Some(c));
        let want = algo::build_on(Collective::AllReduce, c.algo, &ring, 1, count, elem, c.chunk, false);
        assert!(want.is_some());
        assert_eq!((tuned.build)(), want);
        let det = recipe(&four, Route::Deterministic(4096), &at4).unwrap();
        assert_eq!(det.key, ("all_reduce/det", [count, elem, 4096, 0]));
        assert_eq!((det.build)(), Some(algo::det::all_reduce(1, 4, count, elem, 4096)));
        // The compressed routes: each collective its builder, keyed apart (a reduce by root).
        let enc = algo::Encoding::Int8;
        let comp = |coll| {
            let r = Request { coll, compress: enc, hosts: 4, ..four };
            let Route::Compressed(e, chunk) = super::super::select(&r) else { panic!("{coll:?} not compressed") };
            (recipe(&r, Route::Compressed(e, chunk), &at4).unwrap(), chunk)
        };
        let (ar, chunk) = comp(Collective::AllReduce);
        assert_eq!((ar.build)(), Some(algo::compress::all_reduce(1, &groups, count, chunk, enc)));
        let (rs, _) = comp(Collective::ReduceScatter);
        assert_eq!(rs.key.0, "reduce_scatter/compressed");
        assert_eq!((rs.build)(), Some(algo::compress::reduce_scatter(1, &groups, count, chunk, enc, false)));
        let (red, _) = comp(Collective::Reduce { root: 2 });
        assert_eq!(red.key, ("reduce/compressed", [count, enc as usize, chunk, 2]));
        assert_eq!(red.note, Some(Note::Compressed(enc)));
        assert_eq!((red.build)(), Some(algo::compress::reduce(1, &groups, count, chunk, enc, 2)));
        assert_ne!(comp(Collective::Reduce { root: 3 }).0.key, red.key);
    }
}
