//! Keeps the daemon crate small enough to read: no source file over [`MAX_LINES`] lines (issue
//! #40: the daemon crate is wiring only). A test, not code: it names each file over the bound.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// The most lines a file of this crate may have.
const MAX_LINES: usize = 500;

/// How deep `src/` nests, and then some: a bound for the walk.
const MAX_DEPTH: usize = 8;

/// Every `.rs` file at or under `path`.
fn rust_files(path: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    assert!(depth <= MAX_DEPTH, "{}: nested too deep", path.display());
    if path.is_dir() {
        let entries = fs::read_dir(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for entry in entries {
            let entry = entry.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            rust_files(&entry.path(), depth + 1, out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_owned());
    }
}

#[test]
fn no_file_is_over_the_bound() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, 0, &mut files);
    assert!(files.len() > 10, "the walk found the sources: {files:?}");
    let over: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let text = fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            let lines = text.lines().count();
            (lines > MAX_LINES).then(|| format!("{}: {lines} lines", f.display()))
        })
        .collect();
    assert!(
        over.is_empty(),
        "over {MAX_LINES} lines (split by what the parts do): {over:?}"
    );
}
