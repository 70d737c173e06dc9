//! The committed header is exactly what build.rs generates, and its version
//! macros match Cargo.toml.

use std::path::Path;
use std::process::Command;

const GENERATED: &str = include_str!(concat!(env!("OUT_DIR"), "/storage_sharing.h"));

#[test]
fn committed_header_matches_generated() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let git = Command::new("git").arg("-C").arg(root).args(["show", "HEAD:include/storage_sharing.h"]).output();
    let committed = match git {
        Ok(out) if out.status.success() => String::from_utf8(out.stdout).unwrap(),
        _ => {
            // Not a git checkout (a source tarball): compare with the file.
            println!("no git history: comparing with include/ on disk");
            std::fs::read_to_string(root.join("include/storage_sharing.h")).unwrap()
        }
    };
    assert!(committed == GENERATED, "include/storage_sharing.h in HEAD differs from what the code generates: build, then commit include/");
}

#[test]
fn version_macros_match_cargo() {
    let v = env!("CARGO_PKG_VERSION");
    assert!(GENERATED.contains(&format!("#define SS_VERSION_STRING \"{v}\"")));
    assert!(GENERATED.contains(&format!("#define SS_VERSION_MAJOR {}", env!("CARGO_PKG_VERSION_MAJOR"))));
    assert!(GENERATED.contains(&format!("#define SS_VERSION_MINOR {}", env!("CARGO_PKG_VERSION_MINOR"))));
    assert!(GENERATED.contains(&format!("#define SS_VERSION_PATCH {}", env!("CARGO_PKG_VERSION_PATCH"))));
    assert!(GENERATED.contains("extern \"C\" {"), "C++ guard missing");
}
