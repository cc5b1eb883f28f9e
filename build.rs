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
    // The functions the request path runs, first in the text and together (the list and why:
    // link/README.md). Release builds only; a symbol the list names and the build lacks is
    // skipped. `--symbol-ordering-file` is LLD's (and mold's), which rustc links x86_64 Linux
    // with since 1.90.
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let order = std::path::Path::new(&dir).join("link/request-path.symbols");
    if std::env::var("PROFILE").as_deref() == Ok("release")
        && std::env::var("TARGET").as_deref() == Ok("x86_64-unknown-linux-gnu")
        && std::env::var_os("RUSTC_LINKER").is_none()
        && order.exists()
    {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=link/request-path.symbols");
}
