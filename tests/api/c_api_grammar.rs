//! Every function of include/storage_sharing.h follows the grammar of
//! docs/c-api.md: `ss_<object>_<verb>`, one release verb (`_free`) per
//! handle, borrowed handles returned `const`. Renamed functions keep their
//! old names as deprecated aliases, listed below, marked so compilers warn,
//! and still working.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Objects, longest first where one is a prefix of another (the parser
/// takes the longest that matches).
const OBJECTS: &[&str] = &[
    "arena_remote_cache",
    "arena_options",
    "arena_stats",
    "arena_view",
    "arena",
    "atfork",
    "content_reader",
    "content_storage",
    "content_tensor",
    "content_writer",
    "content_list",
    "content",
    "cuda_pool_handle",
    "cuda_ipc_counter",
    "cuda_ipc_handle",
    "cuda_received",
    "cuda_pointer",
    "cuda_driver",
    "cuda_limbo",
    "cuda_pool",
    "cuda_weights",
    "cuda_sent",
    "cuda_ipc",
    "cuda",
    "fds",
    "last_error",
    "log",
    "map",
    "shm_manager",
    "shm_name",
    "status",
    "storage_shared",
    "storage",
    "store_torch_file",
    "store_callbacks",
    "store_file",
    "store_tcp",
    "store",
    "symm_mem",
    "symm",
    "weak",
];

/// Verbs (what the call does) and accessors (what it reads), as the first
/// word(s) after the object; docs/c-api.md explains each.
const VERBS: &[&str] = &[
    // create, release
    "open",
    "new",
    "free",
    "close",
    "ref",
    "weak_ref",
    "lookup",
    "default", //
    // memory
    "alloc",
    "dealloc",
    "resize", //
    // reference counts of shared segments
    "incref",
    "decref",
    "release",
    "collect",
    "trim",
    "teardown",
    "finalize", //
    // data transfer
    "share",
    "unshare",
    "import",
    "send",
    "recv",
    "read",
    "write",
    "list",
    "verify",
    "hash",
    "to_text",
    "from_text",
    // store operations
    "set",
    "get",
    "add",
    "wait",
    "check",
    "compare_set",
    "delete",
    "put",
    "barrier",
    "rendezvous",
    "upgrade",
    "spawn",
    // pthread_atfork stages
    "prepare",
    "parent",
    "child",
    // GPU weights pool
    "export",
    "begin",
    "publish",
    "acquire",
    "find",
];

const ACCESSORS: &[&str] = &[
    "data",
    "size",
    "nbytes",
    "fd",
    "filename",
    "flags",
    "is",
    "has",
    "refcount",
    "segment",
    "counts",
    "format",
    "dtype",
    "ndim",
    "shape",
    "stride",
    "offset",
    "conj",
    "neg",
    "storage",
    "len",
    "counter",
    "available",
    "info",
    "base",
    "message",
    "str",
    "port",
    "num",
    "rank",
    "world",
    "buffer",
    "signal",
    "multicast",
    "expired",
    "count",
    "tensor",
    "device",
];

