//! Small helpers: the workspace root, running commands with progress lines, root checks.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

/// When the first step began: progress lines show the time since, so a log says where a long
/// run (`cargo xtask test` in CI) spent it.
static STARTED: std::sync::LazyLock<std::time::Instant> =
    std::sync::LazyLock::new(std::time::Instant::now);

/// Prints a progress line for a step, with the minutes and seconds since the first one.
pub fn step(msg: impl std::fmt::Display) {
    let secs = STARTED.elapsed().as_secs();
    eprintln!("==> [{:02}:{:02}] {msg}", secs / 60, secs % 60);
}

/// Prints a detail line under a step.
pub fn detail(msg: impl std::fmt::Display) {
    eprintln!("    {msg}");
}

/// The cargo that runs us (so nested builds use the same toolchain).
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs `cmd` with inherited output; fails with `what` when it exits non-zero.
pub fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` and returns its stdout; stderr is inherited.
pub fn output(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!("{what} failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether we run as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Fails with a clear message unless running as root.
pub fn require_root(task: &str) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "{task} needs root (it loads eBPF programs, creates cgroups and network namespaces); run it as root"
        );
    }
    Ok(())
}

/// The cargo target directory of the workspace.
pub fn target_dir() -> anyhow::Result<PathBuf> {
    let out = output(
        cargo().args(["metadata", "--format-version", "1", "--no-deps"]),
        "cargo metadata",
    )?;
    let meta: serde_json::Value = serde_json::from_str(&out).context("parsing cargo metadata")?;
    let dir = meta["target_directory"]
        .as_str()
        .context("cargo metadata has no target_directory")?;
    Ok(PathBuf::from(dir))
}

/// Builds the daemon (and with it the kernel programs) and returns the binary's path.
pub fn build_proxy() -> anyhow::Result<PathBuf> {
    step("building the daemon and its kernel programs (a cold build takes a few minutes)");
    run(
        cargo().args(["build", "--package", "proxy"]),
        "cargo build -p proxy",
    )?;
    Ok(target_dir()?.join("debug").join("proxy"))
}

/// What the root-only suite runs: the daemon, the benchmark harness and every test binary of
/// `integration-tests` with its target's name (`kernel_path`, ...), by name.
pub struct Suite {
    /// The daemon (debug build), with its kernel programs embedded.
    pub proxy: PathBuf,
    /// The benchmark harness (`proxy-bench`).
    pub bench: PathBuf,
    /// The integration test executables, sorted by name.
    pub tests: Vec<(String, PathBuf)>,
}

impl Suite {
    /// Builds all of it in one cargo invocation. One invocation resolves the dependencies'
    /// features once: separate `cargo build -p proxy`, `cargo test -p integration-tests` and
    /// `cargo build -p proxy-bench` runs each resolve them differently (dev-dependencies count
    /// only where tests are built), and each difference compiled tokio, hyper, tonic and the
    /// kernel programs again. With the features of the unit-test build (`cargo test
    /// --workspace`), this build only compiles and links the binaries themselves.
    pub fn build() -> anyhow::Result<Self> {
        step(
            "building the daemon, its kernel programs, the benchmark harness and the integration tests",
        );
        let out = output(
            cargo().args([
                "build",
                "--package",
                "proxy",
                "--package",
                "proxy-bench",
                "--package",
                "integration-tests",
                "--bin",
                "proxy",
                "--bin",
                "proxy-bench",
                "--tests",
                "--message-format=json-render-diagnostics",
            ]),
            "cargo build (the daemon, the harness, the integration tests)",
        )?;
        let mut proxy = None;
        let mut bench = None;
        let mut tests = Vec::new();
        for line in out.lines().filter(|l| l.starts_with('{')) {
            let msg: serde_json::Value =
                serde_json::from_str(line).context("cargo's JSON output")?;
            let (Some(name), Some(exe)) =
                (msg["target"]["name"].as_str(), msg["executable"].as_str())
            else {
                continue;
            };
            let exe = PathBuf::from(exe);
            // `--tests` builds the other two packages' unit tests too (the unit-test step's
            // artifacts, so no work): only integration-tests' run here.
            let suite = msg["package_id"]
                .as_str()
                .is_some_and(|id| id.contains("#integration-tests@"));
            match (msg["profile"]["test"].as_bool() == Some(true), name) {
                (true, _) if suite => tests.push((name.to_owned(), exe)),
                (true, _) => {}
                (false, "proxy") => proxy = Some(exe),
                (false, "proxy-bench") => bench = Some(exe),
                _ => {}
            }
        }
        if tests.is_empty() {
            bail!("integration-tests has no test binaries");
        }
        tests.sort();
        tests.dedup();
        Ok(Self {
            proxy: proxy.context("cargo built no `proxy` binary")?,
            bench: bench.context("cargo built no `proxy-bench` binary")?,
            tests,
        })
    }
}
