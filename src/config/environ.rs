//! The one place the library reads the process environment.
//!
//! Everything else asks through these functions: the typed [`super::Config`] (read once per
//! communicator), the logger (its level, subsystems and file, read before any `Config`
//! exists), and the bootstrap's launcher variables (`RANK`, `OMPI_*`, `PMI_*`, `SLURM_*`, ...).
//! This module depends on nothing else in the crate, so any layer may use it without making a
//! cycle. A test (`tests/layers.rs`) fails if `std::env` is read anywhere else in `src/`.

/// The value of variable `name` exactly as spelt, or `None` when it is unset, empty (or only
/// blanks), or not valid UTF-8.
pub fn var(name: &str) -> Option<String> {
    raw(name).filter(|v| !v.trim().is_empty())
}

/// The value of variable `name` exactly as spelt, empty values included (`None` when unset or
/// not valid UTF-8).
pub fn raw(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Setting `name` read as `OXCCL_<name>`, falling back to its twin `NCCL_<name>`; empty values
/// count as unset.
pub fn twin(name: &str) -> Option<String> {
    twin_in(&var, name)
}

/// The spelling of setting `name` the user set: `OXCCL_<name>` when set (non-empty), else
/// `NCCL_<name>` when set, else `OXCCL_<name>`. Messages use it so that a user who set
/// `NCCL_ALGO` reads `NCCL_ALGO`.
pub fn spelling(name: &str) -> String {
    spelling_in(&var, name)
}

/// [`twin`] over the (non-empty) variables that `get` returns.
fn twin_in(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    [format!("OXCCL_{name}"), format!("NCCL_{name}")].iter().find_map(|k| get(k))
}

/// [`spelling`] over the (non-empty) variables that `get` returns.
fn spelling_in(get: &dyn Fn(&str) -> Option<String>, name: &str) -> String {
    let ours = format!("OXCCL_{name}");
    let theirs = format!("NCCL_{name}");
    if get(&ours).is_none() && get(&theirs).is_some() {
        theirs
    } else {
        ours
    }
}

/// Every variable named `OXCCL_*` or `NCCL_*` (valid UTF-8 ones), sorted by name, for listings
/// of the settings in effect.
pub fn settings() -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k.starts_with("OXCCL_") || k.starts_with("NCCL_"))
        .collect();
    all.sort();
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake environment (non-empty values only, as [`var`] returns them).
    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn twin_prefers_the_oxccl_spelling_then_the_nccl_one() {
        let both = env(&[("OXCCL_ALGO", "ring"), ("NCCL_ALGO", "tree")]);
        assert_eq!(twin_in(&both, "ALGO").as_deref(), Some("ring"));
        assert_eq!(spelling_in(&both, "ALGO"), "OXCCL_ALGO");
        let theirs = env(&[("NCCL_ALGO", "tree")]);
        assert_eq!(twin_in(&theirs, "ALGO").as_deref(), Some("tree"));
        assert_eq!(spelling_in(&theirs, "ALGO"), "NCCL_ALGO");
        let none = env(&[("NCCL_PROTO", "LL")]);
        assert_eq!(twin_in(&none, "ALGO"), None);
        assert_eq!(spelling_in(&none, "ALGO"), "OXCCL_ALGO");
    }

    #[test]
    fn unset_variables_read_as_none() {
        // A name nobody sets reads as none; PATH, set in any test environment, reads as is.
        assert!(raw("OXCCL_ENVIRON_NEVER_SET_8d1f").is_none());
        assert!(var("OXCCL_ENVIRON_NEVER_SET_8d1f").is_none());
        if let Some(p) = raw("PATH").filter(|p| !p.trim().is_empty()) {
            assert_eq!(var("PATH"), Some(p));
        }
    }
}
