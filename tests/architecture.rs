//! The layering guard: reads `src/`, finds each top-level module's `crate::` dependencies outside
//! test code, and fails when a module depends on a layer above its own or when modules of one
//! layer form a cycle. The layer table is the one in the crate doc of `src/lib.rs`, so the doc a
//! reader sees and the rule the build enforces are the same text.
//!
//! This is a reader of Rust source, not a compiler: it strips comments, string literals and items
//! under a `#[cfg(...)]` that names `test`, then resolves `crate::`, `super::` and (at the crate
//! root) bare module paths to the top-level module they name. A `use crate::{a::X, b}` group
//! counts as an edge to each of `a` and `b`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One `crate::` path found in the source: where it is and which top-level module it names.
#[derive(Debug, Clone)]
struct Edge {
    from: String,
    to: String,
    file: PathBuf,
    line: usize,
}

/// Layer index (0 = top) of every module the crate doc's table names.
fn layer_table(lib_rs: &str) -> Vec<(String, Vec<String>)> {
    let mut layers = Vec::new();
    let mut in_table = false;
    for line in lib_rs.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            if in_table {
                break;
            }
            continue;
        };
        let doc = doc.trim();
        if doc.starts_with("| layer ") {
            in_table = true;
            continue;
        }
        if !in_table || doc.starts_with("|--") || doc.starts_with("|-") {
            continue;
        }
        if !doc.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = doc.trim_matches('|').split('|').map(str::trim).collect();
        let modules = cells[1]
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|m| m.trim_end_matches('/').to_string())
            .collect();
        layers.push((cells[0].to_string(), modules));
    }
    layers
}

