//! `oxccl-dump merge <files...>`: merges the flight-recorder dumps of a job's ranks (written to
//! `OXCCL_DUMP`, see `oxccl::flight`) into one verdict per communicator, e.g. "ranks 0-2 wait in
//! all_reduce #1234 for rank 3, whose last op is #1233 (done)".

use std::collections::BTreeMap;

/// Largest dump file read (a rank's dump is a few hundred KiB).
const MAX_FILE: u64 = 64 << 20;
/// Deepest nesting of arrays and objects accepted (dumps nest 3 deep).
const MAX_DEPTH: usize = 64;
/// Largest communicator (as `oxccl::bootstrap::root::MAX_RANKS`).
const MAX_RANKS: u64 = 1 << 20;

/// A parsed JSON value (just what the dumps use).
#[derive(Clone, Debug)]
enum Json {
    Null,
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn get(&self, k: &str) -> Option<&Json> {
        match self {
            Json::Obj(v) => v.iter().find(|(n, _)| n == k).map(|(_, v)| v),
            _ => None,
        }
    }
    fn num(&self, k: &str) -> Option<u64> {
        match self.get(k)? {
            Json::Num(n) => Some(*n as u64),
            _ => None,
        }
    }
    fn str(&self, k: &str) -> Option<&str> {
        match self.get(k)? {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
    depth: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.b.len() && self.b[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) -> Result<(), String> {
        self.ws();
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected '{}' at byte {}", c as char, self.i))
        }
    }
    fn value(&mut self) -> Result<Json, String> {
        self.ws();
        if matches!(self.b.get(self.i), Some(b'{' | b'[')) {
            if self.depth >= MAX_DEPTH {
                return Err(format!("nested deeper than {MAX_DEPTH} levels at byte {}", self.i));
            }
            self.depth += 1;
            let v = self.compound();
            self.depth -= 1;
            return v;
        }
        self.scalar()
    }
    fn compound(&mut self) -> Result<Json, String> {
        match self.b.get(self.i).copied() {
            Some(b'{') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.b.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(v));
                }
                loop {
                    self.ws();
                    let Json::Str(k) = self.value()? else { return Err(format!("key expected at byte {}", self.i)) };
                    self.eat(b':')?;
                    v.push((k, self.value()?));
                    self.ws();
                    match self.b.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(v));
                        }
                        _ => return Err(format!("',' or '}}' expected at byte {}", self.i)),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.b.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value()?);
                    self.ws();
                    match self.b.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(v));
                        }
                        _ => return Err(format!("',' or ']' expected at byte {}", self.i)),
                    }
                }
            }
            _ => unreachable!("compound is called on '{{' or '['"),
        }
    }
    fn scalar(&mut self) -> Result<Json, String> {
        match self.b.get(self.i).copied() {
            Some(b'"') => {
                self.i += 1;
                let mut s = String::new();
                loop {
                    let c = *self.b.get(self.i).ok_or("unterminated string")?;
                    self.i += 1;
                    match c {
                        b'"' => return Ok(Json::Str(s)),
                        b'\\' => {
                            let e = *self.b.get(self.i).ok_or("bad escape")?;
                            self.i += 1;
                            match e {
                                b'u' => {
                                    let h = std::str::from_utf8(self.b.get(self.i..self.i + 4).ok_or("bad \\u")?)
                                        .map_err(|_| "bad \\u")?;
                                    let cp = u32::from_str_radix(h, 16).map_err(|_| "bad \\u")?;
                                    s.push(char::from_u32(cp).unwrap_or('?'));
                                    self.i += 4;
                                }
                                b'n' => s.push('\n'),
                                b't' => s.push('\t'),
                                other => s.push(other as char),
                            }
                        }
                        _ => {
                            // Copy a whole UTF-8 sequence.
                            let start = self.i - 1;
                            let len = match c {
                                0xf0.. => 4,
                                0xe0.. => 3,
                                0xc0.. => 2,
                                _ => 1,
                            };
                            let end = (start + len).min(self.b.len());
                            s.push_str(&String::from_utf8_lossy(&self.b[start..end]));
                            self.i = end;
                        }
                    }
                }
            }
            Some(b'n') if self.b[self.i..].starts_with(b"null") => {
                self.i += 4;
                Ok(Json::Null)
            }
            Some(b't') if self.b[self.i..].starts_with(b"true") => {
                self.i += 4;
                Ok(Json::Num(1.0))
            }
            Some(b'f') if self.b[self.i..].starts_with(b"false") => {
                self.i += 5;
                Ok(Json::Num(0.0))
            }
            Some(c) if c == b'-' || c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.b.len() && matches!(self.b[self.i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.b[start..self.i]).map_err(|_| "bad number")?;
                t.parse().map(Json::Num).map_err(|_| format!("bad number {t:?}"))
            }
            _ => Err(format!("unexpected input at byte {}", self.i)),
        }
    }
}

