//! `OXCCL_SOCKET_IFNAME`, parsed once: NCCL's interface filter syntax.
//!
//! A comma-separated list of name prefixes (`eth,ib`); `=` in front makes every entry an exact
//! name (`=eth0,eth1`); `^` in front excludes the listed interfaces instead (`^docker,lo`,
//! `^=eth2`). Empty entries and spaces around entries are ignored.

/// A parsed `OXCCL_SOCKET_IFNAME` value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfFilter {
    /// `^`: the list names the interfaces to leave out.
    pub exclude: bool,
    /// `=`: entries are whole names, not prefixes.
    pub exact: bool,
    /// The entries, in the order given.
    pub names: Vec<String>,
}

impl IfFilter {
    /// Parses a filter; `None` for a value with no entry (empty, `^`, `=`, `,`).
    pub fn parse(value: &str) -> Option<IfFilter> {
        let v = value.trim();
        let (exclude, v) = v.strip_prefix('^').map_or((false, v), |r| (true, r));
        let (exact, v) = v.strip_prefix('=').map_or((false, v), |r| (true, r));
        let names: Vec<String> = v.split(',').map(str::trim).filter(|p| !p.is_empty()).map(str::to_string).collect();
        (!names.is_empty()).then_some(IfFilter { exclude, exact, names })
    }

    /// Whether interface `name` passes the filter.
    pub fn matches(&self, name: &str) -> bool {
        let hit = self.names.iter().any(|p| if self.exact { name == p } else { name.starts_with(p.as_str()) });
        hit != self.exclude
    }
}

impl std::fmt::Display for IfFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (x, e) = (if self.exclude { "^" } else { "" }, if self.exact { "=" } else { "" });
        write!(f, "{x}{e}{}", self.names.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_exact_names_and_exclusions() {
        let f = IfFilter::parse("rail0, rail1").unwrap();
        assert_eq!((f.exclude, f.exact, f.names.clone()), (false, false, vec!["rail0".into(), "rail1".into()]));
        assert!(f.matches("rail0") && f.matches("rail1") && f.matches("rail10") && !f.matches("rail2"));
        let f = IfFilter::parse("rail").unwrap();
        assert!(f.matches("rail0") && f.matches("rail1") && !f.matches("eth0"));
        let f = IfFilter::parse("=rail1").unwrap();
        assert!(f.exact && f.matches("rail1") && !f.matches("rail10") && !f.matches("rail"));
        let f = IfFilter::parse("^lo,docker").unwrap();
        assert!(f.exclude && !f.exact && !f.matches("lo") && !f.matches("docker0") && f.matches("eth0"));
        let f = IfFilter::parse("^=eth0").unwrap();
        assert!(f.exclude && f.exact && !f.matches("eth0") && f.matches("eth01"));
        assert_eq!(f.to_string(), "^=eth0");
        assert_eq!(IfFilter::parse(" ib,,eth ").unwrap().to_string(), "ib,eth");
    }

    #[test]
    fn a_value_without_entries_is_no_filter() {
        for v in ["", " ", "^", "=", "^=", ",", " , "] {
            assert_eq!(IfFilter::parse(v), None, "{v:?}");
        }
    }
}
