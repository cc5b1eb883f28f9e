//! The committed fuzz corpus (`tests/fuzz_corpus/<target>/`), replayed through the same targets
//! cargo-fuzz runs (`egress_sidecar::fuzzing`), on stable: every input that once found a bug,
//! and every seed, stays a regression test without a nightly toolchain.

use std::path::Path;

#[test]
fn every_corpus_input_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus");
    for (name, target) in egress_sidecar::fuzzing::TARGETS {
        let dir = root.join(name);
        let inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .collect();
        assert!(!inputs.is_empty(), "{name}: empty corpus");
        for input in inputs {
            let data = std::fs::read(&input).unwrap();
            let outcome = std::panic::catch_unwind(|| target(&data));
            assert!(outcome.is_ok(), "{name}: {} fails", input.display());
        }
    }
}
