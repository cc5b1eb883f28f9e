//! The mark of a branch the request path rarely takes, for builds without a profile.
//!
//! A call to a `#[cold]` function tells LLVM that the branch making it is unlikely, and LLVM
//! lays that branch's code out after the function's common path instead of between its
//! instructions: what a profile-guided build learns from its profile (benches/RESULTS.md,
//! "(issue 47, 2026-12-05, sixteenth session)"). `std::hint::cold_path` says the same from
//! Rust 1.95; this crate builds with 1.90 (`rust-version`).

/// Marks the branch that calls it as rare. Never inlined, so the call and its mark last
/// through optimisation; `black_box` keeps the call from being deleted as doing nothing. It
/// costs a call on the rare path only.
#[cold]
#[inline(never)]
pub fn branch() {
    std::hint::black_box(());
}
