//! Julia cannot be installed on this project's machines, so the Julia
//! module (bindings/julia) is checked against the C header by parsing both:
//! every `ccall` names a function the header declares, with as many
//! argument types as the C function has parameters, each type matching the
//! C type, as many arguments as types, every C function has a wrapper,
//! every `const SS_*` of the module has the header's value, and the Julia
//! mirror of `ss_cuda_ipc_handle` has the C struct's fields.

use std::collections::BTreeMap;
use std::path::Path;

/// One C prototype: return type and parameter types, normalized
/// ("const char *", "ss_map **", ...).
#[derive(Debug)]
struct Prototype {
    ret: String,
    params: Vec<String>,
}

/// One `ccall((:name, lib), Ret, (T1, ...), args...)` of the Julia file.
#[derive(Debug)]
struct Ccall {
    line: usize,
    name: String,
    ret: String,
    types: Vec<String>,
    nargs: usize,
}

fn strip_c_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |e| &after[e + 2..]);
        } else if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |e| &after[e..]);
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// Splits at commas outside (), {} and [] and outside string literals.
fn split_top_level(s: &str) -> Vec<String> {
    let (mut parts, mut cur, mut depth, mut in_str) = (Vec::new(), String::new(), 0i32, false);
    for c in s.chars() {
        match c {
            '"' => in_str = !in_str,
            '(' | '{' | '[' if !in_str => depth += 1,
            ')' | '}' | ']' if !in_str => depth -= 1,
            ',' if depth == 0 && !in_str => {
                parts.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.trim().is_empty() {
        parts.push(cur.trim().to_string());
    }
    parts
}

fn normalize_c_type(t: &str) -> String {
    let spaced = t.replace('*', " * ");
    let words: Vec<&str> = spaced.split_whitespace().collect();
    words.join(" ").replace("* *", "**")
}

/// One field of a C struct: normalized type, name, array length (a
/// number or a macro name) if it is an array.
#[derive(Debug, PartialEq)]
struct Field {
    ty: String,
    name: String,
    array: Option<String>,
}

/// The header's `typedef struct { ... } name;` definitions, fields in order.
fn parse_structs(text: &str) -> BTreeMap<String, Vec<Field>> {
    let code = strip_c_comments(text);
    let mut out = BTreeMap::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("typedef struct {") {
        let body_start = at + "typedef struct {".len();
        let body_end = body_start + rest[body_start..].find('}').expect("unclosed struct");
        let after = &rest[body_end + 1..];
        let name_end = after.find(';').expect("struct without a name");
        let name = after[..name_end].trim().to_string();
        let fields = rest[body_start..body_end]
            .split(';')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(|f| {
                let (decl, array) = match f.split_once('[') {
                    Some((d, a)) => (d.trim(), Some(a.trim_end_matches(']').trim().to_string())),
                    None => (f, None),
                };
                let cut = decl.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                Field { ty: normalize_c_type(&decl[..cut]), name: decl[cut..].to_string(), array }
            })
            .collect();
        out.insert(name, fields);
        rest = &after[name_end..];
    }
    out
}

/// The header's functions and opaque handle types.
fn parse_header(text: &str) -> (BTreeMap<String, Prototype>, Vec<String>) {
    let code: String = strip_c_comments(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("extern \"C\" {", "");
    let mut protos = BTreeMap::new();
    let mut opaque = Vec::new();
    for stmt in code.split(';') {
        let stmt = stmt.trim().trim_start_matches('}').trim();
        if let Some(rest) = stmt.strip_prefix("typedef struct ") {
            // `typedef struct ss_x ss_x`: an opaque handle (struct bodies are
            // parse_structs' business).
            if let [tag, alias] = rest.split_whitespace().collect::<Vec<_>>().as_slice() {
                if tag == alias {
                    opaque.push(alias.to_string());
                }
            }
            continue;
        }
        // Deprecated aliases of renamed functions: the module uses the new names.
        if stmt.starts_with("typedef") || stmt.starts_with("SS_DEPRECATED(") || !stmt.contains('(') {
            continue;
        }
        let open = stmt.find('(').unwrap();
        let close = stmt.rfind(')').expect("unbalanced prototype");
        let head = stmt[..open].trim_end();
        let name_start = head.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
        let name = head[name_start..].to_string();
        let ret = normalize_c_type(&head[..name_start]);
        let params = split_top_level(&stmt[open + 1..close])
            .into_iter()
            .filter(|p| p != "void")
            .map(|p| {
                // Drop the parameter's name: the last identifier after the type.
                let cut = p.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                normalize_c_type(&p[..cut])
            })
            .collect();
        protos.insert(name, Prototype { ret, params });
    }
    (protos, opaque)
}

fn strip_julia_comments(text: &str) -> String {
    text.lines()
        .map(|l| {
            // A '#' outside a string starts a comment (the module has no '#' in strings).
            let mut in_str = false;
            for (i, c) in l.char_indices() {
                match c {
                    '"' => in_str = !in_str,
                    '#' if !in_str => return &l[..i],
                    _ => {}
                }
            }
            l
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `ccall(` of the Julia source (comments removed; docstrings are
/// code-free prose that never says "ccall(").
fn parse_ccalls(text: &str) -> Result<Vec<Ccall>, String> {
    let code = strip_julia_comments(text);
    let mut calls = Vec::new();
    let mut from = 0;
    while let Some(pos) = code[from..].find("ccall(") {
        let start = from + pos + "ccall(".len();
        let line = code[..start].matches('\n').count() + 1;
        let mut depth = 1;
        let mut end = start;
        for (i, c) in code[start..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = start + i;
                break;
            }
        }
        if depth != 0 {
            return Err(format!("line {line}: unbalanced ccall"));
        }
        let args = split_top_level(&code[start..end]);
        if args.len() < 3 {
            return Err(format!("line {line}: ccall needs (name, lib), a return type and a type tuple"));
        }
        let target = args[0].trim_start_matches('(').trim_end_matches(')');
        let name = split_top_level(target)
            .first()
            .and_then(|n| n.strip_prefix(':'))
            .ok_or_else(|| format!("line {line}: ccall target {target} is not (:name, library)"))?
            .to_string();
        let tuple = args[2].trim();
        if !(tuple.starts_with('(') && tuple.ends_with(')')) {
            return Err(format!("line {line}: the argument types of {name} are not a literal tuple"));
        }
        let types = split_top_level(&tuple[1..tuple.len() - 1]);
        calls.push(Ccall { line, name, ret: args[1].clone(), types, nargs: args.len() - 3 });
        from = end;
    }
    Ok(calls)
}

/// The Julia spellings a C type may have in a ccall.
fn julia_types_for(c: &str, opaque: &[String]) -> Result<Vec<String>, String> {
    let stars = c.matches('*').count();
    let base = c.replace('*', "").replace("const", "");
    let base = base.trim();
    let mut options: Vec<String> = match base {
        "void" if stars == 0 => vec!["Cvoid".into()],
        "void" => vec!["Cvoid".into(), "UInt8".into()],
        "char" => vec!["UInt8".into(), "Cchar".into()],
        "int" | "ss_status" => vec!["Cint".into()],
        "size_t" => vec!["Csize_t".into()],
        "bool" => vec!["Bool".into()],
        "int32_t" => vec!["Int32".into()],
        "uint32_t" => vec!["UInt32".into()],
        "int64_t" => vec!["Int64".into()],
        "uint64_t" => vec!["UInt64".into()],
        "uint8_t" => vec!["UInt8".into()],
        "pid_t" => vec!["Cint".into()],
        b if opaque.iter().any(|o| o == b) => vec!["Cvoid".into()],
        // The struct's Julia mirror; julia_structs_match_the_header checks its fields.
        "ss_cuda_ipc_handle" => vec!["CudaIpcHandle".into()],
        // The callback table of ss_store_callbacks_open (its Julia mirror).
        "ss_store_callbacks" => vec!["StoreCallbacks".into()],
        "ss_arena_options" => vec!["ArenaOptions".into()],
        "ss_arena_handle" => vec!["ArenaHandle".into()],
        "ss_arena_stats" => vec!["ArenaStats".into()],
        "ss_cuda_pool_options" => vec!["CudaPoolOptions".into()],
        "ss_tensor_desc" => vec!["TensorDesc".into()],
        "ss_cuda_weights_tensor_info" => vec!["CudaWeightsTensorInfo".into()],
        "uintptr_t" => vec!["Csize_t".into(), "UInt".into()],
        // A C function pointer (from @cfunction) or C_NULL.
        "ss_cuda_deleter" | "ss_log_fn" if stars == 0 => vec!["Ptr{Cvoid}".into()],
        b => {
            return Err(format!(
                "C type `{b}` has no Julia spelling yet: add it to julia_types_for in tests/api/julia_bindings_match_header.rs"
            ))
        }
    };
    for _ in 0..stars {
        options = options.iter().map(|t| format!("Ptr{{{t}}}")).collect();
    }
    if base == "char" && stars == 1 {
        options.push("Cstring".into());
    }
    Ok(options)
}

/// Every mismatch between the ccalls and the header, as readable lines.
fn check_ccalls(calls: &[Ccall], protos: &BTreeMap<String, Prototype>, opaque: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for call in calls {
        let at = format!("bindings/julia line {}: {}", call.line, call.name);
        let Some(proto) = protos.get(&call.name) else {
            problems.push(format!("{at}: no such function in include/storage_sharing.h"));
            continue;
        };
        if call.types.len() != proto.params.len() {
            problems.push(format!("{at}: {} argument types, the C function has {} parameters", call.types.len(), proto.params.len()));
        }
        if call.nargs != call.types.len() {
            problems.push(format!("{at}: {} arguments passed for {} types", call.nargs, call.types.len()));
        }
        let mut pairs: Vec<(&str, &str, String)> = vec![(&proto.ret, &call.ret, "return type".to_string())];
        for (i, (c, j)) in proto.params.iter().zip(&call.types).enumerate() {
            pairs.push((c, j, format!("parameter {}", i + 1)));
        }
        for (c, j, what) in pairs {
            match julia_types_for(c, opaque) {
                Ok(ok) if ok.iter().any(|t| t == j) => {}
                Ok(ok) => problems.push(format!("{at}: {what} is `{j}` in Julia, C has `{c}` (expected one of {ok:?})")),
                Err(e) => problems.push(format!("{at}: {e}")),
            }
        }
    }
    problems
}

/// `#define SS_X 12` and enum `SS_X = 12` values of the header.
fn header_constants(text: &str) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (name, value) = match words.as_slice() {
            ["#define", n, v] => (*n, *v),
            [n, "=", v] => (*n, v.trim_end_matches(',')),
            _ => continue,
        };
        if let (true, Ok(v)) = (name.starts_with("SS_"), value.parse::<i64>()) {
            out.insert(name.to_string(), v);
        }
    }
    out
}

/// `const SS_X = Cint(12)` or `const SS_X = 12` lines of the Julia module.
fn julia_constants(text: &str) -> Vec<(String, String)> {
    strip_julia_comments(text)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("const SS_"))
        .filter_map(|l| l.split_once('='))
        .map(|(n, v)| {
            let v = v.trim();
            let v = v.find('(').map_or(v, |i| v[i + 1..].trim_end_matches(')'));
            (format!("SS_{}", n.trim()), v.trim().to_string())
        })
        .collect()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every file of the Julia module (bindings/julia/src/*.jl), by path.
fn julia_sources() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bindings/julia/src");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".jl"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|n| {
            let rel = format!("bindings/julia/src/{n}");
            let text = read(&rel);
            (rel, text)
        })
        .collect()
}

#[test]
fn every_ccall_matches_the_header() {
    let header = read("include/storage_sharing.h");
    let (protos, opaque) = parse_header(&header);
    assert!(protos.contains_key("ss_map_open") && opaque.contains(&"ss_map".to_string()), "header parser found {protos:?}");
    assert_eq!(
        opaque,
        [
            "ss_arena",
            "ss_arena_view",
            "ss_content_list",
            "ss_content_reader",
            "ss_content_storage",
            "ss_content_tensor",
            "ss_content_writer",
            "ss_cuda_pool",
            "ss_cuda_received",
            "ss_cuda_sent",
            "ss_cuda_weights",
            "ss_map",
            "ss_storage",
            "ss_store",
            "ss_symm_mem",
            "ss_weak",
        ],
        "opaque handle types of the header"
    );
    let mut calls = Vec::new();
    let mut problems = Vec::new();
    for (file, julia) in julia_sources() {
        let file_calls = parse_ccalls(&julia).unwrap_or_else(|e| panic!("{file}: {e}"));
        let written = strip_julia_comments(&julia).matches("ccall(").count();
        assert_eq!(file_calls.len(), written, "{file}: parsed {} of {written} ccalls", file_calls.len());
        problems.extend(check_ccalls(&file_calls, &protos, &opaque).into_iter().map(|p| p.replacen("bindings/julia", &file, 1)));
        calls.extend(file_calls);
    }
    assert!(calls.len() > 60, "found only {} ccalls", calls.len());
    assert!(problems.is_empty(), "Julia ccalls disagree with the header:\n{}", problems.join("\n"));
    // The module binds the whole C API: a new C function needs a wrapper.
    let unbound: Vec<&String> = protos.keys().filter(|n| !calls.iter().any(|c| &c.name == *n)).collect();
    assert!(unbound.is_empty(), "C functions without a Julia wrapper: {unbound:?}");
    println!("{} ccalls checked, all {} C functions bound", calls.len(), protos.len());
}

/// `struct CudaIpcHandle` has the C struct's fields, in order, with Julia
/// types of the same size: its bytes are the C struct's.
#[test]
fn julia_structs_match_the_header() {
    for (c_name, j_name) in [
        ("ss_cuda_ipc_handle", "CudaIpcHandle"),
        ("ss_arena_options", "ArenaOptions"),
        ("ss_arena_handle", "ArenaHandle"),
        ("ss_arena_stats", "ArenaStats"),
        ("ss_cuda_pool_options", "CudaPoolOptions"),
        ("ss_tensor_desc", "TensorDesc"),
        ("ss_cuda_weights_tensor_info", "CudaWeightsTensorInfo"),
    ] {
        check_struct(c_name, j_name);
    }
}

fn check_struct(c_name: &str, j_name: &str) {
    let header = read("include/storage_sharing.h");
    let consts = header_constants(&header);
    let structs = parse_structs(&header);
    let c_fields = structs.get(c_name).unwrap_or_else(|| panic!("no {c_name} in {structs:?}"));
    let julia = julia_sources().into_iter().map(|(_, t)| strip_julia_comments(&t)).collect::<Vec<_>>().join("\n");
    let body = julia
        .split(&format!("struct {j_name}\n"))
        .nth(1)
        .and_then(|b| b.split("\nend").next())
        .unwrap_or_else(|| panic!("no `struct {j_name}` in the Julia module"));
    let j_fields: Vec<(String, String)> =
        body.lines().filter_map(|l| l.trim().split_once("::")).map(|(n, t)| (n.trim().to_string(), t.trim().to_string())).collect();
    let names: Vec<&str> = c_fields.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(j_fields.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), names, "{j_name}: field names and order");
    let opaque: Vec<String> = Vec::new();
    for (c, (name, jt)) in c_fields.iter().zip(&j_fields) {
        let want: Vec<String> = match &c.array {
            Some(len) => {
                let n =
                    len.parse::<i64>().ok().or_else(|| consts.get(len).copied()).unwrap_or_else(|| panic!("array length {len} of {name}"));
                // char arrays are bytes too (NUL-terminated names).
                let elem = if c.ty == "char" { "UInt8".to_string() } else { julia_types_for(&c.ty, &opaque).unwrap()[0].clone() };
                vec![format!("NTuple{{{n},{elem}}}"), format!("NTuple{{{n}, {elem}}}")]
            }
            None => julia_types_for(&c.ty, &opaque).unwrap(),
        };
        assert!(want.contains(jt), "field {name}: Julia has {jt}, C has {} (wanted one of {want:?})", c.ty);
    }
}

#[test]
fn julia_constants_have_the_header_values() {
    let consts = header_constants(&read("include/storage_sharing.h"));
    let julia: Vec<(String, String)> = julia_sources().iter().flat_map(|(_, t)| julia_constants(t)).collect();
    assert!(julia.len() >= 20, "found only {julia:?}");
    for (name, value) in &julia {
        let want = consts.get(name).unwrap_or_else(|| panic!("{name} is not in the header"));
        assert_eq!(value, &want.to_string(), "{name}: Julia has {value}, the header {want}");
    }
}

/// The checker itself catches the mistakes it exists for.
#[test]
fn checker_reports_bad_ccalls() {
    let header =
        "typedef struct ss_x ss_x;\nss_status ss_x_open(const char *name,\n    size_t size, ss_x **out);\nvoid ss_x_free(ss_x *x);\n";
    let (protos, opaque) = parse_header(header);
    assert_eq!(protos["ss_x_open"].params, ["const char *", "size_t", "ss_x **"]);
    let good = "ccall((:ss_x_open, lib()), Cint, (Cstring, Csize_t, Ptr{Ptr{Cvoid}}), n, s, out)\nccall((:ss_x_free, lib()), Cvoid, (Ptr{Cvoid},), x)";
    assert!(check_ccalls(&parse_ccalls(good).unwrap(), &protos, &opaque).is_empty());
    for (bad, why) in [
        ("ccall((:ss_x_opne, lib()), Cint, (Cstring, Csize_t, Ptr{Ptr{Cvoid}}), n, s, out)", "no such function"),
        ("ccall((:ss_x_open, lib()), Cint, (Cstring, Ptr{Ptr{Cvoid}}), n, out)", "2 argument types, the C function has 3"),
        ("ccall((:ss_x_open, lib()), Cint, (Cstring, Cint, Ptr{Ptr{Cvoid}}), n, s, out)", "parameter 2 is `Cint`"),
        ("ccall((:ss_x_open, lib()), Cint, (Cstring, Csize_t, Ptr{Ptr{Cvoid}}), n, s)", "2 arguments passed for 3 types"),
        ("ccall((:ss_x_free, lib()), Cint, (Ptr{Cvoid},), x)", "return type is `Cint`"),
    ] {
        let problems = check_ccalls(&parse_ccalls(bad).unwrap(), &protos, &opaque);
        assert!(problems.iter().any(|p| p.contains(why)), "{bad}: wanted '{why}', got {problems:?}");
    }
}
