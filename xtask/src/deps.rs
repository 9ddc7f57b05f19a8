//! The dependency policy, a gate of `cargo xtask lint`: every crate the workspace compiles for
//! this host (normal, build and dev dependencies) comes from the one registry cargo is set up
//! with or from the workspace itself (no git source, no path outside the checkout), carries a
//! licence the policy allows, and exists in one version unless [`DUPLICATES`] says why two are
//! needed. An exception that no longer applies fails too, so the lists stay true.
//!
//! Read from `cargo metadata --filter-platform <host>`: what is resolved, not what a manifest
//! asks for.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
};

use anyhow::{Context as _, bail};
use serde::Deserialize;

/// Licences a dependency may be under (one alternative of its expression must consist of
/// these only), each with why it is acceptable here.
const LICENCES: &[(&str, &str)] = &[
    ("MIT", "permissive"),
    ("Apache-2.0", "permissive, with a patent grant"),
    (
        "Apache-2.0 WITH LLVM-exception",
        "Apache-2.0 plus an exception that only removes obligations",
    ),
    ("BSD-2-Clause", "permissive"),
    ("BSD-3-Clause", "permissive"),
    ("ISC", "permissive (MIT-like)"),
    ("Zlib", "permissive"),
    ("0BSD", "permissive, no attribution"),
    ("BSL-1.0", "permissive (Boost)"),
    ("Unlicense", "public-domain dedication"),
    (
        "Unicode-3.0",
        "the Unicode data licence of the ICU crates url needs (permissive)",
    ),
];

/// Crates allowed in two versions, each with who needs which. Everything here is a crate whose
/// dependents have not all moved to its latest major version yet.
const DUPLICATES: &[(&str, &str)] = &[
    (
        "base64",
        "tonic 0.14 uses 0.22; rcgen's pem (dev-dependency of proxy-core) uses 0.23",
    ),
    (
        "foldhash",
        "hashbrown 0.15 (yaml-rust2's hashlink) and hashbrown 0.17 (indexmap) each pin theirs",
    ),
    (
        "getrandom",
        "ring uses 0.2; hickory's rand 0.10 and uuid use 0.4",
    ),
    (
        "hashbrown",
        "yaml-rust2's hashlink uses 0.15; indexmap uses 0.17",
    ),
    (
        "syn",
        "most proc macros use 2.x; a few of the newest use 3.x",
    ),
    (
        "synstructure",
        "follows syn: 0.13 for syn 2 users, 0.14 for syn 3 users",
    ),
];

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
    resolve: Resolve,
    workspace_root: String,
}

#[derive(Deserialize)]
struct Package {
    id: String,
    name: String,
    version: String,
    license: Option<String>,
    source: Option<String>,
    manifest_path: String,
}

#[derive(Deserialize)]
struct Resolve {
    nodes: Vec<Node>,
}

#[derive(Deserialize)]
struct Node {
    id: String,
}

/// Checks the policy; the error lists every breach.
pub fn check() -> anyhow::Result<()> {
    let metadata = metadata()?;
    let breaches = breaches(&metadata);
    if breaches.is_empty() {
        return Ok(());
    }
    bail!(
        "the dependency policy (xtask/src/deps.rs) is broken:\n  {}",
        breaches.join("\n  ")
    )
}

fn metadata() -> anyhow::Result<Metadata> {
    let host = host_triple()?;
    let out = crate::util::cargo()
        .args(["metadata", "--format-version", "1", "--filter-platform"])
        .arg(&host)
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("reading cargo metadata's answer")
}

pub fn host_triple() -> anyhow::Result<String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .context("running rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("rustc -vV names no host")
}

/// Every breach of the policy by the resolved packages, readable.
fn breaches(metadata: &Metadata) -> Vec<String> {
    let resolved: BTreeSet<&str> = metadata
        .resolve
        .nodes
        .iter()
        .map(|n| n.id.as_str())
        .collect();
    let packages: Vec<&Package> = metadata
        .packages
        .iter()
        .filter(|p| resolved.contains(p.id.as_str()))
        .collect();
    let root = Path::new(&metadata.workspace_root);
    let mut breaches = Vec::new();
    let registries: BTreeSet<&str> = packages
        .iter()
        .filter_map(|p| p.source.as_deref())
        .collect();
    for p in &packages {
        match p.source.as_deref() {
            None if !Path::new(&p.manifest_path).starts_with(root) => breaches.push(format!(
                "{} {}: a path dependency outside the workspace ({})",
                p.name, p.version, p.manifest_path
            )),
            Some(source) if !source.starts_with("registry+") && !source.starts_with("sparse+") => {
                breaches.push(format!(
                    "{} {}: not from a registry ({source})",
                    p.name, p.version
                ));
            }
            _ => {}
        }
        match p.license.as_deref() {
            None => breaches.push(format!("{} {}: no licence declared", p.name, p.version)),
            Some(expr) if !allowed(expr) => breaches.push(format!(
                "{} {}: licence {expr:?} has no alternative made of allowed licences",
                p.name, p.version
            )),
            Some(_) => {}
        }
    }
    if registries.len() > 1 {
        breaches.push(format!("more than one registry: {registries:?}"));
    }
    breaches.extend(duplicate_breaches(&packages));
    breaches
}

fn duplicate_breaches(packages: &[&Package]) -> Vec<String> {
    let mut versions: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for p in packages {
        versions.entry(&p.name).or_default().insert(&p.version);
    }
    let explained: BTreeMap<&str, &str> = DUPLICATES.iter().copied().collect();
    let mut breaches = Vec::new();
    for (name, versions) in &versions {
        if versions.len() > 1 && !explained.contains_key(name) {
            breaches.push(format!(
                "{name} in {} versions ({versions:?}): align them or explain the exception in DUPLICATES",
                versions.len()
            ));
        }
    }
    for name in explained.keys() {
        if versions.get(name).is_none_or(|v| v.len() < 2) {
            breaches.push(format!(
                "{name}: one version only now; remove its exception from DUPLICATES"
            ));
        }
    }
    breaches
}

