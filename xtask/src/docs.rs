//! `cargo xtask docs`: writes the configuration reference, docs/config-reference.md, and its
//! JSON Schema for editors, docs/config.schema.json, from the code, then checks the schema;
//! `cargo xtask lint` runs the check alone.
//!
//! The generator is a unit test of proxy-core (`field_table::reference`) run with
//! `PROXY_WRITE_DOCS=1`: it needs the configuration's types, and xtask links no product crate.
//! Without the variable the same test fails in `cargo test` when the committed files differ from
//! what the code generates.
//!
//! The check runs `jsonschema` in the Python venv (`tests/xds/requirements.txt`, installed by
//! setup): the schema must be valid, accept every configuration in `examples/` and the README's
//! example, and refuse a file with an unknown field (`docs/check_schema.py`). [`check_pages`]
//! holds the README and ARCHITECTURE.md to their sizes, the README's two commands to `.ci/run`,
//! and every relative link of the repository's pages to a file that exists and, with
//! `#anchor`, to one of its headings.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::util::{self, detail, step};

/// The generated files, from the workspace root.
const SCHEMA: &str = "docs/config.schema.json";

/// The unit test that compares, or writes, the generated files.
const GENERATOR: &str =
    "field_table::reference::the_committed_reference_is_what_the_code_generates";

/// The check's script, run by the venv's Python.
const CHECK: &str = include_str!("docs/check_schema.py");

/// Writes both files, then checks the schema.
pub fn write() -> anyhow::Result<()> {
    step("docs: writing docs/config-reference.md and docs/config.schema.json from the code");
    let mut cmd = util::cargo();
    cmd.env("PROXY_WRITE_DOCS", "1").args([
        "test",
        "-p",
        "proxy-core",
        "--lib",
        "--",
        GENERATOR,
        "--exact",
    ]);
    util::run(&mut cmd, "the reference's generator (proxy-core)")?;
    check()
}

/// Checks the committed schema against JSON Schema and the example configurations.
pub fn check() -> anyhow::Result<()> {
    step(format!(
        "docs: {SCHEMA} is a valid JSON Schema and accepts every example (jsonschema)"
    ));
    let root = util::workspace_root();
    let python = root.join(".venv/bin/python");
    if !python.exists() {
        bail!(
            "no Python venv at {}: run `cargo xtask setup`",
            python.display()
        );
    }
    let dir = util::target_dir()?.join("docs-check");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut files = Vec::new();
    for (name, yaml) in configurations(&root)? {
        let value: serde_json::Value =
            serde_norway::from_str(&yaml).with_context(|| format!("{name} is not YAML"))?;
        let file = dir.join(name.replace('/', "_") + ".json");
        fs::write(&file, serde_json::to_string(&value)?)
            .with_context(|| format!("writing {}", file.display()))?;
        files.push(file);
    }
    detail(format!("{} configurations", files.len()));
    util::run(
        Command::new(python)
            .arg("-c")
            .arg(CHECK)
            .arg(root.join(SCHEMA))
            .args(&files),
        "the schema check",
    )
}

/// Every example configuration (`examples/*.yaml`) and the README's "One example", by name.
fn configurations(root: &std::path::Path) -> anyhow::Result<Vec<(String, String)>> {
    let mut paths: Vec<PathBuf> = fs::read_dir(root.join("examples"))
        .context("reading examples/")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for path in paths {
        let name = format!(
            "examples/{}",
            path.file_name().unwrap_or_default().to_string_lossy()
        );
        let text = fs::read_to_string(&path).with_context(|| format!("reading {name}"))?;
        out.push((name, text));
    }
    let readme = fs::read_to_string(root.join("README.md")).context("reading README.md")?;
    let example = readme
        .split("\n## One example\n")
        .nth(1)
        .and_then(|s| s.split("```yaml\n").nth(1))
        .and_then(|s| s.split("\n```").next())
        .context("README.md has no yaml block under \"One example\"")?;
    out.push(("README.md".to_owned(), example.to_owned()));
    Ok(out)
}

/// The pages with a bound on their length: a newcomer reads the README in five minutes, and
/// ARCHITECTURE.md stays a map of the structure.
const SIZES: &[(&str, usize)] = &[("README.md", 250), ("ARCHITECTURE.md", 400)];

