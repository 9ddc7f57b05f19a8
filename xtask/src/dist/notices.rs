//! The licences of the third-party crates compiled into the daemon, for the package and the
//! image: the MIT, BSD and Apache licences ask that their notices travel with the binary.
//!
//! The crates are those `cargo metadata` resolves for the host from `proxy` and from
//! `proxy-ebpf` (its kernel programs are embedded in the binary), following normal
//! dependencies only (build and dev dependencies leave no code in it). Each is listed with its
//! declared licence expression and the licence files its package ships; a text seen before is
//! referred to rather than repeated.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    fs,
    path::Path,
};

use anyhow::{Context as _, bail};
use serde_json::Value;

use crate::util;

/// Where the package and the image put the text (gzipped).
pub const PATH: &str = "usr/share/doc/proxy/third-party-licences.gz";

/// The packages whose code is in the binary, and where the walk starts.
const ROOTS: &[&str] = &["proxy", "proxy-ebpf"];

/// The text of [`PATH`], uncompressed.
pub fn text() -> anyhow::Result<String> {
    let out = util::output(
        util::cargo()
            .args(["metadata", "--format-version", "1", "--filter-platform"])
            .arg(crate::deps::host_triple()?),
        "cargo metadata",
    )?;
    let meta: Value = serde_json::from_str(&out).context("reading cargo metadata's answer")?;
    let packages: BTreeMap<&str, &Value> = meta["packages"]
        .as_array()
        .context("cargo metadata has no packages")?
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let mut edges: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for node in meta["resolve"]["nodes"]
        .as_array()
        .context("no resolve graph")?
    {
        let id = node["id"].as_str().context("a node without an id")?;
        let normal = node["deps"].as_array().into_iter().flatten().filter(|d| {
            d["dep_kinds"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k["kind"].is_null()))
        });
        edges.insert(id, normal.filter_map(|d| d["pkg"].as_str()).collect());
    }
    let roots: Vec<&str> = packages
        .iter()
        .filter(|(_, p)| p["source"].is_null() && ROOTS.contains(&p["name"].as_str().unwrap_or("")))
        .map(|(id, _)| *id)
        .collect();
    if roots.len() != ROOTS.len() {
        bail!("cargo metadata lacks one of the packages {ROOTS:?}");
    }
    let mut crates = Vec::new();
    for id in reachable(&roots, &edges) {
        let package = packages
            .get(id)
            .with_context(|| format!("no package {id}"))?;
        if package["source"].is_null() {
            continue; // the workspace's own: packaging/copyright covers them
        }
        let manifest = package["manifest_path"]
            .as_str()
            .context("no manifest_path")?;
        crates.push(Crate {
            name: format!(
                "{} {}",
                package["name"].as_str().unwrap_or("?"),
                package["version"].as_str().unwrap_or("?")
            ),
            licence: package["license"]
                .as_str()
                .unwrap_or("(none declared)")
                .to_owned(),
            files: licence_files(Path::new(manifest).parent().context("manifest dir")?)?,
        });
    }
    crates.sort_by(|a, b| a.name.cmp(&b.name));
    render(&crates)
}

/// Every id reachable from `roots` along `edges`, each once.
fn reachable<'a>(roots: &[&'a str], edges: &BTreeMap<&'a str, Vec<&'a str>>) -> BTreeSet<&'a str> {
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut pending = roots.to_vec();
    while let Some(id) = pending.pop() {
        if seen.insert(id) {
            pending.extend(edges.get(id).into_iter().flatten().copied());
        }
    }
    seen
}

/// A crate: `name version`, its licence expression, its licence files (name, text).
struct Crate {
    name: String,
    licence: String,
    files: Vec<(String, String)>,
}

/// The files of a crate's package that carry its licence or notices, sorted by name.
fn licence_files(dir: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let upper = name.to_ascii_uppercase();
        let wanted = ["LICENSE", "LICENCE", "COPYING", "NOTICE", "COPYRIGHT"]
            .iter()
            .any(|p| upper.starts_with(p));
        if wanted && entry.file_type()?.is_file() {
            let text = fs::read(entry.path())?;
            files.push((name, String::from_utf8_lossy(&text).into_owned()));
        }
    }
    files.sort();
    Ok(files)
}

fn render(crates: &[Crate]) -> anyhow::Result<String> {
    let rule = "=".repeat(72);
    let mut out = String::new();
    writeln!(
        out,
        "Third-party crates compiled into /usr/sbin/proxy (its kernel programs included), each\n\
         with the licence it declares and the licence files its package ships. Written by\n\
         `cargo xtask dist` from the workspace's Cargo.lock; {} crates.",
        crates.len()
    )?;
    let mut first_seen: BTreeMap<&str, String> = BTreeMap::new();
    for krate in crates {
        write!(out, "\n{rule}\n{}: {}\n", krate.name, krate.licence)?;
        if krate.files.is_empty() {
            writeln!(out, "(its package ships no licence file)")?;
        }
        for (file, text) in &krate.files {
            if let Some(earlier) = first_seen.get(text.as_str()) {
                writeln!(out, "--- {file}: the same text as {earlier}")?;
            } else {
                writeln!(out, "--- {file}\n{}", text.trim_end())?;
                first_seen.insert(text, format!("{}'s {file}", krate.name));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_walk_follows_every_path_once() {
        let edges = BTreeMap::from([
            ("proxy", vec!["a", "b"]),
            ("proxy-ebpf", vec!["b", "e"]),
            ("a", vec!["c"]),
            ("b", vec!["c", "a"]),
            ("c", vec![]),
            ("unused", vec!["d"]),
        ]);
        let found: Vec<_> = reachable(&["proxy", "proxy-ebpf"], &edges)
            .into_iter()
            .collect();
        assert_eq!(found, ["a", "b", "c", "e", "proxy", "proxy-ebpf"]);
    }

    #[test]
    fn a_licence_text_is_written_once() {
        let mit = |holder: &str| format!("MIT\nCopyright {holder}\n");
        let apache = "Apache License 2.0 ...\n".to_owned();
        let crates = [
            Crate {
                name: "a 1.0.0".into(),
                licence: "MIT OR Apache-2.0".into(),
                files: vec![
                    ("LICENSE-APACHE".into(), apache.clone()),
                    ("LICENSE-MIT".into(), mit("A")),
                ],
            },
            Crate {
                name: "b 2.0.0".into(),
                licence: "MIT OR Apache-2.0".into(),
                files: vec![
                    ("LICENSE-APACHE".into(), apache),
                    ("LICENSE-MIT".into(), mit("B")),
                ],
            },
            Crate {
                name: "c 0.1.0".into(),
                licence: "ISC".into(),
                files: vec![],
            },
        ];
        let text = render(&crates).unwrap();
        assert_eq!(text.matches("Apache License 2.0").count(), 1, "{text}");
        assert!(text.contains("--- LICENSE-APACHE: the same text as a 1.0.0's LICENSE-APACHE"));
        assert!(text.contains("Copyright A") && text.contains("Copyright B"));
        assert!(text.contains("c 0.1.0: ISC\n(its package ships no licence file)"));
        assert!(text.contains("; 3 crates."));
    }
}
