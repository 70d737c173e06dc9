//! The library's modules form a tree with `ffi` on top: no module below
//! `ffi` names it, the dependency graph between top-level modules has no
//! cycle, no library source pulls in CLI code, and the files of the
//! weights pool (src/cuda/pool) name each other one way. Checked on the source
//! text (`scripts/module_graph.py` prints the same graph).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The library's .rs files (not src/bin/, which holds separate crates).
fn library_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path != src().join("bin") {
                library_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text without `//` comments (doc comments included).
fn code(text: &str) -> String {
    text.lines().map(|l| l.find("//").filter(|&i| !l[..i].contains('"')).map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
}

/// The module path of a file: src/shm/map.rs -> [shm, map].
fn module_of(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src()).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The first names of the paths in a `{a, b::c, d::{e}}` group (text after '{').
fn group_heads(text: &str) -> Vec<String> {
    let (mut heads, mut depth, mut current) = (Vec::new(), 0, String::new());
    for ch in text.chars() {
        match ch {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                heads.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        if depth == 0 {
            current.push(ch);
        }
    }
    heads.push(current);
    heads.iter().map(|h| h.split("::").next().unwrap().trim().to_string()).filter(|h| !h.is_empty()).collect()
}

/// The top-level modules that `text` (the code of a file in module `here`) names.
fn referenced(here: &[String], text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    for head in ["crate::", "super::"] {
        for (at, _) in text.match_indices(head) {
            if text[..at].chars().next_back().is_some_and(is_word) {
                continue;
            }
            let mut rest = &text[at + head.len()..];
            let mut levels = usize::from(head == "super::");
            while let Some(r) = rest.strip_prefix("super::") {
                levels += 1;
                rest = r;
            }
            let base = &here[..here.len().saturating_sub(levels)];
            if head == "super::" && !base.is_empty() {
                found.insert(base[0].clone());
            } else if let Some(group) = rest.strip_prefix('{') {
                found.extend(group_heads(group));
            } else {
                found.insert(rest.chars().take_while(|&c| is_word(c)).collect());
            }
        }
    }
    found
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in code(&lib).lines() {
        if let Some(name) =
            line.trim().strip_prefix("pub mod ").or_else(|| line.trim().strip_prefix("mod ")).and_then(|r| r.strip_suffix(';'))
        {
            edges.insert(name.trim().to_string(), BTreeSet::new());
        }
    }
    let mut files = Vec::new();
    library_files(&src(), &mut files);
    for file in files {
        let here = module_of(&file);
        let Some(top) = here.first().filter(|t| edges.contains_key(*t)).cloned() else { continue };
        let text = code(&std::fs::read_to_string(&file).unwrap());
        for target in referenced(&here, &text) {
            if target != top && edges.contains_key(&target) {
                edges.get_mut(&top).unwrap().insert(target);
            }
        }
    }
    edges
}

/// A path of modules that leads from `from` back to itself, if any.
fn cycle_through(edges: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    let mut stack = vec![(from.to_string(), vec![from.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((node, path)) = stack.pop() {
        for next in &edges[&node] {
            if next == from {
                return Some([path.clone(), vec![next.clone()]].concat());
            }
            if seen.insert(next.clone()) {
                stack.push((next.clone(), [path.clone(), vec![next.clone()]].concat()));
            }
        }
    }
    None
}

#[test]
fn module_graph_has_no_cycle() {
    let edges = graph();
    assert!(edges.len() >= 10 && edges["ffi"].len() >= 5, "the scan is broken: {edges:?}");
    for module in edges.keys() {
        if let Some(path) = cycle_through(&edges, module) {
            panic!("module cycle: {}", path.join(" -> "));
        }
    }
}

#[test]
fn nothing_below_ffi_names_ffi() {
    let edges = graph();
    let upward: Vec<_> = edges.iter().filter(|(m, to)| *m != "ffi" && to.contains("ffi")).map(|(m, _)| m.as_str()).collect();
    assert!(upward.is_empty(), "modules that name ffi: {upward:?}");
}

#[test]
fn library_sources_use_no_cli_crate() {
    let mut files = Vec::new();
    library_files(&src(), &mut files);
    for file in files {
        let text = code(&std::fs::read_to_string(&file).unwrap());
        assert!(!text.contains("indicatif"), "{}: the progress-bar crate belongs to the ssctl binary", file.display());
    }
}

/// The sibling files a file of one folder names through `super::` (its
/// folder's mod.rs re-exports aside): `super::a::x`, `super::{a, b}`.
fn sibling_edges(folder: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut edges = BTreeMap::new();
    for entry in std::fs::read_dir(folder).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.extension().is_some_and(|e| e == "rs") && stem != "mod" && stem != "tests" {
            edges.insert(stem, BTreeSet::new());
        }
    }
    let files: Vec<String> = edges.keys().cloned().collect();
    for file in files {
        let text = code(&std::fs::read_to_string(folder.join(format!("{file}.rs"))).unwrap());
        // Unit tests inside a file may reach anything.
        let text = text.split("#[cfg(test)]").next().unwrap();
        let mut named = BTreeSet::new();
        for (at, _) in text.match_indices("super::") {
            let rest = &text[at + "super::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                named.extend(group_heads(group));
            } else {
                named.insert(rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>());
            }
        }
        let targets: BTreeSet<String> = named.into_iter().filter(|n| *n != file && edges.contains_key(n)).collect();
        edges.insert(file, targets);
    }
    edges
}

#[test]
fn the_weights_pool_files_depend_one_way() {
    let edges = sibling_edges(&src().join("cuda").join("pool"));
    assert!(edges.len() >= 10 && edges["producer"].contains("server"), "the scan is broken: {edges:?}");
    for file in edges.keys() {
        if let Some(path) = cycle_through(&edges, file) {
            panic!("file cycle in src/cuda/pool: {}", path.join(" -> "));
        }
    }
}
