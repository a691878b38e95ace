//! `oxccl-perf plot FILE.json... [-o busbw.png]`: bus bandwidth against message size (log x),
//! one line per run and algorithm, from `--json` (an array of rows) or `-J` (an object with
//! `results`) files.

use std::path::{Path, PathBuf};

/// One line of the chart: its label and (size in bytes, GB/s) points sorted by size.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// (bytes, GB/s), sorted by bytes.
    pub points: Vec<(f64, f64)>,
}

/// Options of `plot`.
struct PlotOpts {
    files: Vec<PathBuf>,
    out: PathBuf,
    title: Option<String>,
    /// Plot algbw instead of busbw.
    algbw: bool,
    /// Plot the in-place half instead of out-of-place.
    in_place: bool,
}

fn usage() -> &'static str {
    "Usage: oxccl-perf plot FILE.json... [-o OUT.png] [--title TEXT] [--algbw] [--in-place]\n\
     \n\
     Draws bus bandwidth (GB/s) against message size (log scale) as a PNG: one line per file and,\n\
     within a file, per algorithm (--algo runs), data type and op. FILEs come from\n\
     `oxccl-perf --json` or `-J`. Out-of-place times unless --in-place; --algbw plots algbw.\n\
     -o: output file (default busbw.png).\n"
}

fn parse(args: &[String]) -> Result<Option<PlotOpts>, String> {
    let mut o =
        PlotOpts { files: Vec::new(), out: PathBuf::from("busbw.png"), title: None, algbw: false, in_place: false };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "-o" | "--output" => o.out = PathBuf::from(it.next().ok_or("-o needs a file name")?),
            "--title" => o.title = Some(it.next().ok_or("--title needs a text")?.clone()),
            "--algbw" => o.algbw = true,
            "--in-place" => o.in_place = true,
            s if s.starts_with('-') => return Err(format!("unknown option '{s}'")),
            f => o.files.push(PathBuf::from(f)),
        }
    }
    if o.files.is_empty() {
        return Err("no JSON file given".into());
    }
    Ok(Some(o))
}

/// Runs `oxccl-perf plot ARGS`; returns the exit status (0, 1 error, 2 usage).
pub fn main(args: &[String]) -> i32 {
    let o = match parse(args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{}", usage());
            return 0;
        }
        Err(e) => {
            eprintln!("oxccl-perf plot: {e}\n\n{}", usage());
            return 2;
        }
    };
    let mut all = Vec::new();
    for f in &o.files {
        match std::fs::read_to_string(f).map_err(|e| e.to_string()).and_then(|t| series_of(&t, &stem(f), &o)) {
            Ok(s) if s.is_empty() => eprintln!("oxccl-perf plot: {}: no rows", f.display()),
            Ok(s) => all.extend(s),
            Err(e) => {
                eprintln!("oxccl-perf plot: {}: {e}", f.display());
                return 1;
            }
        }
    }
    if all.is_empty() {
        eprintln!("oxccl-perf plot: nothing to draw");
        return 1;
    }
    let metric = if o.algbw { "algbw" } else { "busbw" };
    let title = o.title.clone().unwrap_or_else(|| format!("{metric} vs size"));
    match draw(&all, &o.out, &title, metric) {
        Ok(()) => {
            println!("oxccl-perf plot: {} line(s) drawn to {}", all.len(), o.out.display());
            0
        }
        Err(e) => {
            eprintln!("oxccl-perf plot: {e}");
            1
        }
    }
}

fn stem(p: &Path) -> String {
    p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string())
}

/// The lines of one JSON text (rows of `--json`, or `-J`'s object), labelled by `name` and,
/// where a file holds several, by algorithm, collective, type and op.
#[cfg(feature = "plot")]
fn series_of(text: &str, name: &str, o: &PlotOpts) -> Result<Vec<Series>, String> {
    use serde_json::Value;
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let rows = match &v {
        Value::Array(a) => a,
        Value::Object(m) => m.get("results").and_then(Value::as_array).ok_or("no \"results\" array")?,
        _ => return Err("expected an array of rows or an object with \"results\"".into()),
    };
    let half = if o.in_place { "ip" } else { "oop" };
    let metric = format!("{half}_{}", if o.algbw { "algbw" } else { "busbw" });
    let s = |r: &Value, k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    // Key of a line: (collective, type, op, algo); the label names only what varies.
    let mut keys: Vec<(String, String, String, String)> = Vec::new();
    let mut points: Vec<Vec<(f64, f64)>> = Vec::new();
    for r in rows {
        let key = (s(r, "collective"), s(r, "type"), s(r, "redop"), s(r, "algo"));
        let size = r.get("size").and_then(Value::as_f64).ok_or("a row without \"size\"")?;
        let Some(bw) = r.get(&metric).and_then(Value::as_f64) else { continue };
        let i = keys.iter().position(|k| *k == key).unwrap_or_else(|| {
            keys.push(key.clone());
            points.push(Vec::new());
            keys.len() - 1
        });
        points[i].push((size, bw));
    }
    let varies = |f: fn(&(String, String, String, String)) -> &String| keys.iter().any(|k| f(k) != f(&keys[0]));
    let (vc, vt, vo) = (varies(|k| &k.0), varies(|k| &k.1), varies(|k| &k.2));
    Ok(keys
        .iter()
        .zip(points)
        .map(|(k, mut pts)| {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut label = name.to_string();
            for (show, part) in [(vc, &k.0), (vt, &k.1), (vo, &k.2), (!k.3.is_empty(), &k.3)] {
                if show && !part.is_empty() {
                    label.push(' ');
                    label.push_str(part);
                }
            }
            Series { label, points: pts }
        })
        .collect())
}

