//! Generates include/storage_sharing.h with the pinned cbindgen and gives
//! the shared library a versioned SONAME.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap();
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").unwrap();
    let patch = std::env::var("CARGO_PKG_VERSION_PATCH").unwrap();

    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libstorage_sharing.so.{major}");
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");

    let mut config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    // cbindgen.toml's own after_includes (the deprecation and initializer
    // macros) follow the version macros.
    let macros = config.after_includes.take().unwrap_or_default();
    config.after_includes = Some(format!(
        "\n#define SS_VERSION_MAJOR {major}\n#define SS_VERSION_MINOR {minor}\n#define SS_VERSION_PATCH {patch}\n#define SS_VERSION_STRING \"{major}.{minor}.{patch}\"\n{macros}"
    ));
    let header = cbindgen::Builder::new()
        // Only the C boundary goes into the header.
        .with_src(dir.join("src/ffi/mod.rs"))
        .with_config(config)
        .with_language(cbindgen::Language::C)
        .generate()
        .expect("cbindgen could not generate the header");
    let mut text = Vec::new();
    header.write(&mut text);
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("storage_sharing.h");
    std::fs::write(&out, &text).unwrap();
    // Keep the committed copy current; rewrite it only when it changed so
    // its timestamp does not trigger needless C rebuilds.
    let committed = dir.join("include/storage_sharing.h");
    if std::fs::read(&committed).ok().as_deref() != Some(&text[..]) {
        std::fs::write(&committed, &text).unwrap();
    }
}
