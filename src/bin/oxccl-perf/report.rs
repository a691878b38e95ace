//! Output: the nccl-tests style table (the column layout of nccl-tests 2.x `common.cu`, with
//! the number formatting of its later `getFloatStr`) and the `--json` rows (hand-written JSON).

use std::fmt::Write as _;

/// Results of one placement (out-of-place or in-place) of one row.
#[derive(Clone, Copy, Debug, Default)]
pub struct Half {
    /// Time per call in microseconds (max over ranks).
    pub time_us: f64,
    /// Algorithm bandwidth in GB/s (1 GB = 1e9 bytes).
    pub algbw: f64,
    /// Bus bandwidth in GB/s.
    pub busbw: f64,
    /// Wrong elements summed over ranks; `None` when checking is off.
    pub wrong: Option<u64>,
    /// Hash of the result of a call on the timed input, combined over ranks (`--hash`).
    pub hash: Option<u64>,
}

/// One line of the table.
#[derive(Clone, Debug)]
pub struct Row {
    /// Collective name.
    pub collective: &'static str,
    /// Bytes: the larger of the send and receive buffer of one rank.
    pub size: usize,
    /// Elements: the count argument passed to the collective.
    pub count: usize,
    /// Data type name.
    pub dtype: &'static str,
    /// Reduction name (`none` for data movement).
    pub redop: &'static str,
    /// Root rank, -1 for collectives without one.
    pub root: i64,
    /// Number of ranks.
    pub nranks: usize,
    /// Out-of-place results.
    pub oop: Half,
    /// In-place results.
    pub ip: Half,
    /// The algorithm of a side-by-side comparison (`auto:<choice>` for the cost model's).
    pub algo: Option<String>,
}

/// C's `%.{prec}e` (`1.5e+07`), which Rust's `{:e}` (`1.5e7`) does not match.
fn c_exp(value: f64, prec: usize) -> String {
    let s = format!("{value:.prec$e}");
    match s.split_once('e') {
        Some((mant, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mant}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// nccl-tests' `getFloatStr`: as many decimals as fit in `width`, exponent form beyond.
pub fn float_str(value: f64, width: usize) -> String {
    let mut power = 0usize;
    let mut val = 1u64;
    while value >= val as f64 && power < 40 {
        power += 1;
        val = val.saturating_mul(10);
    }
    if power + 2 < width {
        format!("{value:>width$.2}")
    } else if power + 1 < width {
        format!("{value:>width$.1}")
    } else if power < width + 1 {
        format!("{value:>width$.0}")
    } else {
        format!("{:>width$}", c_exp(value, 1))
    }
}

/// C's `%g`: 6 significant digits, trailing zeros removed, exponent form outside 1e-4..1e6.
pub fn fmt_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return if x.is_nan() {
            "nan".into()
        } else if x.is_infinite() {
            (if x > 0.0 { "inf" } else { "-inf" }).into()
        } else {
            "0".into()
        };
    }
    let strip = |s: String| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    let sci = format!("{x:.5e}");
    let exp: i32 = sci.split_once('e').and_then(|(_, e)| e.parse().ok()).unwrap_or(0);
    if (-4..6).contains(&exp) {
        strip(format!("{x:.prec$}", prec = (5 - exp) as usize))
    } else {
        let full = c_exp(x, 5);
        let (mant, e) = full.split_once('e').unwrap_or((&full, "+00"));
        format!("{}e{e}", strip(mant.to_string()))
    }
}

/// The three table header lines (with an algorithm column for `--algo` comparisons).
pub fn table_header(with_algo: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#");
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place          ",
        "", "", "", "", ""
    );
    let cols = [
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
        "#wrong",
    ];
    let units = ["(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""];
    for (c, last) in [(cols, "algo"), (units, "")] {
        let _ = write!(
            s,
            "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} {:>6}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12]
        );
        let _ = writeln!(s, "{}", if with_algo { format!("  {last}") } else { String::new() });
    }
    s
}

fn half_cols(h: &Half) -> String {
    let wrong = h.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
    format!(
        "  {:>7}  {:>6}  {:>6}  {:>5}",
        float_str(h.time_us, 7),
        float_str(h.algbw, 6),
        float_str(h.busbw, 6),
        wrong
    )
}

/// One table line (without the newline).
pub fn row_line(r: &Row) -> String {
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}{}{}",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        half_cols(&r.oop),
        half_cols(&r.ip)
    ) + &r.algo.as_ref().map_or_else(String::new, |a| format!("  {a}"))
}