#[cfg(not(feature = "plot"))]
fn series_of(_: &str, _: &str, _: &PlotOpts) -> Result<Vec<Series>, String> {
    Err("this oxccl-perf was built without the \"plot\" feature".into())
}

/// An axis label in decimal units, as the log axis ticks at powers of ten: `8 B`, `10 kB`,
/// `1 MB`, `1.5 GB`.
fn size_label(b: f64) -> String {
    for (u, s) in [(1e9, "GB"), (1e6, "MB"), (1e3, "kB")] {
        if b >= u {
            let v = b / u;
            return if (v - v.round()).abs() < 1e-9 { format!("{v:.0} {s}") } else { format!("{v:.1} {s}") };
        }
    }
    format!("{b:.0} B")
}

#[cfg(feature = "plot")]
fn draw(all: &[Series], out: &Path, title: &str, metric: &str) -> Result<(), String> {
    use plotters::prelude::*;
    use plotters::style::FontStyle;
    // The font comes with the binary: no system fonts are needed. Registering twice is harmless.
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the embedded font is invalid".to_string())?;
    let xs = all.iter().flat_map(|s| s.points.iter().map(|p| p.0)).filter(|&x| x > 0.0);
    let (xmin, xmax) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    if xmin > xmax {
        return Err("no row with a size above 0".into());
    }
    let (xmin, xmax) = (xmin, if xmax > xmin { xmax } else { xmin * 2.0 });
    let ymax = all.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0f64, f64::max).max(1e-3) * 1.1;
    let e = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", out.display());
    let root = BitMapBackend::new(out, (1200, 750)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 28))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0.0..ymax)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("message size (log scale)")
        .y_desc(format!("{metric} (GB/s)"))
        .x_label_formatter(&|x| size_label(*x))
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(|x| e(&x))?;
    for (i, s) in all.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| p.0 > 0.0).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

#[cfg(not(feature = "plot"))]
fn draw(_: &[Series], _: &Path, _: &str, _: &str) -> Result<(), String> {
    Err("this oxccl-perf was built without the \"plot\" feature".into())
}

#[cfg(all(test, feature = "plot"))]
mod tests {
    use super::*;

    fn opts() -> PlotOpts {
        PlotOpts { files: vec![], out: PathBuf::new(), title: None, algbw: false, in_place: false }
    }

    #[test]
    fn rows_become_lines_per_algorithm() {
        let rows = r#"[
          {"collective":"all_reduce","size":1024,"type":"float","redop":"sum","oop_busbw":2.0,"algo":"ring"},
          {"collective":"all_reduce","size":8,"type":"float","redop":"sum","oop_busbw":0.5,"algo":"ring"},
          {"collective":"all_reduce","size":8,"type":"float","redop":"sum","oop_busbw":0.7,"algo":"tree"}
        ]"#;
        let s = series_of(rows, "run", &opts()).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0], Series { label: "run ring".into(), points: vec![(8.0, 0.5), (1024.0, 2.0)] });
        assert_eq!(s[1], Series { label: "run tree".into(), points: vec![(8.0, 0.7)] });
        let obj = format!("{{\"oxccl_perf\":{{}},\"results\":{rows}}}");
        assert_eq!(series_of(&obj, "run", &opts()).unwrap(), s);
        assert!(series_of("{}", "x", &opts()).is_err());
    }

    #[test]
    fn size_labels() {
        assert_eq!(size_label(8.0), "8 B");
        assert_eq!(size_label(10_000.0), "10 kB");
        assert_eq!(size_label(1500.0), "1.5 kB");
        assert_eq!(size_label(1e6), "1 MB");
        assert_eq!(size_label(2.5e9), "2.5 GB");
    }
}
