//! Source-layout rules, checked by scanning `src/`: the process environment is read only in
//! the config module (`src/config.rs`, `src/config/`), through `config::environ`; and the
//! top-level modules' `crate::` dependencies form no cycle beyond the known one being broken;
//! no thread-local decides what a communicator call does.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("read src/") {
            let p = e.expect("directory entry").path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The 1-based lines of `text` (comments aside) that read an environment variable through
/// `std::env` (`var`, `var_os`, `vars`, `vars_os`, with or without the `std::` path).
fn env_reads(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .filter(|(_, l)| l.contains("env::var") || l.contains("use std::env::{") || l.contains("use std::env;"))
        .map(|(i, _)| i + 1)
        .collect()
}

#[test]
fn the_scanner_finds_environment_reads() {
    let sample = "fn a() {\n    let x = std::env::var(\"A\");\n    // std::env::var in a comment\n    let y = env::var_os(\"B\");\n    let z: Vec<_> = std::env::vars().collect();\n}\nuse std::env::{var, vars};\n";
    assert_eq!(env_reads(sample), vec![2, 4, 5, 7]);
    assert!(env_reads("std::env::set_var(\"A\", \"1\");\nstd::env::current_exe();\n").is_empty());
}

#[test]
fn environment_is_read_only_in_the_config_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = rust_files(&src);
    assert!(files.len() > 50, "expected the crate's sources under {}", src.display());
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if rel == "config.rs" || rel.starts_with("config/") {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read source");
        bad.extend(env_reads(&text).into_iter().map(|n| format!("src/{rel}:{n}")));
    }
    assert!(bad.is_empty(), "environment read outside src/config (use oxccl::config::environ): {bad:?}");
}

/// Top-level modules still in a dependency cycle, to be broken (docs/ARCHITECTURE.md, "Module
/// map"); none is left.
/// The test fails when a cycle holds any other module, and when one of these leaves the
/// cycle without being removed from this list, so the list only shrinks.
const KNOWN_CYCLE: &[&str] = &[];

/// The non-test code lines of each library file of `src/` (`lib.rs` and `bin/` aside), with
/// the top-level module the file belongs to (`foo.rs` or `foo/`). Test code is left out: files
/// named `tests.rs`, a file's tail from a `#[cfg(test)]` line followed by `mod`, and comment
/// lines.
fn code_lines(src: &Path) -> Vec<(String, Vec<String>)> {
    let top = |rel: &str| rel.split('/').next().unwrap().trim_end_matches(".rs").to_string();
    let mut out = Vec::new();
    for f in rust_files(src) {
        let rel = f.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
        if rel == "lib.rs" || rel.starts_with("bin/") || f.ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read source");
        let lines: Vec<&str> = text.lines().collect();
        let end = (0..lines.len())
            .find(|&i| lines[i].trim() == "#[cfg(test)]" && lines.get(i + 1).is_some_and(|n| n.starts_with("mod ")))
            .unwrap_or(lines.len());
        let code = lines[..end].iter().filter(|l| !l.trim_start().starts_with("//")).map(|l| l.to_string()).collect();
        out.push((top(&rel), code));
    }
    out
}

/// The names `src/lib.rs` re-exports at the crate root (`pub use module::...::{A, B}`), each
/// with the top-level module it comes from.
fn root_exports(src: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(src.join("lib.rs")).expect("read src/lib.rs");
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(path) = line.trim().strip_prefix("pub use ").and_then(|p| p.strip_suffix(';')) else { continue };
        let Some((module, _)) = path.split_once("::") else { continue };
        let names = match path.split_once('{') {
            Some((_, list)) => list.trim_end_matches('}').split(',').map(str::trim).collect::<Vec<_>>(),
            None => vec![path.rsplit("::").next().unwrap_or_default()],
        };
        for name in names.into_iter().filter(|n| !n.is_empty()) {
            let name = name.rsplit(" as ").next().unwrap_or(name);
            out.insert(name.to_string(), module.to_string());
        }
    }
    out
}

