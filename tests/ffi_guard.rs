//! Every exported C function runs its body through `ffi_status!` or
//! `ffi_value!` (named after itself), so no panic can cross the boundary.
//! Checked on the source text, so a new export without the guard fails here.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// (name, text after the opening brace of the body) for each `extern "C" fn`.
fn exports(src: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = src;
    while let Some(at) = rest.find("extern \"C\" fn ") {
        let after = &rest[at + "extern \"C\" fn ".len()..];
        let name: String = after.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let body_start = after.find('{').expect("function body");
        found.push((name, after[body_start + 1..].trim_start().to_string()));
        rest = &after[body_start..];
    }
    found
}

#[test]
fn every_export_is_guarded() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut count = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let in_ffi = file.starts_with(root.join("ffi"));
        for (name, body) in exports(&text) {
            assert!(in_ffi, "{}: extern \"C\" fn {name} outside src/ffi", file.display());
            let guarded = body.starts_with(&format!("ffi_status!(\"{name}\",")) || body.starts_with(&format!("ffi_value!(\"{name}\","));
            assert!(guarded, "{}: {name} does not start with ffi_status!/ffi_value!(\"{name}\", ...)", file.display());
            assert!(
                text.contains(&format!("#[no_mangle]\npub unsafe extern \"C\" fn {name}("))
                    || text.contains(&format!("#[no_mangle]\npub extern \"C\" fn {name}(")),
                "{}: {name} must be `#[no_mangle] pub` directly above",
                file.display()
            );
            count += 1;
        }
    }
    assert!(count >= 20, "found only {count} exports: the scan is broken");
}

#[test]
fn header_declares_every_export() {
    let header = include_str!(concat!(env!("OUT_DIR"), "/storage_sharing.h"));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ffi");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    for file in files {
        for (name, _) in exports(&std::fs::read_to_string(&file).unwrap()) {
            assert!(header.contains(&format!(" {name}(")) || header.contains(&format!("*{name}(")), "{name} missing from the header");
        }
    }
}