/// Source with comments and string/char literal contents blanked, line breaks kept so that
/// line numbers still point at the original file.
fn strip_comments_and_strings(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |out: &mut String, c: u8| out.push(if c == b'\n' { '\n' } else { ' ' });
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    out.push(' ');
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        out.push_str("  ");
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        out.push_str("  ");
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        blank(&mut out, b[i]);
                        i += 1;
                    }
                }
            }
            b'r' if matches!(b.get(i + 1), Some(b'"') | Some(b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                // A raw string: r"..." or r#"..."#.
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                out.push('"');
                j += 1;
                while j < b.len() && !b[j..].starts_with(&close) {
                    blank(&mut out, b[j]);
                    j += 1;
                }
                out.push('"');
                i = (j + close.len()).min(b.len());
            }
            b'"' => {
                out.push('"');
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        out.push(' ');
                        i += 1;
                    }
                    if i < b.len() {
                        blank(&mut out, b[i]);
                        i += 1;
                    }
                }
                out.push('"');
                i += 1;
            }
            b'\'' => {
                // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): only the former is
                // blanked.
                let rest = &b[i + 1..];
                let len = if rest.first() == Some(&b'\\') {
                    rest.iter().position(|&c| c == b'\'').map(|p| p + 1)
                } else if rest.get(1) == Some(&b'\'') {
                    Some(2)
                } else {
                    None
                };
                match len {
                    Some(n) => {
                        out.push('\'');
                        for _ in 1..n {
                            out.push(' ');
                        }
                        out.push('\'');
                        i += n + 1;
                    }
                    None => {
                        out.push('\'');
                        i += 1;
                    }
                }
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// Blanks every item under a `#[cfg(...)]` attribute that mentions `test`: the attribute and
/// the item up to its closing `}` or `;` at the same depth.
fn strip_test_items(src: &str) -> String {
    let mut b: Vec<u8> = src.as_bytes().to_vec();
    let mut i = 0;
    while let Some(at) = find(&b, i, b"#[cfg(") {
        let close = match_close(&b, at + 1, b'[', b']');
        let attr = String::from_utf8_lossy(&b[at..close]).to_string();
        let names_test = attr
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .any(|w| w == "test");
        if !names_test || attr.contains("not(test") {
            i = close;
            continue;
        }
        // The item runs to the first `;` or the `{...}` block that closes it at depth 0.
        let mut j = close;
        let end = loop {
            match b.get(j) {
                None => break b.len(),
                Some(b';') => break j + 1,
                Some(b'{') => break match_close(&b, j, b'{', b'}'),
                Some(b'#') if b.get(j + 1) == Some(&b'[') => j = match_close(&b, j + 1, b'[', b']'),
                _ => j += 1,
            }
        };
        for c in &mut b[at..end] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
        i = end;
    }
    String::from_utf8(b).expect("blanking keeps UTF-8")
}

fn find(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// Index just past the bracket that closes the one at `open`.
fn match_close(b: &[u8], open: usize, o: u8, c: u8) -> usize {
    let mut depth = 0;
    for (k, &ch) in b.iter().enumerate().skip(open) {
        if ch == o {
            depth += 1;
        } else if ch == c {
            depth -= 1;
            if depth == 0 {
                return k + 1;
            }
        }
    }
    b.len()
}

/// Module files declared under a test cfg (`#[cfg(test)] mod pool_tests;`) are test code.
fn test_only_children(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending_test_cfg = false;
    for line in src.lines().map(str::trim) {
        if line.starts_with("#[cfg(") && line.contains("test") && !line.contains("not(test") {
            pending_test_cfg = true;
            continue;
        }
        if pending_test_cfg {
            let decl = line.trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            if let Some(name) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
                out.push(name.trim().to_string());
            }
            if !line.starts_with("#[") {
                pending_test_cfg = false;
            }
        }
    }
    out
}

/// The identifier starting at `i`, if any.
fn ident_at(s: &[u8], i: usize) -> &str {
    let end = s[i..]
        .iter()
        .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
        .map_or(s.len(), |p| p + i);
    std::str::from_utf8(&s[i..end]).unwrap_or("")
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The top-level modules a path starting at `i` (just after `crate::`) names: one, or each
/// member of a `{...}` group.
fn heads_after(s: &[u8], i: usize) -> Vec<(String, usize)> {
    let i = skip_ws(s, i);
    if s.get(i) != Some(&b'{') {
        return vec![(ident_at(s, i).to_string(), i)];
    }
    let end = match_close(s, i, b'{', b'}');
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect = true;
    for k in i + 1..end - 1 {
        match s[k] {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b',' if depth == 0 => expect = true,
            c if expect && depth == 0 && (c.is_ascii_alphabetic() || c == b'_') => {
                heads.push((ident_at(s, k).to_string(), k));
                expect = false;
            }
            _ => {}
        }
    }
    heads
}

/// `crate::` (and `super::` reaching the root) dependencies of one file.
fn edges_of(file: &Path, module: &[String], src: &str, top: &BTreeSet<String>) -> Vec<Edge> {
    let code = strip_test_items(&strip_comments_and_strings(src));
    let s = code.as_bytes();
    let line_of = |at: usize| s[..at].iter().filter(|&&c| c == b'\n').count() + 1;
    let from = module.first().cloned().unwrap_or_default();
    let mut edges = Vec::new();
    let mut push = |to: String, at: usize| {
        if top.contains(&to) && to != from {
            edges.push(Edge {
                from: from.clone(),
                to,
                file: file.to_path_buf(),
                line: line_of(at),
            });
        }
    };
    let boundary =
        |at: usize| at == 0 || !(s[at - 1].is_ascii_alphanumeric() || s[at - 1] == b'_' || s[at - 1] == b':');
    // crate::x
    let mut i = 0;
    while let Some(at) = find(s, i, b"crate::") {
        if boundary(at) {
            for (head, pos) in heads_after(s, at + 7) {
                push(head, pos);
            }
        }
        i = at + 7;
    }
    // super::super::x: each `super` climbs one module; reaching the root names a top module.
    let mut i = 0;
    while let Some(at) = find(s, i, b"super::") {
        if boundary(at) {
            let mut depth = 1;
            let mut k = at + 7;
            while s[k..].starts_with(b"super::") {
                depth += 1;
                k += 7;
            }
            // A file's own module path: `pool::body` is two deep; `super` from it is `pool`.
            if depth >= module.len() {
                for (head, pos) in heads_after(s, k) {
                    push(head, pos);
                }
            }
            i = k;
        } else {
            i = at + 7;
        }
    }
    // At the crate root, `use x::` and `x::` name top-level modules directly.
    if module.is_empty() {
        for name in top {
            let needle = format!("{name}::");
            let mut i = 0;
            while let Some(at) = find(s, i, needle.as_bytes()) {
                if boundary(at) {
                    edges.push(Edge {
                        from: String::new(),
                        to: name.clone(),
                        file: file.to_path_buf(),
                        line: line_of(at),
                    });
                }
                i = at + needle.len();
            }
        }
    }
    edges
}

/// Every `.rs` file under `src/` that is library code, with its module path.
fn library_files(src: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let mut out = Vec::new();
    let mut stack = vec![(src.to_path_buf(), Vec::<String>::new())];
    while let Some((dir, prefix)) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        entries.sort_by_key(|e| e.path());
        let parent_src = if prefix.is_empty() {
            std::fs::read_to_string(src.join("lib.rs")).unwrap()
        } else {
            let mod_rs = dir.join("mod.rs");
            let sibling = dir.with_extension("rs");
            std::fs::read_to_string(mod_rs)
                .or_else(|_| std::fs::read_to_string(sibling))
                .unwrap_or_default()
        };
        let test_only = test_only_children(&parent_src);
        for entry in entries {
            let path = entry.path();
            let stem = path.file_stem().unwrap().to_string_lossy().to_string();
            if test_only.contains(&stem) {
                continue;
            }
            if path.is_dir() {
                let mut p = prefix.clone();
                p.push(stem);
                stack.push((path, p));
            } else if path.extension().is_some_and(|e| e == "rs") {
                if prefix.is_empty() && stem == "main" {
                    continue; // the binary: the top of everything, not a library module
                }
                let mut module = prefix.clone();
                if stem != "mod" && stem != "lib" {
                    module.push(stem);
                }
                out.push((path, module));
            }
        }
    }
    out
}

/// What the table and the source disagree on, one line per finding.
fn violations(root: &Path) -> (Vec<String>, BTreeMap<String, BTreeSet<String>>) {
    let src = root.join("src");
    let lib_rs = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let table = layer_table(&lib_rs);
    let mut layer_of = BTreeMap::new();
    for (index, (_, modules)) in table.iter().enumerate() {
        for m in modules {
            layer_of.insert(m.clone(), index);
        }
    }
    let files = library_files(&src);
    let top: BTreeSet<String> = files.iter().filter_map(|(_, m)| m.first().cloned()).collect();
    let mut found = Vec::new();
    if table.is_empty() {
        found.push("src/lib.rs: no layer table (`//! | layer | modules | owns |`) in the crate doc".into());
    }
    for m in &top {
        if !layer_of.contains_key(m) {
            found.push(format!(
                "src/{m}: module `{m}` has no layer in the table in src/lib.rs"
            ));
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut first_edge: BTreeMap<(String, String), Edge> = BTreeMap::new();
    for (file, module) in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for edge in edges_of(file.strip_prefix(root).unwrap(), module, &text, &top) {
            if edge.from.is_empty() {
                continue; // the crate root declares and re-exports; it is not a layer
            }
            graph
                .entry(edge.from.clone())
                .or_default()
                .insert(edge.to.clone());
            let (Some(&lf), Some(&lt)) = (layer_of.get(&edge.from), layer_of.get(&edge.to)) else {
                continue;
            };
            if lt < lf {
                found.push(format!(
                    "{}:{}: `{}` ({}) depends on `{}` ({}), a layer above it",
                    edge.file.display(),
                    edge.line,
                    edge.from,
                    table[lf].0,
                    edge.to,
                    table[lt].0
                ));
            } else if lt == lf {
                first_edge
                    .entry((edge.from.clone(), edge.to.clone()))
                    .or_insert(edge);
            }
        }
    }
    // Same-layer cycles: an edge a→b in one layer with a path b→…→a inside that layer.
    for ((a, b), edge) in &first_edge {
        let layer = layer_of[a];
        let mut seen = BTreeSet::new();
        let mut stack = vec![b.clone()];
        let mut back = false;
        while let Some(m) = stack.pop() {
            if m == *a {
                back = true;
                break;
            }
            if !seen.insert(m.clone()) {
                continue;
            }
            for next in graph.get(&m).into_iter().flatten() {
                if layer_of.get(next) == Some(&layer) {
                    stack.push(next.clone());
                }
            }
        }
        if back {
            found.push(format!(
                "{}:{}: `{a}` and `{b}` ({}) depend on each other",
                edge.file.display(),
                edge.line,
                table[layer].0
            ));
        }
    }
    (found, graph)
}

#[test]
fn modules_depend_only_on_their_layer_or_below() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (found, graph) = violations(root);
    for (m, deps) in &graph {
        println!("{m} -> {}", deps.iter().cloned().collect::<Vec<_>>().join(", "));
    }
    assert!(
        found.is_empty(),
        "{} layering violation(s):\n{}",
        found.len(),
        found.join("\n")
    );
}

/// The reader must see what it is meant to see, or the test above could pass on nothing.
#[test]
fn the_reader_finds_paths_and_skips_test_code() {
    let top: BTreeSet<String> = ["pool", "config", "metrics"].map(String::from).into();
    let src = r#"
//! Docs mention crate::config, which is not a dependency.
use crate::{pool::{Lease, Pool}, metrics};
fn f() { let s = "crate::config"; crate::config::load(); }
#[cfg(test)]
mod tests { use crate::config::Config; }
"#;
    let edges = edges_of(Path::new("src/x.rs"), &["x".into()], src, &top);
    let found: Vec<(String, usize)> = edges.iter().map(|e| (e.to.clone(), e.line)).collect();
    assert_eq!(
        found,
        vec![("pool".into(), 3), ("metrics".into(), 3), ("config".into(), 4)]
    );
    let nested = "fn g() { super::super::pool::x(); super::sibling(); }";
    let edges = edges_of(Path::new("src/a/b.rs"), &["a".into(), "b".into()], nested, &top);
    assert_eq!(edges.iter().map(|e| e.to.as_str()).collect::<Vec<_>>(), ["pool"]);
    assert_eq!(
        test_only_children("#[cfg(test)]\nmod pool_tests;\nmod body;"),
        ["pool_tests"]
    );
    let table = layer_table("//! | layer | modules | owns |\n//! |---|---|---|\n//! | top | `app` | x |\n//! | leaves | `config/`, `error` | y |\n");
    assert_eq!(table[1].1, ["config", "error"]);
}

/// The files whose text contains `needle`, as `src/...` paths.
fn files_with(texts: &[(PathBuf, Vec<String>, String)], needle: &str) -> Vec<String> {
    texts
        .iter()
        .filter(|(_, _, text)| text.contains(needle))
        .map(|(file, _, _)| file.to_string_lossy().replace('\\', "/"))
        .collect()
}

/// One place sees a request whole: its span is opened in `proxy::observe` only, and requests
/// enter the request path through `Proxy::handle` from `downstream` only (HTTP/1.1 and h2c),
/// so a span, a log line or an admission decision cannot be added for one protocol alone.
#[test]
fn one_observer_sees_every_request_on_both_protocols() {
    let texts = library_text(Path::new(env!("CARGO_MANIFEST_DIR")), true);
    assert_eq!(
        files_with(&texts, "span!(\"request\""),
        ["src/proxy/observe.rs"],
        "a request's span opened outside proxy::observe"
    );
    let entries = files_with(&texts, ".proxy.handle(");
    assert!(
        entries.len() == 2 && entries.iter().all(|f| f.starts_with("src/downstream/")),
        "requests enter the request path here, not only from downstream's two servers: {entries:?}"
    );
}

/// A request reaches its upstream (the pool, or an upgrade's own connection) only after the
/// admission step has decided, in `Proxy::forward`.
#[test]
fn nothing_goes_upstream_before_the_admission_step() {
    let texts = library_code(Path::new(env!("CARGO_MANIFEST_DIR")));
    let sends: Vec<String> = ["upstream.send(", "upgrade::send("]
        .iter()
        .flat_map(|needle| files_with(&texts, needle))
        .collect();
    assert_eq!(
        sends,
        ["src/proxy/mod.rs", "src/proxy/mod.rs"],
        "an upstream send outside Proxy::forward"
    );
    let forward = &texts
        .iter()
        .find(|(file, _, _)| file.ends_with("src/proxy/mod.rs"))
        .unwrap()
        .2;
    let admitted = forward
        .find(".admit(")
        .expect("Proxy::forward asks the admission step");
    for needle in ["upstream.send(", "upgrade::send("] {
        let sent = forward.find(needle).unwrap();
        assert!(
            admitted < sent,
            "{needle} comes before the admission step in proxy/mod.rs"
        );
    }
}

/// Where a request came from is one type, `clients::Source`, for downstream, the per-source
/// accounting and the access log alike.
#[test]
fn where_a_request_came_from_is_one_type() {
    let texts = library_code(Path::new(env!("CARGO_MANIFEST_DIR")));
    let mut defined = Vec::new();
    for (file, _, text) in &texts {
        let words: Vec<&str> = text
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .filter(|w| !w.is_empty())
            .collect();
        for pair in words.windows(2) {
            if matches!(pair[0], "enum" | "struct" | "type") && matches!(pair[1], "Source" | "Peer") {
                defined.push(format!("{}: {} {}", file.display(), pair[0], pair[1]));
            }
        }
    }
    assert_eq!(defined, ["src/clients.rs: enum Source"]);
}

// === module names ===

/// The crates `[dependencies]` in Cargo.toml names, as Rust paths spell them (`hyper-util` is
/// `hyper_util`).
fn dependency_crates(cargo_toml: &str) -> BTreeSet<String> {
    let mut crates = BTreeSet::new();
    let mut in_deps = false;
    for line in cargo_toml.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if !in_deps || line.starts_with('#') {
            continue;
        }
        if let Some((name, _)) = line.split_once('=') {
            crates.insert(name.trim().replace('-', "_"));
        }
    }
    crates
}