/// Whether an SPDX licence expression (with the older `/` for OR) has an alternative made of
/// [`LICENCES`] only.
fn allowed(expr: &str) -> bool {
    let spaced = expr
        .replace('/', " OR ")
        .replace('(', " ( ")
        .replace(')', " ) ");
    let tokens: Vec<&str> = spaced.split_whitespace().collect();
    let mut at = 0;
    let ok = parse_or(&tokens, &mut at);
    ok == Some(true) && at == tokens.len()
}

/// `a OR b OR ...`: allowed when any part is. `None` for a malformed expression.
fn parse_or(tokens: &[&str], at: &mut usize) -> Option<bool> {
    let mut any = parse_and(tokens, at)?;
    while tokens.get(*at) == Some(&"OR") {
        *at += 1;
        any |= parse_and(tokens, at)?;
    }
    Some(any)
}

/// `a AND b AND ...`: allowed when every part is.
fn parse_and(tokens: &[&str], at: &mut usize) -> Option<bool> {
    let mut all = parse_one(tokens, at)?;
    while tokens.get(*at) == Some(&"AND") {
        *at += 1;
        all &= parse_one(tokens, at)?;
    }
    Some(all)
}

/// A licence (with its `WITH` exception), or a parenthesised expression.
fn parse_one(tokens: &[&str], at: &mut usize) -> Option<bool> {
    let token = *tokens.get(*at)?;
    *at += 1;
    if token == "(" {
        let inner = parse_or(tokens, at)?;
        (tokens.get(*at) == Some(&")")).then_some(())?;
        *at += 1;
        return Some(inner);
    }
    if matches!(token, ")" | "OR" | "AND" | "WITH") {
        return None;
    }
    let licence = if tokens.get(*at) == Some(&"WITH") {
        let exception = tokens.get(*at + 1)?;
        *at += 2;
        format!("{token} WITH {exception}")
    } else {
        token.to_owned()
    };
    Some(LICENCES.iter().any(|(name, _)| *name == licence))
}

#[cfg(test)]
mod tests {
    use super::{Metadata, Node, Package, Resolve, allowed, breaches};

    fn package(name: &str, version: &str, license: &str, source: Option<&str>) -> Package {
        Package {
            id: format!("{name}@{version}"),
            name: name.to_owned(),
            version: version.to_owned(),
            license: Some(license.to_owned()),
            source: source.map(str::to_owned),
            manifest_path: format!("/src/ws/{name}/Cargo.toml"),
        }
    }

    fn metadata(packages: Vec<Package>) -> Metadata {
        let nodes = packages.iter().map(|p| Node { id: p.id.clone() }).collect();
        Metadata {
            packages,
            resolve: Resolve { nodes },
            workspace_root: "/src/ws".to_owned(),
        }
    }

    const REGISTRY: Option<&str> = Some("registry+https://registry.invalid/index");

    #[test]
    fn a_clean_graph_passes_but_each_breach_is_named() {
        // Every duplicate the policy explains, present twice: nothing to report.
        let explained = super::DUPLICATES
            .iter()
            .flat_map(|(name, _)| ["1.0.0", "2.0.0"].map(|v| package(name, v, "MIT", REGISTRY)))
            .collect();
        assert_eq!(breaches(&metadata(explained)), Vec::<String>::new());

        let mut packages = vec![
            package("ours", "0.1.0", "MIT OR Apache-2.0", None),
            package("dup", "1.0.0", "MIT", REGISTRY),
            package("dup", "2.0.0", "MIT", REGISTRY),
            package("viral", "1.0.0", "GPL-3.0-only", REGISTRY),
            package(
                "fromgit",
                "1.0.0",
                "MIT",
                Some("git+https://example.invalid/x"),
            ),
        ];
        let mut outside = package("outside", "1.0.0", "MIT", None);
        outside.manifest_path = "/elsewhere/outside/Cargo.toml".to_owned();
        packages.push(outside);
        let found = breaches(&metadata(packages)).join("\n");
        for want in [
            "dup in 2 versions",
            "viral 1.0.0: licence \"GPL-3.0-only\"",
            "fromgit 1.0.0: not from a registry",
            "outside 1.0.0: a path dependency outside the workspace",
            // Each explained duplicate is absent here: its exception is stale.
            "syn: one version only now; remove its exception",
        ] {
            assert!(found.contains(want), "{want:?} not in:\n{found}");
        }
        assert!(!found.contains("ours"), "{found}");
    }

    #[test]
    fn an_expression_is_allowed_when_one_alternative_is_all_allowed() {
        for ok in [
            "MIT",
            "MIT OR Apache-2.0",
            "MIT/Apache-2.0",
            "Apache-2.0 WITH LLVM-exception OR Apache-2.0 OR MIT",
            "(MIT OR Apache-2.0) AND Unicode-3.0",
            "MIT OR Apache-2.0 OR LGPL-2.1-or-later",
            "Apache-2.0 AND ISC",
        ] {
            assert!(allowed(ok), "{ok}");
        }
        for refused in [
            "GPL-3.0-only",
            "MIT AND GPL-3.0-only",
            "(MIT OR Apache-2.0) AND AGPL-3.0-only",
            "GPL-2.0-only WITH Classpath-exception-2.0",
            "MIT OR",
            "(MIT",
            "MIT Apache-2.0",
            "",
        ] {
            assert!(!allowed(refused), "{refused}");
        }
    }
}
