//! `cargo xtask setup`: install, idempotently, what a fresh machine lacks.
//!
//! 1. rust-src for the toolchain that builds everything (the eBPF crate is built with
//!    `-Z build-std=core`, which needs the standard library's source).
//! 2. bpf-linker, built from source against that toolchain's own shared LLVM: the LLVM major
//!    comes from `rustc -vV`, and an installed bpf-linker is kept only if it loads exactly that
//!    toolchain's libLLVM.
//! 3. The Debian packages the tests use.
//! 4. A Python venv (`.venv`) with the packages of `tests/xds/requirements.txt`.
//! 5. rustfmt of the nightly toolchain, which the style gate formats with (see `lint.rs`).
//!
//! Each step checks first and skips when there is nothing to do, so a second run takes seconds.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::util::{self, detail, step};

/// The bpf-linker release that works with aya 0.14 and LLVM 21-23.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Debian packages and a file each one installs (checked instead of asking dpkg per package).
const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    ("iproute2", "/usr/bin/ip"),
    ("unbound", "/usr/sbin/unbound"),
    ("bind9-dnsutils", "/usr/bin/dig"),
    ("curl", "/usr/bin/curl"),
    ("nftables", "/usr/sbin/nft"),
    ("socat", "/usr/bin/socat"),
];

pub fn run() -> anyhow::Result<()> {
    let toolchain = Toolchain::detect()?;
    step(format!(
        "toolchain {} (rustc {}, LLVM {})",
        toolchain.name, toolchain.release, toolchain.llvm_version
    ));
    ensure_rust_src(&toolchain)?;
    ensure_bpf_linker(&toolchain)?;
    ensure_nightly_rustfmt()?;
    ensure_debian_packages(DEBIAN_PACKAGES)?;
    ensure_python_venv()?;
    crate::qemu::ensure_qemu()?;
    crate::consul::ensure_consul()?;
    step("setup complete");
    Ok(())
}

/// The Rust toolchain cargo runs us with.
struct Toolchain {
    name: String,
    release: String,
    llvm_version: String,
    sysroot: PathBuf,
}

impl Toolchain {
    fn detect() -> anyhow::Result<Self> {
        let name = std::env::var("RUSTUP_TOOLCHAIN").unwrap_or_else(|_| "stable".to_owned());
        let vv = util::output(Command::new("rustc").args(["-vV"]), "rustc -vV")?;
        let field = |key: &str| {
            vv.lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_owned())
                .with_context(|| format!("rustc -vV has no `{key}` line"))
        };
        let sysroot = util::output(
            Command::new("rustc").args(["--print", "sysroot"]),
            "rustc --print sysroot",
        )?;
        Ok(Self {
            name,
            release: field("release:")?,
            llvm_version: field("LLVM version:")?,
            sysroot: PathBuf::from(sysroot.trim()),
        })
    }

    fn llvm_major(&self) -> anyhow::Result<u32> {
        self.llvm_version
            .split('.')
            .next()
            .and_then(|m| m.parse().ok())
            .with_context(|| format!("cannot read the LLVM major from {:?}", self.llvm_version))
    }

    /// The toolchain's shared LLVM library, e.g. `libLLVM.so.22.1-rust-1.95.0-stable`.
    fn libllvm(&self) -> anyhow::Result<String> {
        let lib = self.sysroot.join("lib");
        let mut found = fs::read_dir(&lib)
            .with_context(|| format!("reading {}", lib.display()))?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.starts_with("libLLVM.so."))
            .collect::<Vec<_>>();
        found.sort();
        found.into_iter().next().with_context(|| {
            format!(
                "{} has no libLLVM.so.*: this toolchain cannot host bpf-linker",
                lib.display()
            )
        })
    }
}

fn ensure_rust_src(tc: &Toolchain) -> anyhow::Result<()> {
    let core = tc
        .sysroot
        .join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if core.exists() {
        detail("rust-src: installed");
        return Ok(());
    }
    step(format!("installing rust-src for {}", tc.name));
    util::run(
        Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", &tc.name]),
        "rustup component add rust-src",
    )
    .context(
        "rustup could not download rust-src; check that the machine reaches rustup's download \
         server, then rerun `cargo xtask setup`",
    )
}