fn parse(text: &str) -> Result<Json, String> {
    let mut p = Parser { b: text.as_bytes(), i: 0, depth: 0 };
    let v = p.value()?;
    p.ws();
    if p.i != p.b.len() {
        return Err(format!("trailing bytes at {}", p.i));
    }
    Ok(v)
}

/// One rank's last operations: (seq, op, state, error).
struct Rank {
    ops: Vec<(u64, String, String, Option<String>)>,
}

impl Rank {
    fn last(&self) -> Option<&(u64, String, String, Option<String>)> {
        self.ops.iter().max_by_key(|o| o.0)
    }
}

/// "0-2,5" for a sorted list of ranks.
fn ranges(r: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let mut j = i;
        while j + 1 < r.len() && r[j + 1] == r[j] + 1 {
            j += 1;
        }
        out.push(if j > i { format!("{}-{}", r[i], r[j]) } else { r[i].to_string() });
        i = j + 1;
    }
    out.join(",")
}

/// The verdict for one communicator.
fn verdict(nranks: usize, ranks: &BTreeMap<usize, Rank>) -> Vec<String> {
    let mut lines = Vec::new();
    // The operation the most advanced unfinished rank is in.
    let stuck = ranks.values().filter_map(|r| r.last()).filter(|o| o.2 != "done").max_by_key(|o| o.0);
    let Some((k, op, _, _)) = stuck.cloned() else {
        let last: Vec<String> =
            ranks.iter().map(|(r, x)| format!("rank {r}: #{}", x.last().map_or(0, |o| o.0))).collect();
        lines.push(format!("no rank is inside an operation ({})", last.join(", ")));
        return lines;
    };
    let waiting: Vec<usize> =
        ranks.iter().filter(|(_, x)| x.last().is_some_and(|o| o.0 == k && o.2 != "done")).map(|(r, _)| *r).collect();
    let mut behind: Vec<String> = Vec::new();
    let mut silent: Vec<usize> = Vec::new();
    for r in 0..nranks {
        match ranks.get(&r) {
            None => silent.push(r),
            Some(x) => match x.last() {
                Some(o) if o.0 < k => behind.push(format!("rank {r}, whose last op is #{} ({})", o.0, o.2)),
                None => behind.push(format!("rank {r}, which ran no operation")),
                _ => {}
            },
        }
    }
    match silent.len() {
        0 => {}
        1 => behind.insert(0, format!("rank {}, which wrote no dump (dead, or stopped?)", silent[0])),
        _ => behind.insert(0, format!("ranks {}, which wrote no dump (dead, or stopped?)", ranges(&silent))),
    }
    let who = if waiting.len() == 1 { format!("rank {}", waiting[0]) } else { format!("ranks {}", ranges(&waiting)) };
    if behind.is_empty() {
        lines.push(format!(
            "{who} are in {op} #{k} and no rank is behind: the operation itself stalls (a link, or a mismatch)"
        ));
    } else {
        lines.push(format!("{who} wait in {op} #{k} for {}", behind.join("; ")));
    }
    for (r, x) in ranks {
        if let Some((s, op, state, err)) = x.last() {
            let err = err.as_deref().map(|e| format!(": {e}")).unwrap_or_default();
            lines.push(format!("  rank {r}: {op} #{s} {state}{err}"));
        }
    }
    lines
}

/// A whole number from 0 to `max`, or None.
fn count(v: &Json, max: u64) -> Option<u64> {
    match v {
        Json::Num(n) if n.is_finite() && *n >= 0.0 && n.fract() == 0.0 && *n <= max as f64 => Some(*n as u64),
        _ => None,
    }
}

