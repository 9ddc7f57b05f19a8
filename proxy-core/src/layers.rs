//! Keeps the crate's arrows pointing one way: the desired state (`config` with each source's
//! settings, `desired`, `chain`) and the shared host model (`host`) sit below the discovery
//! sources that fill them, so none of their files may name `discovery`. A test, not code: it
//! reads the sources and names each file and line that breaks the rule.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// Files and folders under `src/` that sit below `discovery`.
const BELOW_DISCOVERY: [&str; 6] = [
    "config.rs",
    "config",
    "desired.rs",
    "chain.rs",
    "chain",
    "host.rs",
];

/// How deep the folders below `src/` go, and then some: a bound for the walk.
const MAX_DEPTH: usize = 8;

/// Every `.rs` file at or under `path`.
fn rust_files(path: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    assert!(
        depth <= MAX_DEPTH,
        "{}: folders nested too deep",
        path.display()
    );
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

/// `line` without its comment and without the text of its string literals.
fn code(line: &str) -> String {
    let mut out = String::new();
    let mut in_string = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (in_string, c) {
            (true, '\\') => {
                chars.next();
            }
            (_, '"') => {
                in_string = !in_string;
                out.push('"');
            }
            (true, _) => {}
            (false, '/') if chars.peek() == Some(&'/') => break,
            (false, _) => out.push(c),
        }
    }
    out
}

/// Whether `code` names the `discovery` module: as a path segment (`crate::discovery::x`,
/// `super::discovery`, `discovery::{..}`) or as an item of a use group (`{discovery, ..}`).
fn names_discovery(code: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices("discovery").any(|(i, word)| {
        let (before, after) = (&code[..i], &code[i + word.len()..]);
        if before.ends_with(ident) || after.starts_with(ident) {
            return false;
        }
        let before = before.trim_end();
        let in_group = before.is_empty() || before.ends_with('{') || before.ends_with(',');
        before.ends_with("::")
            || after.trim_start().starts_with("::")
            || (in_group && after.trim_start().starts_with([',', '}']))
    })
}

#[test]
fn nothing_below_discovery_names_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for place in BELOW_DISCOVERY {
        let path = src.join(place);
        assert!(path.exists(), "{}: listed but missing", path.display());
        rust_files(&path, 0, &mut files);
    }
    let mut offenders = Vec::new();
    for file in &files {
        let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for (n, line) in text.lines().enumerate() {
            if names_discovery(&code(line)) {
                let at = file.strip_prefix(&src).unwrap_or(file).display();
                offenders.push(format!("src/{at}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "these files sit below `discovery` and must not name it; move what they need down \
         (settings to config::sources) or the caller up:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_check_sees_every_form_of_the_name() {
    for named in [
        "use crate::discovery::xds::XdsConfig;",
        "    discovery::{dns::QueryLimits, xds},",
        "pub xds: Option<super::discovery::xds::XdsConfig>,",
        "use crate::{discovery, host::Host};",
        "    discovery,",
        "let s = \"//\"; crate::discovery::guard::HostGuard::default();",
    ] {
        assert!(names_discovery(&code(named)), "missed: {named}");
    }
    for clean in [
        "// crate::discovery::xds sits above",
        "//! the `discovery::dns` runtime",
        "\"a discovery chain runs as HTTP routes\"",
        "\"see crate::discovery::xds\"",
        "use crate::rediscovery::x; let discovery_time = 1;",
        "let discovery = 1;",
    ] {
        assert!(!names_discovery(&code(clean)), "false alarm: {clean}");
    }
}
