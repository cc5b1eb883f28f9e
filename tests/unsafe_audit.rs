//! The `unsafe` the sidecar has, and only that: every `unsafe` block in `src/` outside test
//! modules is listed here (and in the `[lints.rust]` comment of Cargo.toml) and opens under a
//! `// SAFETY:` comment saying why it is sound. A new block fails this test until it is argued
//! for and listed.

use std::path::Path;

/// Production `unsafe` blocks per file.
const AUDITED: &[(&str, usize)] = &[
    ("src/downstream/park.rs", 1),
    ("src/downstream/stream.rs", 1),
    ("src/resident.rs", 2),
    ("src/wire/codec.rs", 1),
];

/// How far above an `unsafe` block its `SAFETY:` comment may start (it may run several lines,
/// then an `#[allow]` and the `let`).
const SAFETY_WITHIN_LINES: usize = 12;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The lines of a file before its test module (`#[cfg(test)]` at the start of a line).
fn production_lines(text: &str) -> Vec<&str> {
    text.lines()
        .take_while(|l| !l.starts_with("#[cfg(test)]"))
        .collect()
}

#[test]
fn every_unsafe_block_is_listed_and_argued_for() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files.sort();
    let mut found = Vec::new();
    let mut unargued = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines = production_lines(&text);
        let name = file.strip_prefix(root).unwrap().display().to_string();
        let mut count = 0;
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if !code.contains("unsafe {") && !code.contains("unsafe fn") && !code.contains("unsafe impl") {
                continue;
            }
            count += 1;
            let argued = lines[i.saturating_sub(SAFETY_WITHIN_LINES)..i]
                .iter()
                .any(|l| l.trim_start().starts_with("// SAFETY:"));
            if !argued {
                unargued.push(format!("{name}:{}: {}", i + 1, line.trim()));
            }
        }
        if count > 0 {
            found.push((name, count));
        }
    }
    let expected: Vec<(String, usize)> = AUDITED.iter().map(|&(f, n)| (f.to_owned(), n)).collect();
    assert_eq!(
        found, expected,
        "production unsafe blocks per file changed: argue for each with a SAFETY comment, then \
         update AUDITED here and the [lints.rust] comment in Cargo.toml"
    );
    assert!(
        unargued.is_empty(),
        "unsafe without a SAFETY comment above it: {unargued:#?}"
    );
}