/// Old name → new name: the deprecated aliases, kept for one release.
const ALIASES: &[(&str, &str)] = &[
    ("ss_arena_free", "ss_arena_dealloc"),
    ("ss_arena_open_remote", "ss_arena_view_open"),
    ("ss_arena_trim_remote_cache", "ss_arena_remote_cache_trim"),
    ("ss_content_write_storage", "ss_content_writer_write_storage"),
    ("ss_content_write_tensor", "ss_content_writer_write_tensor"),
    ("ss_content_read_tensor", "ss_content_reader_read_tensor"),
    ("ss_content_read_storage", "ss_content_reader_read_storage"),
    ("ss_content_list_tensors", "ss_content_reader_list_tensors"),
    ("ss_content_list_storages", "ss_content_reader_list_storages"),
    ("ss_content_verify", "ss_content_reader_verify"),
    ("ss_hash_bytes", "ss_content_hash_bytes"),
    ("ss_cuda_open", "ss_cuda_received_open"),
    ("ss_cuda_release_ipc_counter", "ss_cuda_ipc_counter_release"),
    ("ss_cuda_malloc", "ss_cuda_alloc"),
    ("ss_send_fds", "ss_fds_send"),
    ("ss_recv_fds", "ss_fds_recv"),
    ("ss_refcounted_map_open", "ss_map_open_refcounted"),
    ("ss_map_from_data", "ss_map_lookup"),
    ("ss_new_process_wide_shm_handle", "ss_shm_name_new"),
    ("ss_new_shm_fd_storage", "ss_map_new_shm_fd"),
    ("ss_share_memory", "ss_map_new_copy"),
    ("ss_store_from_callbacks", "ss_store_callbacks_open"),
    ("ss_symm_rendezvous", "ss_symm_mem_rendezvous"),
];

/// Names outside the grammar, each with the reason docs/c-api.md gives.
const EXCEPTIONS: &[(&str, &str)] = &[
    ("ss_version", "the library's own version: no object"),
    ("ss_arena_close", "releases an ss_arena until the deprecated ss_arena_free (a block) goes; then it is ss_arena_free"),
];

/// One prototype of the header.
#[derive(Debug)]
struct Function {
    ret: String,
    params: Vec<String>,
    deprecated: Option<String>,
}

fn header() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/storage_sharing.h")).unwrap()
}

fn strip_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("/*") {
        out.push_str(&rest[..at]);
        rest = rest[at..].find("*/").map_or("", |e| &rest[at + e + 2..]);
    }
    out.push_str(rest);
    out.lines().filter(|l| !l.trim_start().starts_with('#') && !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The header's function declarations (not typedefs), by name.
fn functions(text: &str) -> BTreeMap<String, Function> {
    let code = strip_comments(text).replace("extern \"C\" {", "");
    let mut out = BTreeMap::new();
    for stmt in code.split(';') {
        let mut stmt = stmt.trim().trim_start_matches('}').trim();
        if stmt.starts_with("typedef") || !stmt.contains('(') {
            continue;
        }
        let mut deprecated = None;
        if let Some(rest) = stmt.strip_prefix("SS_DEPRECATED(") {
            let end = rest.find(')').expect("SS_DEPRECATED(...)");
            deprecated = Some(rest[..end].trim_matches('"').to_string());
            stmt = rest[end + 1..].trim();
        }
        let open = stmt.find('(').unwrap();
        let head = stmt[..open].trim_end();
        let cut = head.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
        let params = stmt[open + 1..stmt.rfind(')').unwrap()]
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| p != "void")
            .collect();
        out.insert(head[cut..].to_string(), Function { ret: head[..cut].trim().to_string(), params, deprecated });
    }
    out
}

/// The opaque handle types (`typedef struct ss_x ss_x;`).
fn handle_types(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("typedef struct ")?.strip_suffix(';'))
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>().as_slice() {
            [tag, alias] if tag == alias => Some(alias.to_string()),
            _ => None,
        })
        .collect()
}

/// Why `name` breaks the grammar, or None.
fn grammar_problem(name: &str) -> Option<String> {
    let Some(rest) = name.strip_prefix("ss_") else { return Some("no ss_ prefix".into()) };
    let Some(object) = OBJECTS.iter().find(|o| rest.strip_prefix(**o).is_some_and(|r| r.starts_with('_'))) else {
        return Some(format!("no known object starts {rest:?}"));
    };
    let tail = &rest[object.len() + 1..];
    let word_is = |w: &&str| tail == *w || tail.strip_prefix(*w).is_some_and(|r| r.starts_with('_'));
    if VERBS.iter().any(word_is) || ACCESSORS.iter().any(word_is) {
        None
    } else {
        Some(format!("object {object}: {tail:?} does not start with a known verb or accessor"))
    }
}