/// The top-level modules of `src/` and, for each, the others its non-test code
/// ([`code_lines`]) names as `crate::<module>`, or through a name the crate root re-exports
/// (`crate::Communicator` names `comm`: [`root_exports`]).
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = code_lines(src);
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let exports = root_exports(src);
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for (from, lines) in &files {
        let resolve = |name: String| match modules.contains(&name) {
            true => Some(name),
            false if KNOWN_REEXPORT_USES.contains(&(from.as_str(), name.as_str())) => None,
            false => exports.get(&name).cloned(),
        };
        for line in lines {
            graph
                .get_mut(from)
                .unwrap()
                .extend(crate_paths(line).into_iter().filter_map(resolve).filter(|m| m != from && modules.contains(m)));
        }
    }
    graph
}

/// Names the crate root re-exports that a module below their own still uses (module, name),
/// to be removed: the logger's banner names NCCL's API version, which `src/ffi/types.rs` defines
/// for the generated header. The test fails when one of these is gone without being removed
/// from the list, so the list only shrinks.
const KNOWN_REEXPORT_USES: &[(&str, &str)] = &[("log", "NCCL_MAJOR"), ("log", "NCCL_MINOR"), ("log", "NCCL_PATCH")];

#[test]
fn known_reexport_uses_are_still_there() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = code_lines(&src);
    for (module, name) in KNOWN_REEXPORT_USES {
        let used = files
            .iter()
            .filter(|(m, _)| m == module)
            .any(|(_, lines)| lines.iter().any(|l| crate_paths(l).iter().any(|n| n == name)));
        assert!(used, "{module} no longer names crate::{name}: remove it from KNOWN_REEXPORT_USES in tests/layers.rs");
    }
}

/// The first segments of the `crate::` paths in `line` (`$crate::` in macros aside).
fn crate_paths(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let macro_path = rest[..at].ends_with('$');
        rest = &rest[at + "crate::".len()..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !macro_path && !name.is_empty() {
            out.push(name);
        }
    }
    out
}

/// The strongly connected components of `graph` with more than one module (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct T<'g> {
        g: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'g>(t: &mut T<'g>, v: &'g str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        for w in &t.g[v] {
            if !t.index.contains_key(w.as_str()) {
                visit(t, w);
                let lw = t.low[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.stack.contains(&w.as_str()) {
                let iw = t.index[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = BTreeSet::new();
            while let Some(w) = t.stack.pop() {
                scc.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                t.out.push(scc);
            }
        }
    }
    let mut t = T { g: graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let g = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert!(cycles(&g(&[("api", "coll"), ("coll", "comm")])).is_empty());
    assert_eq!(
        cycles(&g(&[("api", "coll"), ("coll", "group"), ("group", "api"), ("group", "comm")])),
        vec![set(&["api", "coll", "group"])]
    );
    assert_eq!(crate_paths("use crate::comm::X; $crate::log::y(); crate::a_b::c"), vec!["comm", "a_b"]);
}

#[test]
fn top_level_modules_form_no_new_dependency_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(graph.len() > 15 && graph.contains_key("comm"), "expected the crate's modules, got {:?}", graph.keys());
    let known: BTreeSet<String> = KNOWN_CYCLE.iter().map(|s| s.to_string()).collect();
    let found = cycles(&graph);
    let cyclic: BTreeSet<String> = found.iter().flatten().cloned().collect();
    let show = |c: &BTreeSet<String>| {
        c.iter().map(|m| format!("{m} -> {:?}", graph[m].intersection(c).collect::<Vec<_>>())).collect::<Vec<_>>()
    };
    for c in &found {
        assert!(c.is_subset(&known), "a new import cycle among top-level modules: {:?}", show(c));
    }
    let left: Vec<&String> = known.difference(&cyclic).collect();
    assert!(left.is_empty(), "{left:?} no longer in a cycle: remove them from KNOWN_CYCLE in tests/layers.rs");
}

/// Modules the C ABI layer (`src/ffi/`) must not name: it converts and validates, and leaves
/// every decision (where a call runs, PreMulSum, groups, nonblocking creation) to the call
/// layer (`src/call/`), so that the Rust API has the same features.
const FFI_FORBIDDEN: &[&str] = &["device", "transport", "engine", "algo", "reduce"];

/// The only modules `src/ffi/` names: the call layer, the base types, errors and settings, and
/// the logger and the poison-tolerant lock (the `crate::` paths of its non-test code).
const FFI_ALLOWED: &[&str] = &["call", "types", "error", "config", "log", "sync"];

/// The `crate::` modules named by non-test, non-comment code of `text`, with their lines.
fn named_modules(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]" && lines.get(i + 1).is_some_and(|n| n.starts_with("mod ")) {
            break;
        }
        if line.trim_start().starts_with("//") {
            continue;
        }
        out.extend(crate_paths(line).into_iter().map(|m| (i + 1, m)));
    }
    out
}

