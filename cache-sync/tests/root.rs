//! The crate root stays small, as moka's does: what every user touches
//! (the cache, the node, the publisher, the table, the error, their
//! builders and companions) and a few modules for the rest. Counted from
//! `src/lib.rs` with every feature on: each `pub mod` and each name a
//! `pub use` brings in, except what is `#[doc(hidden)]`.

use std::fs;

/// The most items the root may hold (issue 37).
const MAX_ROOT_ITEMS: usize = 20;

/// The names `pub use` and `pub mod` items of `lib.rs` put at the root.
fn root_items(lib: &str) -> Vec<String> {
    let code: Vec<&str> = lib
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//"))
        .collect();
    let mut items = Vec::new();
    let mut hidden = false;
    let mut i = 0;
    while i < code.len() {
        let line = code[i];
        if line.starts_with("#[doc(hidden)]") {
            hidden = true;
        } else if line.starts_with("#[") || line.is_empty() {
            // Other attributes keep a pending `doc(hidden)` for the item.
        } else if let Some(rest) = line.strip_prefix("pub mod ") {
            if !hidden {
                items.push(rest.trim_end_matches(';').trim().to_owned());
            }
            hidden = false;
        } else if line.starts_with("pub use ") {
            // A `pub use` may span lines, up to its `;`.
            let mut statement = line.to_owned();
            while !statement.ends_with(';') {
                i += 1;
                statement.push(' ');
                statement.push_str(code[i]);
            }
            if !hidden {
                items.extend(imported_names(&statement));
            }
            hidden = false;
        } else {
            hidden = false;
        }
        i += 1;
    }
    items
}

/// `pub use a::{B, C as D, e::F};` → B, D, F; `pub use a::B;` → B.
fn imported_names(statement: &str) -> Vec<String> {
    let body = statement
        .trim_start_matches("pub use ")
        .trim_end_matches(';');
    let list = match (body.find('{'), body.rfind('}')) {
        (Some(open), Some(close)) => &body[open + 1..close],
        _ => body,
    };
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            let name = item.rsplit(" as ").next().unwrap_or(item);
            name.rsplit("::").next().unwrap_or(name).trim().to_owned()
        })
        .collect()
}

#[test]
fn the_root_holds_at_most_twenty_items() {
    let lib = fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs"))
        .expect("src/lib.rs is readable");
    let items = root_items(&lib);
    assert!(
        items.len() <= MAX_ROOT_ITEMS,
        "the crate root holds {} items, more than {MAX_ROOT_ITEMS}: {items:?}",
        items.len()
    );
    // The count sees what users see: the types every user names first,
    // and the modules for the rest.
    for name in [
        "SyncedCache",
        "Node",
        "Publisher",
        "Table",
        "Error",
        "Result",
        "transport",
    ] {
        assert!(items.iter().any(|i| i == name), "{name} missing: {items:?}");
    }
    assert!(
        !items.iter().any(|i| i == "fuzz"),
        "fuzz is hidden: {items:?}"
    );
}

#[test]
fn the_counter_reads_every_form_of_item() {
    let lib = "\
pub mod a;
#[doc(hidden)]
pub mod hidden;
#[cfg(feature = \"x\")]
#[doc(inline)]
pub use b::{C, D as E};
pub use f::{
    G, H,
    i::J,
};
pub use k::L;
// pub use m::N;
mod private;
";
    assert_eq!(root_items(lib), ["a", "C", "E", "G", "H", "J", "L"]);
}
