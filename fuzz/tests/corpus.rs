//! Replays every saved input of every target under plain `cargo test`: the corpora
//! (`corpus/<target>/`, seeds and what the fuzzer kept) and the inputs that once crashed a target
//! (`regressions/<target>/`, kept forever). A regression comes back as a failing test here.

use std::path::{Path, PathBuf};

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_saved_input_of_every_target_runs_clean() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut total = 0;
    for (name, target) in proxy_fuzz::TARGETS {
        let corpus = inputs(&root.join("corpus").join(name));
        assert!(!corpus.is_empty(), "target {name} has no corpus");
        let mut accepted = 0;
        for file in corpus
            .iter()
            .chain(&inputs(&root.join("regressions").join(name)))
        {
            let data = std::fs::read(file).expect("reading an input");
            let outcome = std::panic::catch_unwind(|| target(&data));
            assert!(outcome.is_ok(), "{name}: {} fails", file.display());
            accepted += usize::from(outcome.unwrap_or(false));
            total += 1;
        }
        // The seeds must reach past the parser, or the fuzzer starts from nothing useful.
        assert!(
            accepted > 0,
            "target {name}: no saved input is accepted by its parser"
        );
        println!(
            "{name}: {accepted} of {} saved inputs accepted",
            corpus.len()
        );
    }
    println!("{total} saved inputs replayed");
}
