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
//! example, and refuse a file with an unknown field (`docs/check_schema.py`).

use std::{fs, path::PathBuf, process::Command};

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
