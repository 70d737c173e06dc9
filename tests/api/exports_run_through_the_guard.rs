//! Every exported C function (`#[no_mangle]`) lives in `src/ffi/` and runs
//! its body through `ffi_status!` or `ffi_value!` (named after itself), so
//! no panic can cross the boundary. The core may own plain `extern "C"`
//! callbacks that it registers with atexit/pthread_atfork; those are not
//! exported and catch panics themselves. Checked on the source text, so a
//! new export without the guard fails here.

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

/// A function defined as `extern "C" fn`.
struct CFn {
    name: String,
    /// The text after the opening brace of its body.
    body: String,
    /// Whether `#[no_mangle]` is on the line above: the symbol is exported.
    exported: bool,
}

fn c_functions(src: &str) -> Vec<CFn> {
    let mut found = Vec::new();
    let mut offset = 0;
    while let Some(at) = src[offset..].find("extern \"C\" fn ") {
        let at = offset + at;
        let line_start = src[..at].rfind('\n').map_or(0, |i| i + 1);
        let line_above = src[..line_start.saturating_sub(1)].rsplit('\n').next().unwrap_or("");
        let after = &src[at + "extern \"C\" fn ".len()..];
        let name: String = after.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let body_start = after.find('{').expect("function body");
        found.push(CFn { name, body: after[body_start + 1..].trim_start().to_string(), exported: line_above.trim() == "#[no_mangle]" });
        offset = src.len() - after.len() + body_start;
    }
    found
}

/// The exported C functions of a file.
fn exports(src: &str) -> Vec<(String, String)> {
    c_functions(src).into_iter().filter(|f| f.exported).map(|f| (f.name, f.body)).collect()
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
        assert!(in_ffi || !text.contains("#[no_mangle]"), "{}: #[no_mangle] outside src/ffi", file.display());
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
fn process_hooks_are_private_and_catch_panics() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut hooks = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for f in c_functions(&text).into_iter().filter(|f| !f.exported) {
            let name = &f.name;
            assert!(!text.contains(&format!("pub extern \"C\" fn {name}(")), "{}: {name} is pub but not exported", file.display());
            assert!(f.body.starts_with("let _ = std::panic::catch_unwind("), "{}: {name} must catch panics", file.display());
            hooks.push(name.clone());
        }
    }
    // The core registers its own process hooks (atexit, pthread_atfork).
    for expected in ["teardown_at_exit", "finalize_at_exit", "prepare_hook", "parent_hook", "child_hook"] {
        assert!(hooks.iter().any(|h| h == expected), "hook {expected} not found: the scan is broken");
    }
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
