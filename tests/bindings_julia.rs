//! Julia cannot be installed on this project's machines, so the Julia
//! module (bindings/julia) is checked against the C header by parsing both:
//! every `ccall` names a function the header declares, with as many
//! argument types as the C function has parameters, each type matching the
//! C type, as many arguments as types, and every `const SS_*` of the
//! module has the header's value.

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
            opaque.push(rest.split_whitespace().last().unwrap().to_string());
            continue;
        }
        if stmt.starts_with("typedef") || !stmt.contains('(') {
            continue;
        }
        let open = stmt.find('(').unwrap();
        let close = stmt.rfind(')').expect("unbalanced prototype");
        let head = stmt[..open].trim_end();
        let name_start = head
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let name = head[name_start..].to_string();
        let ret = normalize_c_type(&head[..name_start]);
        let params = split_top_level(&stmt[open + 1..close])
            .into_iter()
            .filter(|p| p != "void")
            .map(|p| {
                // Drop the parameter's name: the last identifier after the type.
                let cut = p
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
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
            return Err(format!(
                "line {line}: ccall needs (name, lib), a return type and a type tuple"
            ));
        }
        let target = args[0].trim_start_matches('(').trim_end_matches(')');
        let name = split_top_level(target)
            .first()
            .and_then(|n| n.strip_prefix(':'))
            .ok_or_else(|| format!("line {line}: ccall target {target} is not (:name, library)"))?
            .to_string();
        let tuple = args[2].trim();
        if !(tuple.starts_with('(') && tuple.ends_with(')')) {
            return Err(format!(
                "line {line}: the argument types of {name} are not a literal tuple"
            ));
        }
        let types = split_top_level(&tuple[1..tuple.len() - 1]);
        calls.push(Ccall {
            line,
            name,
            ret: args[1].clone(),
            types,
            nargs: args.len() - 3,
        });
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
        b => {
            return Err(format!(
                "C type `{b}` has no Julia spelling yet: add it to julia_types_for in tests/bindings_julia.rs"
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
            problems.push(format!(
                "{at}: {} argument types, the C function has {} parameters",
                call.types.len(),
                proto.params.len()
            ));
        }
        if call.nargs != call.types.len() {
            problems.push(format!(
                "{at}: {} arguments passed for {} types",
                call.nargs,
                call.types.len()
            ));
        }
        let mut pairs: Vec<(&str, &str, String)> = vec![(&proto.ret, &call.ret, "return type".to_string())];
        for (i, (c, j)) in proto.params.iter().zip(&call.types).enumerate() {
            pairs.push((c, j, format!("parameter {}", i + 1)));
        }
        for (c, j, what) in pairs {
            match julia_types_for(c, opaque) {
                Ok(ok) if ok.iter().any(|t| t == j) => {}
                Ok(ok) => problems.push(format!(
                    "{at}: {what} is `{j}` in Julia, C has `{c}` (expected one of {ok:?})"
                )),
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

#[test]
fn every_ccall_matches_the_header() {
    let header = read("include/storage_sharing.h");
    let julia = read("bindings/julia/src/StorageSharing.jl");
    let (protos, opaque) = parse_header(&header);
    assert!(
        protos.contains_key("ss_map_open") && opaque.contains(&"ss_map".to_string()),
        "header parser found {protos:?}"
    );
    let calls = parse_ccalls(&julia).unwrap();
    let written = strip_julia_comments(&julia).matches("ccall(").count();
    assert!(
        !calls.is_empty() && calls.len() == written,
        "parsed {} of {written} ccalls",
        calls.len()
    );
    let problems = check_ccalls(&calls, &protos, &opaque);
    assert!(
        problems.is_empty(),
        "Julia ccalls disagree with the header:\n{}",
        problems.join("\n")
    );

    let unbound: Vec<&String> = protos.keys().filter(|n| !calls.iter().any(|c| &c.name == *n)).collect();
    println!(
        "{} ccalls checked; C functions without a Julia wrapper yet: {unbound:?}",
        calls.len()
    );
}

#[test]
fn julia_constants_have_the_header_values() {
    let consts = header_constants(&read("include/storage_sharing.h"));
    let julia = julia_constants(&read("bindings/julia/src/StorageSharing.jl"));
    assert!(julia.len() >= 20, "found only {julia:?}");
    for (name, value) in &julia {
        let want = consts
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not in the header"));
        assert_eq!(value, &want.to_string(), "{name}: Julia has {value}, the header {want}");
    }
}

/// The checker itself catches the mistakes it exists for.
#[test]
fn checker_reports_bad_ccalls() {
    let header = "typedef struct ss_x ss_x;\nss_status ss_x_open(const char *name,\n    size_t size, ss_x **out);\nvoid ss_x_free(ss_x *x);\n";
    let (protos, opaque) = parse_header(header);
    assert_eq!(protos["ss_x_open"].params, ["const char *", "size_t", "ss_x **"]);
    let good = "ccall((:ss_x_open, lib()), Cint, (Cstring, Csize_t, Ptr{Ptr{Cvoid}}), n, s, out)\nccall((:ss_x_free, lib()), Cvoid, (Ptr{Cvoid},), x)";
    assert!(check_ccalls(&parse_ccalls(good).unwrap(), &protos, &opaque).is_empty());
    for (bad, why) in [
        (
            "ccall((:ss_x_opne, lib()), Cint, (Cstring, Csize_t, Ptr{Ptr{Cvoid}}), n, s, out)",
            "no such function",
        ),
        (
            "ccall((:ss_x_open, lib()), Cint, (Cstring, Ptr{Ptr{Cvoid}}), n, out)",
            "2 argument types, the C function has 3",
        ),
        (
            "ccall((:ss_x_open, lib()), Cint, (Cstring, Cint, Ptr{Ptr{Cvoid}}), n, s, out)",
            "parameter 2 is `Cint`",
        ),
        (
            "ccall((:ss_x_open, lib()), Cint, (Cstring, Csize_t, Ptr{Ptr{Cvoid}}), n, s)",
            "2 arguments passed for 3 types",
        ),
        (
            "ccall((:ss_x_free, lib()), Cint, (Ptr{Cvoid},), x)",
            "return type is `Cint`",
        ),
    ] {
        let problems = check_ccalls(&parse_ccalls(bad).unwrap(), &protos, &opaque);
        assert!(
            problems.iter().any(|p| p.contains(why)),
            "{bad}: wanted '{why}', got {problems:?}"
        );
    }
}