#[test]
fn every_export_follows_the_grammar() {
    let text = header();
    let fns = functions(&text);
    assert!(fns.len() > 150 && fns.contains_key("ss_map_open"), "header parser found {} functions", fns.len());
    let aliases: BTreeMap<&str, &str> = ALIASES.iter().copied().collect();
    let exceptions: BTreeMap<&str, &str> = EXCEPTIONS.iter().copied().collect();
    let mut problems = Vec::new();
    for (name, f) in &fns {
        if f.deprecated.is_some() || exceptions.contains_key(name.as_str()) {
            continue;
        }
        if let Some(p) = grammar_problem(name) {
            problems.push(format!("{name}: {p}"));
        }
        if aliases.contains_key(name.as_str()) {
            problems.push(format!("{name}: listed as a deprecated alias but not marked SS_DEPRECATED"));
        }
    }
    assert!(problems.is_empty(), "names that break docs/c-api.md's grammar:\n{}", problems.join("\n"));
    for name in exceptions.keys() {
        assert!(fns.contains_key(*name), "exception {name} is not in the header any more: drop it from the table");
    }
}

#[test]
fn every_deprecated_alias_is_listed_marked_and_has_its_replacement() {
    let fns = functions(&header());
    let aliases: BTreeMap<&str, &str> = ALIASES.iter().copied().collect();
    let marked: BTreeSet<&str> = fns.iter().filter(|(_, f)| f.deprecated.is_some()).map(|(n, _)| n.as_str()).collect();
    assert_eq!(marked, aliases.keys().copied().collect::<BTreeSet<_>>(), "SS_DEPRECATED functions vs the alias table");
    for (old, new) in ALIASES {
        let alias = &fns[*old];
        let target = fns.get(*new).unwrap_or_else(|| panic!("{old}: its replacement {new} is not declared"));
        assert!(target.deprecated.is_none(), "{old}: its replacement {new} is deprecated too");
        assert!(alias.deprecated.as_deref().unwrap().contains(new), "{old}: the deprecation note must name {new}");
        assert_eq!(alias.params.len(), target.params.len(), "{old} and {new} take different parameters");
        assert!(grammar_problem(new).is_none(), "{new}: {}", grammar_problem(new).unwrap());
    }
}

/// `_free` is the release verb of every handle type; `close` is only
/// `ss_map_close` (unmapping before the free) and `ss_arena_close` (see
/// EXCEPTIONS); no other release words.
#[test]
fn handles_are_released_by_free_and_borrowed_ones_are_const() {
    let text = header();
    let fns = functions(&text);
    let handles = handle_types(&text);
    assert!(handles.len() >= 14 && handles.contains(&"ss_map".to_string()), "handle types: {handles:?}");
    for h in &handles {
        if h == "ss_symm_mem" {
            // Only ever borrowed: its block owns it (`ss_symm_free`).
            assert!(!fns.contains_key("ss_symm_mem_free"));
            continue;
        }
        let release = if h == "ss_arena" { "ss_arena_close".to_string() } else { format!("{h}_free") };
        let f = fns.get(&release).unwrap_or_else(|| panic!("{h} has no {release}"));
        assert!(f.params[1..].iter().all(|p| p.contains("*out")), "{release} takes the handle (and out-parameters)");
        assert!(f.params[0].starts_with(&format!("{h} *")), "{release} takes a non-const {h}*, not {:?}", f.params[0]);
    }
    for (name, f) in &fns {
        for word in ["_destroy", "_delete", "_dispose"] {
            assert!(!name.ends_with(word), "{name}: handles are released with _free");
        }
        if name.ends_with("_close") {
            assert!(["ss_map_close", "ss_arena_close"].contains(&name.as_str()), "{name}: handles are released with _free");
        }
        // A function that returns a handle (rather than writing a new one
        // to `out`) lends it: the result is const unless deprecated.
        let returns_handle = handles.iter().any(|h| f.ret.starts_with(h.as_str()) && f.ret.ends_with('*'));
        if returns_handle && f.deprecated.is_none() {
            assert!(f.ret.starts_with("const "), "{name} returns a borrowed handle as non-const {}", f.ret);
        }
    }
    assert_eq!(fns["ss_map_lookup"].ret, "const ss_map *");
    assert_eq!(fns["ss_symm_mem_rendezvous"].params[3], "const ss_symm_mem **out");
}

