//! Link settings of the shipped binary.

fn main() {
    // RELR: relative relocations packed into a bitmap (glibc 2.36+, binutils 2.38+; Debian 12,
    // which the Dockerfile builds and runs on). The loader reads 3 KB of them at start instead
    // of 270 KB of RELA entries; measured 0.35-0.5 MiB less RSS. Only the binaries: tests and
    // dependencies link as before.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu")
    {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