/// The style gate's formatter: nightly rustfmt (the repository's rustfmt.toml uses options that
/// only nightly applies). Installed with the minimal profile when the toolchain or the component
/// is missing.
fn ensure_nightly_rustfmt() -> anyhow::Result<()> {
    let tc = crate::lint::FMT_TOOLCHAIN;
    let present = Command::new("rustup")
        .args(["run", tc, "rustfmt", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        detail(format!("rustfmt ({tc}): installed"));
        return Ok(());
    }
    let have_toolchain = Command::new("rustup")
        .args(["run", tc, "rustc", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    // An installed nightly only gets the component: `toolchain install` would also move it to
    // today's nightly.
    let mut rustup = Command::new("rustup");
    if have_toolchain {
        step(format!(
            "installing rustfmt for the installed {tc} toolchain"
        ));
        rustup.args(["component", "add", "rustfmt", "--toolchain", tc]);
    } else {
        step(format!(
            "installing the {tc} toolchain (minimal) with rustfmt"
        ));
        rustup.args([
            "toolchain",
            "install",
            tc,
            "--profile",
            "minimal",
            "--component",
            "rustfmt",
        ]);
    }
    util::run(&mut rustup, "rustup (nightly rustfmt)").context(
        "rustup could not download nightly rustfmt; check that the machine reaches rustup's \
         download server, then rerun `cargo xtask setup`",
    )
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cargo"),
        PathBuf::from,
    )
}

fn ensure_bpf_linker(tc: &Toolchain) -> anyhow::Result<()> {
    let soname = tc.libllvm()?;
    let linker = cargo_home().join("bin/bpf-linker");
    if linker.exists() && links_against(&linker, &soname)? {
        detail(format!(
            "bpf-linker {BPF_LINKER_VERSION}: installed, uses {soname}"
        ));
        return Ok(());
    }
    let major = tc.llvm_major()?;
    step(format!(
        "building bpf-linker {BPF_LINKER_VERSION} against {soname} (LLVM {major}); about 3 minutes"
    ));
    // bpf-linker links `-lLLVM` from $LLVM_PREFIX/lib and finds it at run time through the soname:
    // point both names at the toolchain's own library, in a directory that outlives this run.
    let prefix = cargo_home().join("proxy-llvm").join(&soname);
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    let target = tc.sysroot.join("lib").join(&soname);
    for name in ["libLLVM.so", soname.as_str()] {
        let link = lib.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("linking {} -> {}", link.display(), target.display()))?;
    }
    util::run(
        util::cargo()
            .args([
                "install",
                "bpf-linker",
                "--locked",
                "--force",
                "--no-default-features",
            ])
            .args([
                "--version",
                BPF_LINKER_VERSION,
                "--features",
                &format!("llvm-{major}"),
            ])
            .env("LLVM_PREFIX", &prefix),
        "cargo install bpf-linker",
    )
    .context(
        "building bpf-linker failed; if a crate could not be downloaded, check access to the \
         crate registry and rerun `cargo xtask setup`",
    )?;
    if !links_against(&linker, &soname)? {
        bail!(
            "the new bpf-linker at {} does not load {soname}",
            linker.display()
        );
    }
    Ok(())
}

/// Whether `binary` resolves its libLLVM to exactly `soname` (ldd prints `name => path`).
fn links_against(binary: &Path, soname: &str) -> anyhow::Result<bool> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.lines().any(|l| {
        let l = l.trim();
        l.starts_with(soname) && !l.contains("not found")
    }))
}

/// Installs those of `packages` (name, a file it installs) whose file is missing; also used by
/// `cargo xtask dist` for the tools only it needs.
pub fn ensure_debian_packages(packages: &[(&str, &str)]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(_, file)| !Path::new(file).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        detail(format!(
            "Debian packages: installed ({})",
            packages
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", ")
        ));
        return Ok(());
    }
    if !util::is_root() {
        bail!(
            "missing Debian packages {missing:?}; run `cargo xtask setup` as root, or `apt-get install -y {}`",
            missing.join(" ")
        );
    }
    step(format!("installing Debian packages: {}", missing.join(" ")));
    let _policy = NoServiceStarts::install();
    let install = |update: bool| -> anyhow::Result<()> {
        if update {
            util::run(
                Command::new("apt-get").args(["update", "-q"]),
                "apt-get update",
            )?;
        }
        util::run(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(&missing)
                .env("DEBIAN_FRONTEND", "noninteractive"),
            "apt-get install",
        )
    };
    install(false).or_else(|_| install(true)).with_context(|| {
        format!(
            "apt-get could not install {missing:?}; check access to the Debian mirrors, then \
             rerun `cargo xtask setup`"
        )
    })
}

/// Keeps apt from starting the services of packages it installs (unbound would take port 53):
/// a `policy-rc.d` that refuses every start, removed again on drop if we created it.
struct NoServiceStarts(Option<PathBuf>);

impl NoServiceStarts {
    fn install() -> Self {
        let path = PathBuf::from("/usr/sbin/policy-rc.d");
        if path.exists() {
            return Self(None);
        }
        let written = fs::write(
            &path,
            "#!/bin/sh\n# written by cargo xtask setup\nexit 101\n",
        )
        .and_then(|()| {
            use std::os::unix::fs::PermissionsExt as _;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
        });
        Self(written.is_ok().then_some(path))
    }
}

impl Drop for NoServiceStarts {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = fs::remove_file(path);
        }
    }
}

fn ensure_python_venv() -> anyhow::Result<()> {
    let root = util::workspace_root();
    let requirements = root.join("tests/xds/requirements.txt");
    let Ok(wanted) = fs::read_to_string(&requirements) else {
        detail("Python venv: no tests/xds/requirements.txt, nothing to install");
        return Ok(());
    };
    let venv = root.join(".venv");
    let stamp = venv.join(".proxy-requirements");
    if fs::read_to_string(&stamp).is_ok_and(|have| have == wanted) {
        detail("Python venv: up to date (.venv)");
        return Ok(());
    }
    step("creating the Python venv .venv for the test servers");
    if !venv.join("bin/python").exists() {
        util::run(
            Command::new("python3").args(["-m", "venv"]).arg(&venv),
            "python3 -m venv",
        )?;
    }
    util::run(
        Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "--disable-pip-version-check", "-r"])
            .arg(&requirements),
        "pip install",
    )
    .context(
        "pip could not install tests/xds/requirements.txt; check access to the Python package \
         index, then rerun `cargo xtask setup`",
    )?;
    fs::write(&stamp, wanted).context("writing the venv stamp")?;
    Ok(())
}