/// `open`/`new` make the object they are named after: a constructor that
/// writes a handle to `out` is `ss_<its type>[_<kind>]_open|new...`.
#[test]
fn constructors_are_named_after_what_they_make() {
    let fns = functions(&header());
    let mut checked = 0;
    for (name, f) in &fns {
        let object_and_verb = name.trim_start_matches("ss_");
        let is_constructor = ["_open", "_new"].iter().any(|v| object_and_verb.contains(v));
        let Some(made) = f.params.last().and_then(|p| p.strip_suffix(" **out")) else { continue };
        if !is_constructor || f.deprecated.is_some() || !made.starts_with("ss_") || made == "ss_arena_options" {
            continue;
        }
        assert!(name.starts_with(&format!("{made}_")), "{name} writes a {made}: name it {made}_<verb>");
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} constructors checked");
}

/// Device indexes are `int32_t` and timeouts `int64_t timeout_ms`
/// everywhere.
#[test]
fn one_integer_type_per_meaning() {
    let fns = functions(&header());
    let mut timeouts = 0;
    for (name, f) in &fns {
        for p in &f.params {
            let pname = p.rsplit([' ', '*']).next().unwrap();
            if pname.contains("timeout") {
                assert_eq!(p, "int64_t timeout_ms", "{name}: timeouts are `int64_t timeout_ms`");
                timeouts += 1;
            }
            if pname == "device" || pname == "device_idx" {
                assert!(p.starts_with("int32_t "), "{name}: device indexes are int32_t, not {p:?}");
            }
        }
    }
    assert!(timeouts >= 8, "found only {timeouts} timeout parameters");
}

/// Out-parameters (`out`, `out_<what>`) come last; the one exception is
/// `ss_fds_recv`'s `out_len`, which follows the buffer it measures.
#[test]
fn out_parameters_come_last() {
    let fns = functions(&header());
    for (name, f) in &fns {
        let is_out = |p: &String| {
            let n = p.rsplit([' ', '*']).next().unwrap();
            n == "out" || n.starts_with("out_")
        };
        let first_out = f.params.iter().position(is_out).unwrap_or(f.params.len());
        let misplaced: Vec<&String> = f.params[first_out..].iter().filter(|p| !is_out(p)).collect();
        let allowed = ["ss_fds_recv", "ss_recv_fds"].contains(&name.as_str());
        assert!(misplaced.is_empty() || allowed, "{name}: {misplaced:?} after an out-parameter");
    }
}

#[test]
fn grammar_checker_rejects_bad_names() {
    assert!(grammar_problem("ss_map_open").is_none());
    assert!(grammar_problem("ss_new_shm_fd_storage").is_some());
    assert!(grammar_problem("ss_map_frobnicate").is_some());
    assert!(grammar_problem("map_open").is_some());
    assert!(grammar_problem("ss_hash_bytes").is_some());
}

