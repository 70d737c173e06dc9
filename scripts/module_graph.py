#!/usr/bin/env python3
"""Prints the dependency graph between the top-level modules of the library
crate (src/, without src/bin/) and any cycles in it.

An edge A -> B means some file of module A names `crate::B` (also inside a
`use crate::{...}` group, or through `super::` paths that climb out of A).
Comments are skipped. Usage: scripts/module_graph.py [--check] [SRC_DIR]
With --check, exits 1 when the graph has a cycle or a module below `ffi`
names `ffi`.
"""

import os
import re
import sys


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] if "//" in line and '"' not in line.split("//", 1)[0] else line for line in text.splitlines())


def module_path(src, path):
    """The module path of a file, e.g. src/shm/map.rs -> ['shm', 'map']."""
    rel = os.path.relpath(path, src)[: -len(".rs")].split(os.sep)
    if rel[-1] in ("mod", "lib"):
        rel = rel[:-1]
    return rel


def top_level_modules(src):
    lib = open(os.path.join(src, "lib.rs")).read()
    return re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", lib, flags=re.M)


def first_names_of_group(text):
    """Top-level names in `{a, b::c, d::{e, f}}` (text starts after '{')."""
    names, depth, current = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            names.append(current)
            current = ""
            continue
        if depth == 0:
            current += ch
    names.append(current)
    return [n.strip().split("::")[0].strip() for n in names if n.strip()]


def references(src, path, text):
    """Top-level module names that the file at `path` refers to."""
    here = module_path(src, path)
    found = set()
    for m in re.finditer(r"\b(crate|super)((?:::super)*)::(\{|\w+)", text):
        head, supers, first = m.group(1), m.group(2), m.group(3)
        # `super` climbs one module per word; `here` is the file's own module.
        levels = 0 if head == "crate" else 1 + supers.count("super")
        base = here[: len(here) - levels] if head == "super" else []
        if base:
            found.add(base[0])
            continue
        if first == "{":
            found.update(first_names_of_group(text[m.end():]))
        else:
            found.add(first)
    return found


def graph(src):
    mods = top_level_modules(src)
    edges = {m: set() for m in mods}
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if os.path.join(root, d) != os.path.join(src, "bin")]
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            here = module_path(src, path)
            if not here or here[0] not in edges:
                continue
            text = strip_comments(open(path, encoding="utf-8").read())
            for target in references(src, path, text):
                if target in edges and target != here[0]:
                    edges[here[0]].add(target)
    return edges


def cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    args = [a for a in sys.argv[1:] if a != "--check"]
    check = "--check" in sys.argv[1:]
    src = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    edges = graph(src)
    for m in sorted(edges):
        print(f"{m:14} -> {', '.join(sorted(edges[m])) or '(nothing)'}")
    found = cycles(edges)
    upward = sorted(m for m in edges if "ffi" in edges[m] and m != "ffi")
    print("cycles:", "; ".join(" <-> ".join(c) for c in found) if found else "none")
    print("modules naming ffi:", ", ".join(upward) if upward else "none")
    if check and (found or upward):
        sys.exit(1)


if __name__ == "__main__":
    main()