/// Library modules (files and directories under `src/`) named like a crate the library
/// depends on: inside its parent such a module shadows the crate, so `h2::Error` means one
/// thing in one file and another in the next.
fn modules_named_like_crates(root: &Path) -> Vec<String> {
    let cargo_toml = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let crates = dependency_crates(&cargo_toml);
    let src = root.join("src");
    let mut found = Vec::new();
    for (file, module) in library_files(&src) {
        // `foo/mod.rs` is named by its directory, which is the module path's last segment.
        let Some(name) = module.last() else { continue };
        if crates.contains(name) {
            found.push(format!(
                "{}: module `{}` is named like the `{name}` crate in Cargo.toml's [dependencies]",
                file.strip_prefix(root).unwrap().display(),
                module.join("::")
            ));
        }
    }
    found.sort();
    found.dedup();
    found
}

#[test]
fn no_module_is_named_like_a_crate_it_depends_on() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let found = modules_named_like_crates(root);
    assert!(
        found.is_empty(),
        "{} module(s) shadow a crate:\n{}",
        found.len(),
        found.join("\n")
    );
}

// === file-level cycles inside a module directory ===

/// Directories whose files must not import each other in a circle (`mod.rs`, which declares
/// them and re-exports their items, aside). A directory gets a row here once its files' circles
/// are untied.
const ACYCLIC_DIRS: &[&str] = &["src/config", "src/downstream", "src/tunnel"];