/// A C file that calls a deprecated alias does not build with
/// `-Werror`: the header marks the aliases so compilers warn.
#[test]
fn compilers_warn_about_the_aliases() {
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let dir = std::env::temp_dir().join(format!("ss_c_api_grammar_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let build = |body: &str| {
        let src = dir.join("use.c");
        std::fs::write(&src, format!("#include \"storage_sharing.h\"\nint main(void) {{ {body} return 0; }}\n")).unwrap();
        let out = std::process::Command::new("cc")
            .args(["-Wall", "-Werror", "-c", "-o"])
            .arg(dir.join("use.o"))
            .arg("-I")
            .arg(&include)
            .arg(&src)
            .output()
            .expect("run cc");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, stderr) = build("ss_map *m = 0; (void)ss_new_shm_fd_storage(1, &m);");
    assert!(!ok && stderr.contains("deprecated") && stderr.contains("ss_map_new_shm_fd"), "{stderr}");
    let (ok, stderr) = build("ss_map *m = 0; (void)ss_map_new_shm_fd(1, &m);");
    assert!(ok, "the new name builds cleanly: {stderr}");
    // A borrowed map is const: passing it to ss_map_free is a diagnostic.
    let (ok, stderr) = build("int x; ss_map_free(ss_map_lookup(&x));");
    assert!(!ok && stderr.contains("ss_map_free"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The aliases still link and behave as their replacements.
#[test]
#[allow(deprecated)]
fn aliases_behave_as_their_replacements() {
    use std::ffi::CStr;
    use storage_sharing::ffi::arena::*;
    use storage_sharing::ffi::content_store::*;
    use storage_sharing::ffi::deprecated::*;
    use storage_sharing::ffi::map::*;
    use storage_sharing::ffi::ss_status::SS_OK;

    // SAFETY: every pointer passed is valid for the call; handles are freed once.
    unsafe {
        let mut m = std::ptr::null_mut();
        assert_eq!(ss_new_shm_fd_storage(4096, &mut m), SS_OK);
        assert_eq!(ss_map_size(m), 4096);
        let data = ss_map_data(m);
        assert_eq!(ss_map_from_data(data.cast::<u8>().add(100).cast()), m);
        assert_eq!(ss_map_lookup(data), m.cast_const());
        ss_map_free(m);

        let bytes = *b"alias";
        let mut copy = std::ptr::null_mut();
        assert_eq!(ss_share_memory(bytes.as_ptr().cast(), bytes.len(), &mut copy), SS_OK);
        assert_eq!(std::slice::from_raw_parts(ss_map_data(copy).cast::<u8>(), 5), b"alias");
        ss_map_free(copy);

        let (mut old, mut new) = ([0 as std::os::raw::c_char; 80], [0 as std::os::raw::c_char; 80]);
        assert_eq!(ss_hash_bytes(bytes.as_ptr().cast(), 5, 0, old.as_mut_ptr(), 80), SS_OK);
        assert_eq!(ss_content_hash_bytes(bytes.as_ptr().cast(), 5, 0, new.as_mut_ptr(), 80), SS_OK);
        assert_eq!(CStr::from_ptr(old.as_ptr()), CStr::from_ptr(new.as_ptr()));

        let mut name = [0 as std::os::raw::c_char; 64];
        assert_eq!(ss_new_process_wide_shm_handle(name.as_mut_ptr(), 64), SS_OK);
        assert!(CStr::from_ptr(name.as_ptr()).to_str().unwrap().starts_with("/torch_"));

        // ss_arena_free still frees a block (not the arena).
        let mut a = std::ptr::null_mut();
        assert_eq!(ss_arena_open(std::ptr::null(), &mut a), SS_OK);
        let mut p = std::ptr::null_mut();
        assert_eq!(ss_arena_alloc(a, 64, 64, &mut p), SS_OK);
        let mut stats = std::mem::zeroed::<ss_arena_stats>();
        assert_eq!(ss_arena_stats_get(a, &mut stats), SS_OK);
        assert_eq!(stats.live_blocks, 1);
        assert_eq!(ss_arena_free(a, p), SS_OK);
        assert_eq!(ss_arena_stats_get(a, &mut stats), SS_OK);
        assert_eq!(stats.live_blocks, 0);
        assert_ne!(ss_arena_free(a, p), SS_OK, "a second free is refused, as by ss_arena_dealloc");
        let mut released = usize::MAX;
        assert_eq!(ss_arena_trim_remote_cache(&mut released), SS_OK);
        assert_ne!(released, usize::MAX);
        ss_arena_close(a);
    }
}
