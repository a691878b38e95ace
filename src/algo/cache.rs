//! A communicator's cache of built plans, so that a repeated call (same collective, count and
//! type) reuses its schedule instead of rebuilding it: building a ring plan allocates per chunk,
//! which would dominate a small message's cost.

use super::Plan;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What a plan depends on besides the communicator: the collective's name and its numeric
/// parameters (count, element size, root, chunk size, ...).
pub type Key = (&'static str, [usize; 4]);

/// The last plan handed out, and every cached plan by key.
type Slots = (Option<(Key, Arc<Plan>)>, HashMap<Key, Arc<Plan>>);

/// Plans by [`Key`]; at most [`PlanCache::CAPACITY`] are kept (the cache is emptied when full).
/// The last plan handed out is checked first, without hashing (a training loop repeats one
/// call shape).
#[derive(Default)]
pub struct PlanCache {
    plans: Mutex<Slots>,
}

impl PlanCache {
    /// Plans kept at most.
    pub const CAPACITY: usize = 256;

    /// The plan for `key`, built with `build` the first time.
    pub fn get(&self, key: Key, build: impl FnOnce() -> Plan) -> Arc<Plan> {
        let mut guard = crate::sync::lock(&self.plans);
        let (last, m) = &mut *guard;
        if let Some((k, p)) = last {
            if *k == key {
                return p.clone();
            }
        }
        let p = match m.get(&key) {
            Some(p) => p.clone(),
            None => {
                if m.len() >= Self::CAPACITY {
                    m.clear();
                }
                let p = Arc::new(build());
                m.insert(key, p.clone());
                p
            }
        };
        *last = Some((key, p.clone()));
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{Region, Step};

    #[test]
    fn builds_once_per_key_and_stays_bounded() {
        let c = PlanCache::default();
        let mut builds = 0;
        let mut plan = |n: usize| {
            builds += 1;
            let mut p = Plan::default();
            p.push(Step::Finish { dst: Region::recv(0, n) }, vec![]);
            p
        };
        let a = c.get(("x", [4, 0, 0, 0]), || plan(4));
        let b = c.get(("x", [4, 0, 0, 0]), || plan(4));
        assert!(Arc::ptr_eq(&a, &b));
        let d = c.get(("x", [8, 0, 0, 0]), || plan(8));
        assert!(!Arc::ptr_eq(&a, &d));
        assert_eq!(builds, 2);
        for k in 0..2 * PlanCache::CAPACITY {
            c.get(("y", [k, 0, 0, 0]), Plan::default);
        }
        assert!(c.plans.lock().unwrap().1.len() <= PlanCache::CAPACITY);
    }
}