/// Where each name a `mod.rs` imports from one of its child files comes from: `pub use
/// via::{Via, ViaConfig}` maps `Via` and `ViaConfig` to `via`.
fn reexports(mod_rs: &str, children: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for statement in mod_rs.split(';') {
        let statement = statement.trim();
        let Some(at) = statement.find("use ") else {
            continue;
        };
        let before = statement[..at].trim();
        if !(before.is_empty() || before.starts_with("pub")) {
            continue;
        }
        let path = statement[at + 4..].trim();
        let path = path.strip_prefix("self::").unwrap_or(path);
        let Some((head, rest)) = path.split_once("::") else {
            continue;
        };
        if !children.contains(head) {
            continue;
        }
        for item in rest.split(['{', '}', ',']) {
            let item = item.trim();
            let name = match item.split_once(" as ") {
                Some((_, alias)) => alias.trim(),
                None => item.rsplit("::").next().unwrap_or("").trim(),
            };
            if !name.is_empty() && name != "self" && name != "*" {
                out.insert(name.to_string(), head.to_string());
            }
        }
    }
    out
}

/// The sibling files `src` (one child of a directory module, test code stripped) imports: by
/// `super::file::` or `super::{file, ..}`, or through a name `mod.rs` re-exports from `file`.
fn sibling_imports(
    src: &str,
    dir_module: &str,
    children: &BTreeSet<String>,
    reexported: &BTreeMap<String, String>,
) -> BTreeSet<String> {
    let s = src.as_bytes();
    let mut found = BTreeSet::new();
    let boundary =
        |at: usize| at == 0 || !(s[at - 1].is_ascii_alphanumeric() || s[at - 1] == b'_' || s[at - 1] == b':');
    let crate_path = format!("crate::{dir_module}::");
    for prefix in ["super::", crate_path.as_str()] {
        let mut i = 0;
        while let Some(at) = find(s, i, prefix.as_bytes()) {
            i = at + prefix.len();
            if !boundary(at) || s[i..].starts_with(b"super::") {
                continue;
            }
            for (head, _) in heads_after(s, i) {
                if children.contains(&head) {
                    found.insert(head);
                } else if let Some(file) = reexported.get(&head) {
                    found.insert(file.clone());
                }
            }
        }
    }
    found
}