#[test]
fn the_ffi_scan_sees_forbidden_imports() {
    let sample = "use crate::call::Call;\n// crate::device in a comment\nlet x = crate::device::classify(p);\n";
    let found: Vec<(usize, String)> =
        named_modules(sample).into_iter().filter(|(_, m)| FFI_FORBIDDEN.contains(&m.as_str())).collect();
    assert_eq!(found, vec![(3, "device".to_string())]);
}

#[test]
fn ffi_imports_no_device_transport_engine_algo_or_reduce_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules: BTreeSet<String> = module_graph(&src).into_keys().collect();
    assert!(modules.contains("call") && modules.contains("device"), "expected the crate's modules: {modules:?}");
    let dir = src.join("ffi");
    let files = rust_files(&dir);
    assert!(files.len() >= 8, "expected the C ABI's sources under {}", dir.display());
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read source");
        assert!(!text.contains("crate::{"), "{}: name modules one path at a time", f.display());
        for (line, m) in named_modules(&text).into_iter().filter(|(_, m)| modules.contains(m)) {
            if FFI_FORBIDDEN.contains(&m.as_str()) || !FFI_ALLOWED.contains(&m.as_str()) {
                bad.push(format!("{}:{line}: crate::{m}", f.strip_prefix(&dir).unwrap().display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "src/ffi/ names only {FFI_ALLOWED:?} (never {FFI_FORBIDDEN:?}): go through the call layer (src/call/): {bad:?}"
    );
}

/// The lines of non-test, non-comment code of `text` that start a thread or sleep.
fn threads_or_sleeps(text: &str) -> Vec<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]" && lines.get(i + 1).is_some_and(|n| n.starts_with("mod ")) {
            break;
        }
        let code = line.split("//").next().unwrap_or("");
        if ["thread::spawn", "thread::Builder", "thread::sleep", "thread::scope"].iter().any(|p| code.contains(p)) {
            out.push(i + 1);
        }
    }
    out
}

#[test]
fn the_thread_scan_sees_spawns_and_sleeps() {
    let sample = "let h = std::thread::Builder::new();\n// thread::sleep in a comment\nstd::thread::sleep(d);\n#[cfg(test)]\nmod tests { std::thread::spawn(f); }\n";
    assert_eq!(threads_or_sleeps(sample), vec![1, 3]);
}

/// The C ABI has no policy of its own: where and when a communicator is built (at once, on a
/// worker, at a group's end) is the call layer's (`call::create`), so src/ffi starts no thread
/// and waits by sleeping nowhere.
#[test]
fn ffi_starts_no_thread_and_sleeps_nowhere() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ffi");
    let files = rust_files(&dir);
    assert!(files.len() >= 8, "expected the C ABI's sources under {}", dir.display());
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read source");
        let rel = f.strip_prefix(&dir).unwrap().display().to_string();
        bad.extend(threads_or_sleeps(&text).into_iter().map(|n| format!("src/ffi/{rel}:{n}")));
    }
    assert!(bad.is_empty(), "src/ffi starts threads or sleeps (move the policy into src/call): {bad:?}");
}

/// A method of `impl Communicator` blocks: the top-level module whose file defines it, and
/// whether `fn` defines the name only once in the whole crate (then any call `.name(` means
/// this method; else only a call on a communicator does, [`calls_method`]).
#[derive(Clone, Debug, PartialEq)]
struct Method {
    module: String,
    unique: bool,
}