/// The `--hash` line of a row: the hash of its out-of-place and in-place results (equal
/// inputs, so equal hashes when the reduction is reproducible, e.g. `OXCCL_DETERMINISTIC=1`).
pub fn hash_line(r: &Row) -> Option<String> {
    let (a, b) = (r.oop.hash?, r.ip.hash?);
    let algo = r.algo.as_ref().map_or_else(String::new, |a| format!(" {a}"));
    Some(format!("#  hash {:>12} {:>8} {:>6}{algo}: out-of-place {a:016x} in-place {b:016x}", r.size, r.dtype, r.redop))
}

/// The summary lines after the table.
pub fn footer(total_wrong: u64, avg_busbw: f64, program: &str) -> String {
    let status = if total_wrong > 0 { "FAILED" } else { "OK" };
    let mut s = String::new();
    let _ = writeln!(s, "# {:<20} : {} {}", "Out of bounds values", total_wrong, status);
    let _ = writeln!(s, "# {:<20} : {} ", "Avg bus bandwidth", fmt_g(avg_busbw));
    let _ = writeln!(s, "#");
    let _ = writeln!(s, "# Collective test concluded: {program}");
    s
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number; NaN and infinities (not JSON) become `null`.
fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".into()
    }
}

fn json_half(prefix: &str, h: &Half) -> String {
    let wrong = h.wrong.map_or_else(|| "null".to_string(), |w| w.to_string());
    format!(
        "\"{prefix}_time_us\":{},\"{prefix}_algbw\":{},\"{prefix}_busbw\":{},\"{prefix}_wrong\":{wrong}",
        json_num(h.time_us),
        json_num(h.algbw),
        json_num(h.busbw)
    )
}

/// All rows as a JSON array, one object per line.
pub fn json(rows: &[Row]) -> String {
    let mut s = String::from("[\n");
    for (i, r) in rows.iter().enumerate() {
        let _ = write!(
            s,
            "  {{\"collective\":{},\"size\":{},\"count\":{},\"type\":{},\"redop\":{},\"root\":{},\"nranks\":{},{},{}}}",
            json_str(r.collective),
            r.size,
            r.count,
            json_str(r.dtype),
            json_str(r.redop),
            r.root,
            r.nranks,
            json_half("oop", &r.oop),
            json_half("ip", &r.ip)
        );
        if let Some(a) = &r.algo {
            s.truncate(s.len() - 1);
            let _ = write!(s, ",\"algo\":{}}}", json_str(a));
        }
        s.push_str(if i + 1 < rows.len() { ",\n" } else { "\n" });
    }
    s.push_str("]\n");
    s
}

/// What `-J`/`--output_file` records about a run besides its rows.
pub struct Meta<'a> {
    /// `oxccl-perf <collective>`.
    pub program: String,
    /// oxccl's version.
    pub version: &'static str,
    /// (pid, host) of each rank.
    pub hosts: &'a [(u64, String)],
    /// Timed calls per size (`-n`; scaled down per size in the quick run).
    pub iters: usize,
    /// Warm-up calls per size (`-w`).
    pub warmup: usize,
    /// `mean` or `median` (`--stat`).
    pub stat: &'static str,
    /// The quick default run (iterations scaled per size).
    pub quick: bool,
    /// `host` or `cuda` buffers.
    pub mem: &'static str,
}