/// Each circle of imports among the files of `dir` (relative to the crate root), as
/// `a.rs -> b.rs -> a.rs`.
fn file_cycles(root: &Path, dir: &str) -> Vec<String> {
    let dir_path = root.join(dir);
    let dir_module = dir.trim_start_matches("src/").replace('/', "::");
    let mut sources = BTreeMap::new();
    for entry in std::fs::read_dir(&dir_path).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "rs") {
            let stem = path.file_stem().unwrap().to_string_lossy().to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            sources.insert(stem, strip_test_items(&strip_comments_and_strings(&text)));
        }
    }
    let mod_rs = sources.remove("mod").unwrap_or_default();
    let children: BTreeSet<String> = sources.keys().cloned().collect();
    let reexported = reexports(&mod_rs, &children);
    let graph: BTreeMap<String, BTreeSet<String>> = sources
        .iter()
        .map(|(file, src)| {
            let mut deps = sibling_imports(src, &dir_module, &children, &reexported);
            deps.remove(file);
            (file.clone(), deps)
        })
        .collect();
    let mut cycles = BTreeSet::new();
    for start in graph.keys() {
        // The shortest way back to `start`, found breadth first.
        let mut came_from: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start.clone()]);
        let mut back = None;
        'search: while let Some(file) = queue.pop_front() {
            for next in &graph[&file] {
                if next == start {
                    back = Some(file.clone());
                    break 'search;
                }
                if !came_from.contains_key(next) {
                    came_from.insert(next.clone(), file.clone());
                    queue.push_back(next.clone());
                }
            }
        }
        let Some(mut file) = back else { continue };
        let mut circle = Vec::new();
        while file != *start {
            circle.push(file.clone());
            file = came_from[&file].clone();
        }
        circle.push(start.clone());
        circle.reverse();
        // Each circle once, told from its first file by name.
        let first = circle
            .iter()
            .enumerate()
            .min_by_key(|(_, f)| *f)
            .map_or(0, |(i, _)| i);
        circle.rotate_left(first);
        circle.push(circle[0].clone());
        let shown: Vec<String> = circle.iter().map(|f| format!("{dir}/{f}.rs")).collect();
        cycles.insert(shown.join(" -> "));
    }
    cycles.into_iter().collect()
}