/// The methods of `impl Communicator` blocks (from a line [`opens_comm_impl`] accepts, the
/// type named plainly or through a `crate::` path, to the next `}` there), by name; names that such blocks of several modules define are left
/// out (the scan could not tell which one a call means).
fn communicator_methods(src: &Path) -> BTreeMap<String, Method> {
    let top = |rel: &str| rel.split('/').next().unwrap().trim_end_matches(".rs").to_string();
    let mut defined: BTreeMap<String, usize> = BTreeMap::new();
    let mut in_impl: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in rust_files(src) {
        let rel = f.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
        if rel.starts_with("bin/") {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read source");
        let mut inside = false;
        for line in text.lines() {
            if opens_comm_impl(line) {
                inside = true;
            } else if inside && line.starts_with('}') {
                inside = false;
            }
            if let Some(name) = fn_name(line) {
                *defined.entry(name.clone()).or_default() += 1;
                if inside {
                    in_impl.entry(name).or_default().insert(top(&rel));
                }
            }
        }
    }
    in_impl
        .into_iter()
        .filter_map(|(n, modules)| {
            let unique = defined[&n] == 1;
            (modules.len() == 1).then(|| (n, Method { module: modules.into_iter().next().unwrap(), unique }))
        })
        .collect()
}

/// Whether `line` opens an `impl Communicator` block at the start of a line, however the type
/// is spelled: `Communicator`, or a path to it (`crate::Communicator`,
/// `crate::comm::Communicator`, `super::Communicator`), with or without generics on `impl`.
fn opens_comm_impl(line: &str) -> bool {
    let Some(rest) = line.strip_prefix("impl") else { return false };
    let rest = match rest.strip_prefix('<') {
        Some(r) => r.split_once('>').map_or("", |(_, t)| t),
        None => rest,
    };
    let ty = rest.trim_start().split(['{', ' ']).next().unwrap_or("");
    let ty = ty.trim_start_matches("crate::").trim_start_matches("super::").trim_start_matches("comm::");
    ty == "Communicator" && rest.trim_end().ends_with('{')
}

/// The name `line` defines with `fn`, if any.
fn fn_name(line: &str) -> Option<String> {
    let at = line.find("fn ")?;
    let before = line[..at].trim();
    let qualifiers = ["", "pub", "pub(crate)", "pub(super)", "const", "unsafe", "pub unsafe", "pub(crate) unsafe"];
    if !qualifiers.contains(&before) && !before.ends_with("extern \"C\"") {
        return None;
    }
    let name: String = line[at + 3..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// Method names that std types also have (`str::split`), whose calls the scan cannot tell
/// apart from the `Communicator` method.
const STD_METHOD_NAMES: &[&str] = &["split"];

/// Calls of a `Communicator` method from a module below the one defining it (module, method),
/// to be removed (docs/ARCHITECTURE.md, "Module map"). The test fails when another upward call
/// appears and when one of these is gone without being removed from the list, so the list only
/// shrinks.
const KNOWN_UPWARD_CALLS: &[(&str, &str)] = &[];

/// Each top-level module and the modules it depends on.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// Receivers that hold a communicator in the crate's code (`comm.`, `self.comm.`,
/// `job.comm.`, `child_comm.`...), and `self.` inside an `impl Communicator` block.
const COMM_RECEIVERS: &[&str] = &["comm.", "comm()."];

/// Whether `line` calls method `name` of `m`: any `.name(` or `::name(` for a name the crate
/// defines once, else only on a communicator ([`COMM_RECEIVERS`], or `self` when the line is
/// inside an `impl Communicator` block).
fn calls_method(line: &str, name: &str, m: &Method, in_impl: bool) -> bool {
    if m.unique {
        return line.contains(&format!(".{name}(")) || line.contains(&format!("::{name}("));
    }
    let on_self = in_impl && line.contains(&format!("self.{name}("));
    on_self
        || COMM_RECEIVERS.iter().any(|r| line.contains(&format!("{r}{name}(")))
        || line.contains(&format!("Communicator::{name}("))
}

/// `module_graph` plus an edge for each call of a `Communicator` method ([`calls_method`])
/// defined in another top-level module: the dependencies `crate::` paths do not show. Also
/// returns each (calling module, method) pair that made an edge.
fn graph_with_method_calls(src: &Path) -> (Graph, BTreeSet<(String, String)>) {
    let mut graph = module_graph(src);
    let mut calls = BTreeSet::new();
    let methods = communicator_methods(src);
    for (from, lines) in code_lines(src) {
        let mut in_impl = false;
        for line in &lines {
            if opens_comm_impl(line) {
                in_impl = true;
            } else if in_impl && line.starts_with('}') {
                in_impl = false;
            }
            for (name, m) in &methods {
                let module = &m.module;
                if *module == from || STD_METHOD_NAMES.contains(&name.as_str()) {
                    continue;
                }
                if calls_method(line, name, m, in_impl) {
                    calls.insert((from.clone(), name.clone()));
                    if !KNOWN_UPWARD_CALLS.contains(&(from.as_str(), name.as_str())) {
                        graph.get_mut(&from).unwrap().insert(module.clone());
                    }
                }
            }
        }
    }
    (graph, calls)
}

#[test]
fn the_method_scan_sees_communicator_methods() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let methods = communicator_methods(&src);
    // A method of each of two files, as a check that the scan reads the impl blocks.
    assert_eq!(methods.get("fail_call").map(|m| m.module.as_str()), Some("comm"), "{methods:?}");
    assert_eq!(methods.get("plan_for").map(|m| m.module.as_str()), Some("coll"), "{methods:?}");
    // A name other code defines too (`fn run`) is a call of the method only on a communicator.
    let run = Method { module: "group".into(), unique: false };
    assert!(calls_method("        comm.run(op)?;", "run", &run, false));
    assert!(calls_method("        job.comm.run(op)?;", "run", &run, false));
    assert!(calls_method("        self.run(op)?;", "run", &run, true));
    assert!(!calls_method("        self.run(op)?;", "run", &run, false));
    assert!(!calls_method("        engine.run(op)?;", "run", &run, false));
    // A name the crate root re-exports names its module.
    let exports = root_exports(&src);
    assert_eq!(exports.get("Communicator").map(String::as_str), Some("comm"), "{exports:?}");
    assert_eq!(exports.get("Collectives").map(String::as_str), Some("api"), "{exports:?}");
    assert_eq!(fn_name("    pub(crate) fn run_raw(&self) {"), Some("run_raw".into()));
    // Blocks and calls that name the type through a `crate::` path count as well.
    assert!(opens_comm_impl("impl Communicator {"));
    assert!(opens_comm_impl("impl crate::comm::Communicator {"));
    assert!(opens_comm_impl("impl crate::Communicator {"));
    assert!(opens_comm_impl("impl<'a> super::Communicator {"));
    assert!(!opens_comm_impl("impl Drop for Communicator {"));
    assert!(!opens_comm_impl("impl CommunicatorPool {"));
    assert!(calls_method("        crate::comm::Communicator::run(&c, op)?;", "run", &run, false));
    assert!(calls_method("        crate::Communicator::run(&c, op)?;", "run", &run, false));
    let unique = Method { module: "group".into(), unique: true };
    assert!(calls_method(
        "    crate::group::raw::Communicator::all_reduce_slices(c, a, b)",
        "all_reduce_slices",
        &unique,
        false
    ));
    assert_eq!(fn_name("    let f = |x| x; // fn in a comment"), None);
    // The scan finds the upward calls still listed (else the list would pass vacuously).
    let (_, calls) = graph_with_method_calls(&src);
    for (m, f) in KNOWN_UPWARD_CALLS {
        assert!(
            calls.contains(&(m.to_string(), f.to_string())),
            "{m} no longer calls {f}: remove it from KNOWN_UPWARD_CALLS in tests/layers.rs"
        );
    }
}

#[test]
fn communicator_method_calls_form_no_dependency_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (graph, _) = graph_with_method_calls(&src);
    let found = cycles(&graph);
    let show = |c: &BTreeSet<String>| {
        c.iter().map(|m| format!("{m} -> {:?}", graph[m].intersection(c).collect::<Vec<_>>())).collect::<Vec<_>>()
    };
    assert!(
        found.is_empty(),
        "calls of Communicator methods across modules make a dependency cycle (an upward call): {:?}",
        found.iter().map(show).collect::<Vec<_>>()
    );
}

/// Files of `src/device/` still in a dependency cycle among themselves (each set one strongly
/// connected component); none is left: the IPC flows (`window.rs`, `direct.rs`) run on the
/// mesh of `mesh.rs` and only the dispatcher `ipc.rs` names them, and `ops.rs` takes its block
/// size from `kernels.rs`. The test fails on any cycle, and when one of these is gone or
/// changed without the list being updated, so the list only shrinks.
const KNOWN_DEVICE_CYCLES: &[&[&str]] = &[];

/// The files of `src/device/` (by stem, `mod.rs` aside) and, for each, the others its non-test
/// code names as `super::<file>`, `crate::device::<file>` or in a `use super::{...}` list.
fn device_graph(dir: &Path) -> Graph {
    let files: Vec<PathBuf> = rust_files(dir).into_iter().filter(|f| f.parent() == Some(dir)).collect();
    let stem = |f: &PathBuf| f.file_stem().unwrap().to_string_lossy().to_string();
    let names: BTreeSet<String> = files.iter().map(stem).filter(|s| s != "mod").collect();
    let mut graph: Graph = names.iter().map(|n| (n.clone(), BTreeSet::new())).collect();
    for f in files.iter().filter(|f| stem(f) != "mod") {
        let text = std::fs::read_to_string(f).expect("read source");
        let code: String = named_code(&text);
        let me = stem(f);
        graph.get_mut(&me).unwrap().extend(device_paths(&code).into_iter().filter(|n| *n != me && names.contains(n)));
    }
    graph
}

/// The non-test, non-comment code of `text`, as one string.
fn named_code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| lines[i].trim() == "#[cfg(test)]" && lines.get(i + 1).is_some_and(|n| n.starts_with("mod ")))
        .unwrap_or(lines.len());
    lines[..end].iter().filter(|l| !l.trim_start().starts_with("//")).copied().collect::<Vec<_>>().join("\n")
}

