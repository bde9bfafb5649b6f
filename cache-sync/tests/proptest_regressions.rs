//! Proptest re-runs the seeds saved in `proptest-regressions/<path>.txt`
//! only for the source file `src/<path>.rs`: a file left behind when its
//! tests moved holds seeds that silently never run again. Each saved file
//! must name a source file that still holds a proptest.

use std::fs;
use std::path::{Path, PathBuf};

fn saved(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("proptest-regressions is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            saved(&path, out);
        } else {
            out.push(path);
        }
    }
}

#[test]
fn every_saved_seed_file_belongs_to_a_proptest() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let regressions = root.join("proptest-regressions");
    let mut files = Vec::new();
    saved(&regressions, &mut files);
    assert!(
        !files.is_empty(),
        "no saved seeds found; is the path right?"
    );
    let mut stale = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&regressions).unwrap();
        let source = root.join("src").join(rel).with_extension("rs");
        let holds_a_proptest = rel.extension().is_some_and(|e| e == "txt")
            && fs::read_to_string(&source).is_ok_and(|code| code.contains("proptest!"));
        if !holds_a_proptest {
            stale.push(format!(
                "proptest-regressions/{} (no proptest in src/{})",
                rel.display(),
                rel.with_extension("rs").display()
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "saved seeds that proptest no longer reads; move them beside their test:\n{}",
        stale.join("\n")
    );
}