#[test]
fn the_files_of_a_module_directory_import_each_other_in_no_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cycles: Vec<String> = ACYCLIC_DIRS
        .iter()
        .flat_map(|dir| file_cycles(root, dir))
        .collect();
    assert!(
        cycles.is_empty(),
        "{} import circle(s) among a directory's files:\n{}",
        cycles.len(),
        cycles.join("\n")
    );
}

/// The two readers above must see what they are meant to see.
#[test]
fn the_name_and_circle_readers_find_what_they_look_for() {
    let deps = dependency_crates(
        "[dependencies]\nh2 = \"0.4\"\n# a comment\nhyper-util = { version = \"0.1\" }\n\n[dev-dependencies]\nrcgen = \"1\"\n",
    );
    assert_eq!(deps, ["h2", "hyper_util"].map(String::from).into());

    let children: BTreeSet<String> = ["problems", "via", "host"].map(String::from).into();
    let mod_rs = "mod via;\npub use via::{Via, ViaConfig as Config};\npub(crate) use host::canonical_ip;\nuse std::fmt;";
    let reexported = reexports(mod_rs, &children);
    assert_eq!(reexported.get("Config").map(String::as_str), Some("via"));
    assert_eq!(reexported.get("canonical_ip").map(String::as_str), Some("host"));
    assert_eq!(reexported.get("fmt"), None);
    let src = "use super::problems::Problems;\nuse super::{Via, Scheme};\nfn f() { crate::config::host::x(); super::super::other::y(); }";
    let found = sibling_imports(src, "config", &children, &reexported);
    assert_eq!(found, ["host", "problems", "via"].map(String::from).into());
}