/// The first segments after `super::` or `crate::device::` in `code` (`super::super::` aside),
/// each item of a `super::{a::X, b}` list included.
fn device_paths(code: &str) -> Vec<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    let mut out = Vec::new();
    for prefix in ["super::", "crate::device::"] {
        let mut rest = code;
        while let Some(at) = rest.find(prefix) {
            rest = &rest[at + prefix.len()..];
            if prefix == "super::" && rest.starts_with("super::") {
                // `super::super::...`: a path out of src/device, not one of its files.
                rest = rest.trim_start_matches("super::");
                continue;
            }
            if let Some(list) = rest.strip_prefix('{') {
                let inner = &list[..list.find('}').unwrap_or(list.len())];
                out.extend(inner.split(',').map(|p| ident(p.trim())).filter(|n| !n.is_empty()));
            } else {
                out.push(ident(rest));
            }
        }
    }
    out.retain(|n| !n.is_empty());
    out
}

#[test]
fn the_device_scan_sees_super_paths_and_lists() {
    let code = "use super::layout::{A, B};\nuse super::{check, ops, DevCall};\nlet x = super::super::config::x();\ncrate::device::watch::release(w);\n";
    assert_eq!(device_paths(code), vec!["layout", "check", "ops", "DevCall", "watch"]);
}

