//! The `unsafe` the sidecar has, and only that: every `unsafe` block in `src/` outside
//! `#[cfg(test)]` items (test modules, test-only helpers; code after them is audited too) is listed here (and in the `[lints.rust]` comment of Cargo.toml) and opens under a
//! `// SAFETY:` comment saying why it is sound. A new block fails this test until it is argued
//! for and listed.

use std::path::Path;

/// Production `unsafe` blocks per file.
const AUDITED: &[(&str, usize)] = &[
    ("src/downstream/park.rs", 1),
    ("src/downstream/stream.rs", 1),
    ("src/resident.rs", 3),
    ("src/wire/codec.rs", 1),
    ("src/wire/scan.rs", 1),
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

/// The attribute that makes an item test-only: the item it stands on (a test module, a helper
/// `fn`, an `impl`) is not audited; everything around it is, before and after.
const TEST_ONLY: &str = "#[cfg(test)]";

/// Per line of `text`, whether it belongs to a `#[cfg(test)]` item (from the attribute's line
/// to the line of the item's closing brace, or its `;` for `mod tests;`).
fn test_only_lines(text: &str) -> Vec<bool> {
    let mut marked = vec![false; text.lines().count()];
    let mut cursor = 0;
    while let Some(start) = next_test_attribute(text, cursor) {
        let end = item_end(text, start + TEST_ONLY.len());
        let first = text[..start].matches('\n').count();
        let last = text[..end].matches('\n').count();
        for line in marked.iter_mut().take(last + 1).skip(first) {
            *line = true;
        }
        cursor = end;
    }
    marked
}

/// Where the next `#[cfg(test)]` opening a line (after indentation) starts, from `from` on.
fn next_test_attribute(text: &str, from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(found) = text[at..].find(TEST_ONLY) {
        let start = at + found;
        let line_start = text[..start].rfind('\n').map_or(0, |n| n + 1);
        if text[line_start..start].trim().is_empty() {
            return Some(start);
        }
        at = start + TEST_ONLY.len();
    }
    None
}

/// Where the item starting at `from` ends: just past its `;` (met before any brace) or the
/// brace closing its first one. Braces in comments, strings and char literals do not count.
fn item_end(text: &str, from: usize) -> usize {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut i = from;
    while i < bytes.len() {
        i = match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => text[i..].find('\n').map_or(bytes.len(), |n| i + n),
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                text[i + 2..].find("*/").map_or(bytes.len(), |n| i + n + 4)
            }
            b'"' => string_end(bytes, i + 1, 0),
            b'r' if raw_string_start(text, i).is_some() => {
                let (quote, hashes) = raw_string_start(text, i).unwrap();
                string_end(bytes, quote + 1, hashes)
            }
            b'\'' => char_literal_end(text, i),
            b'{' => {
                depth += 1;
                i + 1
            }
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
                i + 1
            }
            b';' if depth == 0 => return i + 1,
            _ => i + 1,
        };
    }
    bytes.len()
}

/// Just past the `"` (and `hashes` `#`) closing a string whose text starts at `i`; escapes
/// count only in a plain string (`hashes` 0 is also how a raw `r"..."` ends, escapes aside).
fn string_end(bytes: &[u8], mut i: usize, hashes: usize) -> usize {
    let closing: Vec<u8> = std::iter::once(b'"')
        .chain(std::iter::repeat_n(b'#', hashes))
        .collect();
    while i < bytes.len() {
        if hashes == 0 && bytes[i] == b'\\' {
            i += 2;
        } else if bytes[i..].starts_with(&closing) {
            return i + closing.len();
        } else {
            i += 1;
        }
    }
    bytes.len()
}

/// For an `r` at `i` opening a raw string (`r"`, `r#"`, `br"`): its opening quote and its
/// number of `#`; `None` for an `r` inside an identifier.
fn raw_string_start(text: &str, i: usize) -> Option<(usize, usize)> {
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let before = text.as_bytes()[..i].iter().rev();
    let mut before = before.copied();
    match before.next() {
        Some(b'b') if before.next().is_some_and(ident) => return None,
        Some(b) if b != b'b' && ident(b) => return None,
        _ => {}
    }
    let hashes = text[i + 1..].bytes().take_while(|&b| b == b'#').count();
    (text.as_bytes().get(i + 1 + hashes) == Some(&b'"')).then_some((i + 1 + hashes, hashes))
}

/// Just past a char literal opening at `i` (`'{'`, `'\''`), or just past the `'` of a lifetime.
fn char_literal_end(text: &str, i: usize) -> usize {
    let rest = &text[i + 1..];
    if rest.starts_with('\\') {
        return rest[2..].find('\'').map_or(text.len(), |n| i + 1 + 2 + n + 1);
    }
    match rest.chars().next() {
        Some(c) if rest[c.len_utf8()..].starts_with('\'') => i + 1 + c.len_utf8() + 1,
        _ => i + 1,
    }
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
        let lines: Vec<&str> = text.lines().collect();
        let test_only = test_only_lines(&text);
        let name = file.strip_prefix(root).unwrap().display().to_string();
        let mut count = 0;
        for (i, line) in lines.iter().enumerate().filter(|&(i, _)| !test_only[i]) {
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

/// A test item ends at its closing brace, whatever braces its strings, chars, raw strings and
/// comments hold, and what follows it is audited again: an `unsafe` block placed after a test
/// module once went unseen.
#[test]
fn code_after_a_test_item_is_audited() {
    let text = "fn a() {}\n\
                #[cfg(test)]\n\
                mod tests {\n\
                \x20   const S: &str = \"}\\\"}\";\n\
                \x20   const C: char = '}';\n\
                \x20   // }\n\
                \x20   fn f<'a>(x: &'a str) -> &'a str { x }\n\
                \x20   const R: &str = r#\"}\"#;\n\
                }\n\
                fn b() { unsafe {} }\n\
                \x20   #[cfg(test)]\n\
                \x20   mod more;\n\
                fn c() {}\n";
    let audited: Vec<usize> = test_only_lines(text)
        .iter()
        .enumerate()
        .filter(|&(_, &test)| !test)
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(audited, [1, 10, 13], "the lines audited in:\n{text}");
}