/// The pages' sizes and relative links.
pub fn check_pages() -> anyhow::Result<()> {
    step("docs: README.md and ARCHITECTURE.md within their sizes; every relative link resolves");
    let root = util::workspace_root();
    let mut problems = Vec::new();
    for (page, most) in SIZES {
        let lines = read(&root.join(page))?.lines().count();
        if lines > *most {
            problems.push(format!("{page}: {lines} lines, at most {most}"));
        }
    }
    let ci = read(&root.join(".ci/run"))?;
    if let Err(why) = two_commands(&read(&root.join("README.md"))?, &ci) {
        problems.push(why);
    }
    let mut pages: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "SECURITY.md",
        "BENCHMARKS.md",
    ]
    .iter()
    .map(|p| root.join(p))
    .collect();
    for dir in ["docs", "docs/deploy"] {
        for entry in fs::read_dir(root.join(dir)).with_context(|| format!("reading {dir}"))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    for page in &pages {
        let text = read(page)?;
        let name = page
            .strip_prefix(&root)
            .unwrap_or(page)
            .display()
            .to_string();
        for target in links(&text) {
            if let Err(why) = resolve(page, &target) {
                problems.push(format!("{name}: ({target}): {why}"));
            }
        }
    }
    if !problems.is_empty() {
        bail!(
            "{} problem(s) in the pages:\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    detail(format!("{} pages", pages.len()));
    Ok(())
}

/// The README's "Two commands" are `cargo xtask demo` and `cargo xtask test`, and `.ci/run`
/// runs exactly the second.
fn two_commands(readme: &str, ci: &str) -> Result<(), String> {
    let block = readme
        .split("\n## Two commands\n")
        .nth(1)
        .and_then(|s| s.split("```sh\n").nth(1))
        .and_then(|s| s.split("\n```").next())
        .ok_or("README.md: no sh block under \"Two commands\"")?;
    let commands: Vec<&str> = block
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .collect();
    if commands != ["cargo xtask demo", "cargo xtask test"] {
        return Err(format!("README.md, \"Two commands\": {commands:?}"));
    }
    let last = ci
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.starts_with('#'));
    if last != Some("exec cargo xtask test") {
        return Err(format!(
            ".ci/run ends with {last:?}, not `exec cargo xtask test`"
        ));
    }
    Ok(())
}

fn read(path: &Path) -> anyhow::Result<String> {
    fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// The targets of the markdown links of `text` outside code blocks and spans that point into
/// the repository (not `http:`, `https:` or `mailto:`).
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Outside code spans: the even pieces between backquotes.
        for piece in line.split('`').step_by(2) {
            let mut rest = piece;
            while let Some(at) = rest.find("](") {
                let after = &rest[at + 2..];
                let Some(end) = after.find(')') else { break };
                let target = &after[..end];
                if !target.contains("://") && !target.starts_with("mailto:") && !target.is_empty() {
                    out.push(target.to_owned());
                }
                rest = &after[end..];
            }
        }
    }
    out
}

/// Checks that `target`, a link of `page`, names a file or directory that exists and, after a
/// `#`, a heading of that file.
fn resolve(page: &Path, target: &str) -> Result<(), String> {
    let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
    let file = if path.is_empty() {
        page.to_path_buf()
    } else {
        page.parent().unwrap_or(page).join(path)
    };
    if !file.exists() {
        return Err("no such file".to_owned());
    }
    if anchor.is_empty() {
        return Ok(());
    }
    let text = fs::read_to_string(&file).map_err(|e| e.to_string())?;
    let found = text
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| l.trim_start_matches('#'))
        .filter(|l| l.starts_with(' '))
        .any(|heading| slug(heading) == anchor);
    if found {
        Ok(())
    } else {
        Err(format!("no heading #{anchor}"))
    }
}

/// The anchor a heading gets: lowercase, spaces as `-`, and only letters, digits, `-` and `_`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_and_links_read_as_github_makes_them() {
        assert_eq!(slug(" Proxy path (`mode: proxy`)"), "proxy-path-mode-proxy");
        assert_eq!(
            slug(" Consul catalog (`proxy.clusters.consul`)"),
            "consul-catalog-proxyclustersconsul"
        );
        let text = "see [a](docs/a.md#x) and `[b](no)`, [c](https://e.org)\n```\n[d](no)\n```\n";
        assert_eq!(links(text), ["docs/a.md#x"]);
    }

    #[test]
    fn the_two_commands_and_ci_are_checked() {
        let readme =
            "x\n## Two commands\n\n```sh\ncargo xtask demo    # a\ncargo xtask test    # b\n```\n";
        let ci = "#!/bin/sh\nset -e\nexec cargo xtask test\n";
        assert_eq!(two_commands(readme, ci), Ok(()));
        assert!(two_commands(&readme.replace("xtask test", "test"), ci).is_err());
        assert!(two_commands(readme, "exec cargo test\n").is_err());
    }

    #[test]
    fn a_missing_file_or_heading_is_reported() {
        let dir = std::env::temp_dir().join(format!("xtask-docs-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let page = dir.join("page.md");
        fs::write(&page, "# Page\n\n## A section (`x.y`)\n").unwrap();
        assert_eq!(resolve(&page, "#a-section-xy"), Ok(()));
        assert_eq!(resolve(&page, "page.md"), Ok(()));
        assert_eq!(resolve(&page, "#gone"), Err("no heading #gone".to_owned()));
        assert_eq!(resolve(&page, "other.md"), Err("no such file".to_owned()));
        fs::remove_dir_all(&dir).unwrap();
    }
}