#[test]
fn device_files_form_no_cycle_but_the_known_ones() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/device");
    let graph = device_graph(&dir);
    for m in ["ipc", "mesh", "direct", "region", "watch", "window", "run", "setup", "state", "layout"] {
        assert!(graph.contains_key(m), "expected src/device/{m}.rs: {:?}", graph.keys());
    }
    let found: BTreeSet<BTreeSet<String>> = cycles(&graph).into_iter().collect();
    let known: BTreeSet<BTreeSet<String>> =
        KNOWN_DEVICE_CYCLES.iter().map(|c| c.iter().map(|s| s.to_string()).collect()).collect();
    let show = |c: &BTreeSet<String>| {
        c.iter().map(|m| format!("{m} -> {:?}", graph[m].intersection(c).collect::<Vec<_>>())).collect::<Vec<_>>()
    };
    let new: Vec<_> = found.difference(&known).map(show).collect();
    assert!(new.is_empty(), "a cycle among src/device/ files (shared layout goes in layout.rs): {new:?}");
    let gone: Vec<_> = known.difference(&found).collect();
    assert!(gone.is_empty(), "{gone:?} no longer a cycle as listed: update KNOWN_DEVICE_CYCLES in tests/layers.rs");
}

/// The thread-local variables that the non-test code of `text` declares: (1-based line of the
/// `thread_local!`, variable name), for one-line and block declarations alike.
fn thread_locals(text: &str) -> Vec<(usize, String)> {
    let code = named_code_lines(text);
    let mut out = Vec::new();
    let mut open: Option<usize> = None;
    for (i, line) in code.iter().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        if code.contains("thread_local!") {
            open = Some(i + 1);
        }
        let Some(at) = open else { continue };
        if let Some(rest) = code.split("static ").nth(1) {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            out.push((at, name));
        }
        if code.trim_end().ends_with('}') || code.trim_end().ends_with(");") {
            open = None;
        }
    }
    out
}