/// Library files under `src/` (test modules aside), their module path, and their code with
/// comments, strings and test items blanked.
fn library_code(root: &Path) -> Vec<(PathBuf, Vec<String>, String)> {
    library_text(root, false)
}

/// [`library_code`], with comments and strings kept when `keep_strings` (for a check that
/// looks for a literal).
fn library_text(root: &Path, keep_strings: bool) -> Vec<(PathBuf, Vec<String>, String)> {
    library_files(&root.join("src"))
        .into_iter()
        .map(|(file, module)| {
            let text = std::fs::read_to_string(&file).unwrap();
            let code = if keep_strings {
                strip_test_items(&text)
            } else {
                strip_test_items(&strip_comments_and_strings(&text))
            };
            (file.strip_prefix(root).unwrap().to_path_buf(), module, code)
        })
        .collect()
}

/// The lines where `word` occurs in `code` as whole identifiers.
fn lines_of(code: &str, word: &str) -> Vec<usize> {
    let s = code.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut lines = Vec::new();
    let mut i = 0;
    while let Some(at) = find(s, i, word.as_bytes()) {
        let end = at + word.len();
        if (at == 0 || !is_ident(s[at - 1])) && s.get(end).is_none_or(|&c| !is_ident(c)) {
            lines.push(s[..at].iter().filter(|&&c| c == b'\n').count() + 1);
        }
        i = end;
    }
    lines
}

/// Whether a tunnel's upstream may park is the byte stream's to say (`connector::Io`), not a
/// downcast: nothing downcasts outside `tunnel/` (which takes our own stream back from what
/// hyper made of a switched connection) and `caught` (a panic's payload, which only a downcast
/// reads).
#[test]
fn nothing_downcasts_outside_the_tunnel_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let allowed = |module: &[String]| matches!(module.first().map(String::as_str), Some("tunnel" | "caught"));
    let mut found = Vec::new();
    for (file, module, code) in library_code(root) {
        if allowed(&module) {
            continue;
        }
        for word in ["downcast", "downcast_ref", "downcast_mut", "Any"] {
            for line in lines_of(&code, word) {
                found.push(format!("{}:{line}: `{word}` outside src/tunnel/", file.display()));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// A tunnel's life after its `200` or `101` is the tunnel module's: the pair, its splice, its
/// dormant record and what it asks of its keeper are defined there and nowhere else, and
/// "tunnel" names that pair only (a CONNECT served as HTTP is `routing::Inspected`).
#[test]
fn the_tunnel_types_live_in_the_tunnel_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let owned = [
        "Tunnel",
        "Tunneled",
        "Dormant",
        "Keeper",
        "SpliceEnd",
        "Spliced",
        "splice",
    ];
    let mut found = Vec::new();
    for (file, module, code) in library_code(root) {
        if module.first().map(String::as_str) == Some("tunnel") {
            continue;
        }
        for name in owned {
            for kind in ["struct", "enum", "trait", "type", "fn", "mod"] {
                let definition = format!("{kind} {name}");
                for line in lines_of(&code, &definition) {
                    found.push(format!(
                        "{}:{line}: `{definition}` outside src/tunnel/",
                        file.display()
                    ));
                }
            }
        }
        for line in lines_of(&code, "copy_bidirectional") {
            found.push(format!("{}:{line}: a splice outside src/tunnel/", file.display()));
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}
