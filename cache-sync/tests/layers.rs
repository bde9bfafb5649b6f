//! The crate's layers, bottom up, and the rule that each imports only those
//! below it (so no import cycle can form). Run it alone with
//! `cargo test -p cache-sync --test layers`.
//!
//! A module's layer is its top-level folder or file under `src/`. Every
//! `crate::…` path in non-test code counts as an import, and so do names
//! the crate root re-exports (`crate::Node` is the `node` layer). Test code
//! (`tests.rs` files and `#[cfg(test)] mod tests` blocks) may reach up, as
//! tests of a lower layer sometimes need a node.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Bottom first. Modules on one line form one layer and may not import
/// each other either.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["util"],
    &["wire"],
    &["transport"],
    &["status", "table"],
    &["cache", "cluster"],
    &["publish"],
    &["node", "outbox", "cdc"],
    &["fuzz"],
];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's code without comments and without its inline
/// `#[cfg(test)] mod … { … }` blocks (the code after them is kept).
fn production_code(text: &str) -> String {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    // `#[cfg(test)] mod name {`, not `mod name;` (a file, skipped whole).
    let Some(start) = code.match_indices("#[cfg(test)]\nmod ").find_map(|(i, _)| {
        let line = code[i..].lines().nth(1)?;
        line.trim_end().ends_with('{').then_some(i)
    }) else {
        return code;
    };
    let mut depth = 0usize;
    for (i, c) in code[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    let end = start + i + 1;
                    return format!("{}{}", &code[..start], production_code(&code[end..]));
                }
            }
            _ => {}
        }
    }
    code[..start].to_owned()
}

/// `super::` chains that climb to the crate root, rewritten as `crate::`,
/// for a file whose module path is `depth` modules deep.
fn root_paths(code: &str, depth: usize) -> String {
    code.replace(&"super::".repeat(depth), "crate::")
}

/// Which module each name the root re-exports comes from, read from
/// `lib.rs`'s `pub use module::…` lines.
fn root_exports(lib: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = lib;
    while let Some(i) = rest.find("pub use ") {
        rest = &rest[i + "pub use ".len()..];
        let end = rest.find(';').expect("a use ends with ;");
        let item = &rest[..end];
        let module = item
            .split("::")
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        let names = item[module.len()..].trim_start_matches("::");
        let names = names.rsplit("::").next().unwrap_or_default();
        for name in names
            .trim_matches(|c| c == '{' || c == '}' || char::is_whitespace(c))
            .split(',')
        {
            let name = name.trim();
            if !name.is_empty() {
                out.push((name.to_owned(), module.clone()));
            }
        }
        rest = &rest[end..];
    }
    out
}

/// Every module a file's code names through `crate::`.
fn imports(code: &str, exports: &[(String, String)]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let groups: Vec<&str> = if let Some(inner) = rest.strip_prefix('{') {
            // The group's top-level items; nested groups stay whole, and
            // only their first segment (the module) matters.
            let mut items = Vec::new();
            let (mut depth, mut from) = (0usize, 0usize);
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        items.push(&inner[from..i]);
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(&inner[from..i]);
                        from = i + 1;
                    }
                    _ => {}
                }
            }
            items
        } else {
            vec![rest]
        };
        for g in groups {
            let name: String = g
                .trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if g.trim().is_empty() {
                // A trailing comma in a group.
                continue;
            }
            assert!(
                !name.is_empty(),
                "a glob import from the crate root hides its layers"
            );
            if name == "Result" || name == "Error" {
                // `crate::Result`/`crate::Error` are the error layer.
                out.insert("error".to_owned());
            } else if let Some((_, module)) = exports.iter().find(|(n, _)| *n == name) {
                out.insert(module.clone());
            } else {
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn each_layer_imports_only_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let exports =
        root_exports(&fs::read_to_string(src.join("lib.rs")).expect("lib.rs is readable"));
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut seen = BTreeSet::new();
    let mut broken = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let module = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        // `bin/` holds the command-line tool: a separate crate that uses
        // the library through its public API only, on top of every layer.
        // Test modules (`tests.rs`, and the files of a `tests/` folder) may
        // drive a layer through the ones above it, as a user would.
        let test_module = rel
            .components()
            .any(|c| c.as_os_str() == "tests.rs" || c.as_os_str() == "tests");
        if module == "lib" || module == "bin" || test_module {
            continue;
        }
        let own = rank(&module).unwrap_or_else(|| {
            panic!(
                "{module} (src/{}) is in no layer; add it to LAYERS",
                rel.display()
            )
        });
        seen.insert(module.clone());
        // The module path's length: `a.rs` and `a/mod.rs` are one deep,
        // `a/b.rs` two; that many `super::` reach the crate root.
        let depth = rel
            .components()
            .filter(|c| c.as_os_str() != "mod.rs")
            .count();
        let code = root_paths(&production_code(&fs::read_to_string(&file).unwrap()), depth);
        for import in imports(&code, &exports) {
            if import == module {
                continue;
            }
            let theirs = rank(&import).unwrap_or_else(|| {
                panic!(
                    "src/{} imports {import}, which is in no layer",
                    rel.display()
                )
            });
            if theirs >= own {
                broken.push(format!("src/{} ({module}) imports {import}", rel.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "imports that reach up or sideways:\n{}",
        broken.join("\n")
    );
    for layer in LAYERS.iter().flat_map(|l| l.iter()) {
        assert!(
            seen.contains(*layer),
            "LAYERS names {layer}, which has no source"
        );
    }
}

/// The checker itself: an upward import must be caught, through a path or
/// through a root re-export.
#[test]
fn the_checker_sees_imports_through_paths_groups_and_root_names() {
    let exports = root_exports("pub use node::{Node, NodeBuilder};\npub use cache::SyncedCache;\n");
    let found = imports(
        "use crate::wire::Codec;\nuse crate::{Node, SyncedCache};\n\
         fn f() -> crate::Result<()> { crate::util::lock(m); }\n\
         use crate::{status::{A, B}, publish::P,};",
        &exports,
    );
    let want: BTreeSet<String> = [
        "wire", "node", "cache", "error", "util", "status", "publish",
    ]
    .map(String::from)
    .into();
    assert_eq!(found, want);
    assert_eq!(
        root_paths("use super::super::node::Node;", 2),
        "use crate::node::Node;"
    );
    assert_eq!(
        production_code(
            "use crate::a;\n// crate::b\n#[cfg(test)]\nmod tests {\n use crate::c;\n fn f() {}\n}\nuse crate::d;"
        ),
        "use crate::a;\n\nuse crate::d;"
    );
}