/// The text of `f`, refusing files over [`MAX_FILE`] before reading them.
fn read_bounded(f: &str) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(f).map_err(|e| format!("{f}: {e}"))?;
    let mut text = String::new();
    let n = file.take(MAX_FILE + 1).read_to_string(&mut text).map_err(|e| format!("{f}: {e}"))?;
    if n as u64 > MAX_FILE {
        return Err(format!("{f}: larger than {} MiB: not an oxccl dump", MAX_FILE >> 20));
    }
    Ok(text)
}

fn merge(files: &[String]) -> Result<String, String> {
    // comm tag -> (nranks, rank -> ops)
    let mut comms: BTreeMap<String, (usize, BTreeMap<usize, Rank>)> = BTreeMap::new();
    for f in files {
        let text = read_bounded(f)?;
        let j = parse(&text).map_err(|e| format!("{f}: {e}"))?;
        let (Some(rank), Some(nranks), Some(tag)) = (j.get("rank"), j.get("nranks"), j.str("comm")) else {
            return Err(format!("{f}: not an oxccl dump (rank, nranks, comm missing)"));
        };
        let nranks = count(nranks, MAX_RANKS)
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{f}: nranks must be 1 to {MAX_RANKS}"))?;
        let rank = count(rank, nranks - 1).ok_or_else(|| format!("{f}: rank must be 0 to {}", nranks - 1))?;
        let mut ops = Vec::new();
        if let Some(Json::Arr(list)) = j.get("ops") {
            for o in list {
                let err = o.str("error").map(str::to_string);
                ops.push((
                    o.num("seq").unwrap_or(0),
                    o.str("op").unwrap_or("?").to_string(),
                    o.str("state").unwrap_or("?").to_string(),
                    err,
                ));
            }
        }
        let e = comms.entry(tag.to_string()).or_insert((nranks as usize, BTreeMap::new()));
        e.1.insert(rank as usize, Rank { ops });
    }
    let mut out = String::new();
    for (tag, (nranks, ranks)) in &comms {
        out.push_str(&format!("communicator {tag} ({nranks} ranks, {} dumps):\n", ranks.len()));
        for l in verdict(*nranks, ranks) {
            out.push_str(&l);
            out.push('\n');
        }
    }
    Ok(out)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.split_first() {
        Some((cmd, files)) if cmd == "merge" && !files.is_empty() => match merge(files) {
            Ok(text) => print!("{text}"),
            Err(e) => {
                eprintln!("oxccl-dump: {e}");
                std::process::exit(1);
            }
        },
        _ => {
            eprintln!("usage: oxccl-dump merge <dump.json>...  (dumps written by ranks run with OXCCL_DUMP=<dir>)");
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_names_the_rank_behind() {
        let mk = |ops: &[(u64, &str)]| Rank {
            ops: ops.iter().map(|&(s, st)| (s, "all_reduce".to_string(), st.to_string(), None)).collect(),
        };
        let mut ranks = BTreeMap::new();
        for r in 0..3 {
            ranks.insert(r, mk(&[(1233, "done"), (1234, "failed")]));
        }
        ranks.insert(3, mk(&[(1232, "done"), (1233, "done")]));
        let v = verdict(4, &ranks);
        assert_eq!(v[0], "ranks 0-2 wait in all_reduce #1234 for rank 3, whose last op is #1233 (done)");
        ranks.remove(&3);
        assert!(verdict(4, &ranks)[0].ends_with("for rank 3, which wrote no dump (dead, or stopped?)"));
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert!(parse(&"[".repeat(200_000)).unwrap_err().contains("nested deeper than 64"));
        assert!(parse(&format!("{}{}", "[".repeat(64), "]".repeat(64))).is_ok());
        assert_eq!(count(&Json::Num(1e300), MAX_RANKS), None);
        assert_eq!(count(&Json::Num(2.5), MAX_RANKS), None);
        assert_eq!(count(&Json::Num(8.0), MAX_RANKS), Some(8));
        let j = parse(r#"{"a":[1,-2.5e1,"x\"\u0041"],"b":null,"c":true}"#).unwrap();
        assert_eq!(j.str("b"), None);
        match j.get("a") {
            Some(Json::Arr(v)) => assert!(matches!(&v[2], Json::Str(s) if s == "x\"A")),
            other => panic!("{other:?}"),
        }
    }
}