/// The lines of `text` up to its `#[cfg(test)] mod`, comment lines blanked (numbering kept).
fn named_code_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| lines[i].trim() == "#[cfg(test)]" && lines.get(i + 1).is_some_and(|n| n.starts_with("mod ")))
        .unwrap_or(lines.len());
    lines[..end].iter().map(|l| if l.trim_start().starts_with("//") { "" } else { l }).collect()
}

#[test]
fn the_thread_local_scan_sees_declarations() {
    let sample = "thread_local! {\n    /// Doc.\n    static A: Cell<bool> = const { Cell::new(false) };\n}\n\
                  // thread_local! { static C: u8 = 0; }\n    thread_local!(static B: u8 = 0);\n\
                  static D: u8 = 0;\n#[cfg(test)]\nmod tests {\n    thread_local! { static E: u8 = 0; }\n}\n";
    assert_eq!(thread_locals(sample), vec![(1, "A".to_string()), (6, "B".to_string())]);
}

/// Thread-locals of `src/device/` that coordinate the device layer's own threads and leave
/// every communicator call as it is: `lockstep.rs`'s `MINE`, the meeting point of a device
/// group's enqueue threads.
const KNOWN_DEVICE_THREAD_LOCALS: &[(&str, &str)] = &[("lockstep.rs", "MINE")];

/// Whether a call waits for the communicator's device work in flight is decided by an explicit
/// argument (`comm::Caller`, passed by the public API or by the device layer's
/// `group::host_work::HostWork`), never by state of the calling thread: the path of a host call
/// to its session (`src/comm*`, `src/coll.rs`, `src/group*`) declares no thread-local, and
/// `src/device/` none but the known ones.
#[test]
fn no_thread_local_changes_what_a_communicator_call_does() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![src.join("comm.rs"), src.join("coll.rs"), src.join("group.rs")];
    files.extend(rust_files(&src.join("comm")));
    files.extend(rust_files(&src.join("group")));
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read source");
        let rel = f.strip_prefix(&src).unwrap().display().to_string();
        bad.extend(thread_locals(&text).into_iter().map(|(n, v)| format!("src/{rel}:{n}: {v}")));
    }
    assert!(bad.is_empty(), "a thread-local on a communicator call's path (pass a `Caller` instead): {bad:?}");

    let dir = src.join("device");
    let mut seen = BTreeSet::new();
    for f in rust_files(&dir) {
        let text = std::fs::read_to_string(&f).expect("read source");
        let rel = f.strip_prefix(&dir).unwrap().display().to_string();
        for (n, v) in thread_locals(&text) {
            if KNOWN_DEVICE_THREAD_LOCALS.contains(&(rel.as_str(), v.as_str())) {
                seen.insert((rel.clone(), v));
            } else {
                bad.push(format!("src/device/{rel}:{n}: {v}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "a thread-local in src/device/ (device work reaches host calls through `HostWork`, not thread state): {bad:?}"
    );
    for (f, v) in KNOWN_DEVICE_THREAD_LOCALS {
        assert!(
            seen.contains(&(f.to_string(), v.to_string())),
            "src/device/{f} no longer declares {v}: remove it from KNOWN_DEVICE_THREAD_LOCALS in tests/layers.rs"
        );
    }
    // The flag this replaced stays gone.
    for f in rust_files(&src) {
        let text = std::fs::read_to_string(&f).expect("read source");
        for name in ["DEVICE_WORKER", "mark_device_worker", "as_device_worker"] {
            assert!(!text.contains(name), "{} names {name}: use `Communicator::device_host_call`", f.display());
        }
    }
}