/// Whether an environment variable's value is withheld from the output.
fn is_secret(key: &str) -> bool {
    key.ends_with("_SECRET") || key.ends_with("_UNIQUE_ID") || key.contains("PASSWORD") || key.contains("TOKEN")
}

/// The run as one JSON object: `{"oxccl_perf": {metadata}, "results": [rows]}`. The metadata
/// holds the program, versions, ranks and their hosts, every `OXCCL_*`/`NCCL_*` variable of
/// rank 0's environment (secrets as `***`), iterations, warm-ups and the statistic.
pub fn json_run(meta: &Meta, rows: &[Row]) -> String {
    let env = oxccl::config::environ::settings();
    let env: Vec<String> = env
        .iter()
        .map(|(k, v)| format!("{}:{}", json_str(k), json_str(if is_secret(k) { "***" } else { v })))
        .collect();
    let hosts: Vec<String> = meta
        .hosts
        .iter()
        .enumerate()
        .map(|(r, (pid, h))| format!("{{\"rank\":{r},\"pid\":{pid},\"host\":{}}}", json_str(h)))
        .collect();
    let mut s = String::from("{\"oxccl_perf\":{");
    let _ = write!(
        s,
        "\"program\":{},\"version\":{},\"nccl_api\":\"{}.{}.{}\",\"nranks\":{},\"ranks\":[{}],\
         \"env\":{{{}}},\"iters\":{},\"warmup_iters\":{},\"quick\":{},\"stat\":{},\"mem\":{}}},\n\"results\":",
        json_str(&meta.program),
        json_str(meta.version),
        oxccl::NCCL_MAJOR,
        oxccl::NCCL_MINOR,
        oxccl::NCCL_PATCH,
        meta.hosts.len(),
        hosts.join(","),
        env.join(","),
        meta.iters,
        meta.warmup,
        meta.quick,
        json_str(meta.stat),
        json_str(meta.mem)
    );
    s.push_str(json(rows).trim_end());
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_format_like_printf() {
        assert_eq!(float_str(11.514, 7), "  11.51");
        assert_eq!(float_str(0.0, 6), "  0.00");
        assert_eq!(float_str(12345.6, 7), "12345.6");
        assert_eq!(float_str(123456.4, 7), " 123456");
        assert_eq!(float_str(123456789.0, 7), "1.2e+08");
        assert_eq!(fmt_g(0.0), "0");
        assert_eq!(fmt_g(1.5), "1.5");
        assert_eq!(fmt_g(12.3456789), "12.3457");
        assert_eq!(fmt_g(0.00012), "0.00012");
        assert_eq!(fmt_g(0.000012), "1.2e-05");
        assert_eq!(fmt_g(1234567.0), "1.23457e+06");
    }

    #[test]
    fn rows_and_json() {
        let h = Half { time_us: 10.0, algbw: 0.5, busbw: 0.75, wrong: Some(0), hash: None };
        let r = Row {
            collective: "all_reduce",
            size: 8,
            count: 2,
            dtype: "float",
            redop: "sum",
            root: -1,
            nranks: 2,
            oop: h,
            ip: Half { wrong: None, ..h },
            algo: None,
        };
        let line = row_line(&r);
        assert!(
            line.starts_with("           8             2     float     sum      -1    10.00    0.50    0.75      0"),
            "{line}"
        );
        assert!(line.ends_with("N/A"));
        let j = json(&[r.clone(), Row { algo: Some("auto:ring".into()), ..r.clone() }]);
        assert!(
            j.contains(",\"algo\":\"auto:ring\"}")
                && row_line(&Row { algo: Some("tree".into()), ..r.clone() }).ends_with("  tree")
        );
        assert_eq!(j.matches("\"collective\":\"all_reduce\"").count(), 2);
        assert!(j.contains("\"oop_wrong\":0") && j.contains("\"ip_wrong\":null") && j.contains("\"oop_time_us\":10,"));
        assert_eq!(json_num(f64::NAN), "null");
        assert_eq!(json_str("a\"b\\\n"), "\"a\\\"b\\\\\\u000a\"");
    }
}
