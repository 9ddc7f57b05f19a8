//! `cargo xtask dist`: the release package and image, from one binary.
//!
//! Builds the daemon in release mode, strips it, and from that one file:
//! 1. a Debian package (`deb.rs`): the daemon as /usr/sbin/proxy, both systemd units, the
//!    sysusers.d entry of its steady-state user, proxy(8), bash, zsh and fish completions, an
//!    example configuration and the licences of the crates compiled in (`notices.rs`), with the
//!    control template and maintainer scripts of `packaging/`;
//! 2. lintian's verdict on it (an error or a warning fails);
//! 3. an install into a scratch root with `dpkg --root`, `proxy check` run from there, and a
//!    purge that must leave nothing of the package behind (`verify.rs`);
//! 4. an OCI image layout written here, offline and without a container tool (`oci.rs`), checked
//!    by unpacking it with umoci and running the binary inside its root file system.
//!
//! `cargo xtask test` runs steps 1-4 on the debug binary it has built ([`check`]), so a change
//! that breaks the package or the image fails the suite without a release build.

mod deb;
mod notices;
mod oci;
mod verify;

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::{
    setup,
    util::{self, detail, step},
};

/// Debian packages only `dist` needs (name, a file it installs): `setup` leaves them out.
const DIST_PACKAGES: &[(&str, &str)] =
    &[("lintian", "/usr/bin/lintian"), ("umoci", "/usr/bin/umoci")];

/// `cargo xtask dist`: writes `target/dist/proxy_<version>_<arch>.deb` and the image layout
/// `target/dist/oci`, each checked as the module documentation says.
pub fn run() -> anyhow::Result<()> {
    require_root()?;
    setup::run()?;
    setup::ensure_debian_packages(DIST_PACKAGES)?;
    step("building the daemon in release mode (a cold build takes several minutes)");
    util::run(
        util::cargo().args(["build", "--release", "--package", "proxy"]),
        "cargo build --release -p proxy",
    )?;
    let binary = util::target_dir()?.join("release").join("proxy");
    let built = build(&binary, &util::target_dir()?.join("dist"), BEST)?;
    built.report();
    Ok(())
}

/// Compression levels (xz for the package, gzip for the image layer): the release's, both
/// tools' default (xz above 6 wants hundreds of MiB), and the check's fastest (it packages a
/// debug build four times the size, in the suite's time).
const BEST: u8 = 6;
const FAST: u8 = 1;

/// The suite's check (`cargo xtask test`, or `cargo xtask dist --binary PATH`): steps 1-4 on an
/// already built `binary`, in `target/dist-check`, compressed for speed.
pub fn check(binary: &Path) -> anyhow::Result<()> {
    require_root()?;
    setup::ensure_debian_packages(DIST_PACKAGES)?;
    build(binary, &util::target_dir()?.join("dist-check"), FAST)?.report();
    Ok(())
}

fn require_root() -> anyhow::Result<()> {
    if !util::is_root() {
        bail!(
            "cargo xtask dist needs root: it installs the package into a scratch root with \
             `dpkg --root` and runs the image's binary with chroot; run it as root"
        );
    }
    Ok(())
}

/// What [`build`] wrote.
struct Built {
    deb: PathBuf,
    image: oci::Image,
}

impl Built {
    fn report(&self) {
        step("packaged and checked");
        detail(format!("package: {}", self.deb.display()));
        let (layout, tag) = (self.image.layout.display(), &self.image.tag);
        detail(format!(
            "image:   {layout} (an OCI image layout, tag {tag}; e.g. `skopeo copy \
             oci:{layout}:{tag} docker-archive:proxy.tar`)"
        ));
    }
}

/// Packages `binary` into `out` (emptied first), compressed at `level`, and checks the results.
fn build(binary: &Path, out: &Path, level: u8) -> anyhow::Result<Built> {
    let facts = Facts::read(binary)
        .with_context(|| format!("{} is not a daemon to package", binary.display()))?;
    if out.exists() {
        fs::remove_dir_all(out).with_context(|| format!("emptying {}", out.display()))?;
    }
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    step(format!(
        "packaging proxy {} ({} build of commit {}) for {}",
        facts.deb_version, facts.profile, facts.commit, facts.architecture
    ));
    let stripped = out.join("proxy");
    util::run(
        Command::new("strip")
            .args(["--remove-section=.comment", "--remove-section=.note", "-o"])
            .arg(&stripped)
            .arg(binary),
        "strip",
    )?;
    let notices = deb::gzip(notices::text()?.as_bytes())?;
    let deb = deb::build(&stripped, &facts, out, level, &notices)?;
    step(format!("lintian {}", deb.display()));
    util::run(
        Command::new("lintian")
            .args(["--fail-on", "error,warning", "--display-info", "--"])
            .arg(&deb),
        "lintian",
    )
    .context("lintian rejects the package (each tag above names the file and the rule)")?;
    step("installing it into a scratch root, running `proxy check` there, purging it");
    verify::install_and_purge(&deb, &facts, &out.join("scratch"))?;
    step("writing the OCI image layout");
    let image = oci::build(&stripped, &facts, out, level, &notices)?;
    step("unpacking the image with umoci and running its binary");
    verify::image(&image, &stripped, &out.join("bundle"))?;
    fs::remove_file(&stripped)?;
    Ok(Built { deb, image })
}

/// What the package and the image say about the binary, read from the binary itself
/// (`proxy --version`) and from the commit it names.
pub struct Facts {
    /// The crate's version, `0.1.0`.
    pub version: String,
    /// The commit the binary was built from (12 hex digits).
    pub commit: String,
    /// `release` or `debug`.
    pub profile: String,
    /// The package's version (see [`deb_version`]).
    pub deb_version: String,
    /// Debian's name of the build machine's architecture (`amd64`).
    pub architecture: String,
    /// The Maintainer field (see [`maintainer`]).
    pub maintainer: String,
    /// The commit's time: seconds since the epoch, RFC 3339 and RFC 2822 (every time stamp in
    /// the package and the image, so that a rebuild writes the same bytes).
    pub epoch: u64,
    pub created_rfc3339: String,
    pub created_rfc2822: String,
}

impl Facts {
    fn read(binary: &Path) -> anyhow::Result<Self> {
        let line = util::output(Command::new(binary).arg("--version"), "proxy --version")?;
        let (version, commit, profile) = parse_version_line(&line)?;
        let git = |args: &[&str]| -> anyhow::Result<String> {
            let mut cmd = Command::new("git");
            cmd.current_dir(util::workspace_root()).args(args);
            Ok(util::output(&mut cmd, &format!("git {}", args.join(" ")))?
                .trim()
                .to_owned())
        };
        let head = git(&["rev-parse", "--short=12", "HEAD"])?;
        if head != commit {
            bail!(
                "{} was built from commit {commit}, but the checkout is at {head}: rebuild it",
                binary.display()
            );
        }
        let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
        let count: u64 = git(&["rev-list", "--count", &commit])?
            .parse()
            .context("git rev-list --count")?;
        let log = git(&["log", "-1", "--format=%ct%n%cI%n%cD%n%an <%ae>", &commit])?;
        let [epoch, rfc3339, rfc2822, author] = log.lines().collect::<Vec<_>>()[..] else {
            bail!("unexpected `git log` output: {log:?}");
        };
        let arch = util::output(
            Command::new("dpkg").arg("--print-architecture"),
            "dpkg --print-architecture",
        )?;
        if dirty {
            detail("the checkout has uncommitted changes: the version says `dirty`");
        }
        Ok(Self {
            deb_version: deb_version(&version, count, &commit, dirty)?,
            version,
            commit,
            profile,
            architecture: arch.trim().to_owned(),
            maintainer: maintainer(
                std::env::var("DEBFULLNAME").ok().as_deref(),
                std::env::var("DEBEMAIL").ok().as_deref(),
                author,
            )?,
            epoch: epoch.parse().context("git log %ct")?,
            created_rfc3339: rfc3339.to_owned(),
            created_rfc2822: rfc2822.to_owned(),
        })
    }
}

/// `proxy 0.1.0 (commit fa4822f0a1b2, release build)` -> (version, commit, profile).
fn parse_version_line(line: &str) -> anyhow::Result<(String, String, String)> {
    let bad = || format!("unexpected `proxy --version` output: {:?}", line.trim());
    let rest = line.trim().strip_prefix("proxy ").with_context(bad)?;
    let (version, rest) = rest.split_once(" (commit ").with_context(bad)?;
    let (commit, rest) = rest.split_once(", ").with_context(bad)?;
    let profile = rest.strip_suffix(" build)").with_context(bad)?;
    if commit == "unknown" {
        bail!("the binary was built outside a git checkout: its commit is unknown");
    }
    if !commit.bytes().all(|b| b.is_ascii_hexdigit()) || version.is_empty() {
        bail!(bad());
    }
    Ok((version.to_owned(), commit.to_owned(), profile.to_owned()))
}

/// The package's version: the crate's, then the commit's count and id, so that each commit's
/// package upgrades the one before (`0.1.0+git412.fa4822f0a1b2`). A native package, so no
/// Debian revision: a pre-release's `-` becomes `~`, which sorts before the release. A checkout
/// with uncommitted changes adds `.dirty`.
fn deb_version(version: &str, count: u64, commit: &str, dirty: bool) -> anyhow::Result<String> {
    if !version.starts_with(|c: char| c.is_ascii_digit())
        || !version
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+'))
    {
        bail!("the crate version {version:?} cannot be made into a Debian version");
    }
    let dirty = if dirty { ".dirty" } else { "" };
    Ok(format!(
        "{}+git{count}.{commit}{dirty}",
        version.replace('-', "~")
    ))
}

/// The Maintainer field: Debian's own variables (`DEBFULLNAME` and `DEBEMAIL`, or `DEBEMAIL`
/// as `Name <address>`) when set, else the author of the commit built.
fn maintainer(fullname: Option<&str>, email: Option<&str>, author: &str) -> anyhow::Result<String> {
    let chosen = match (fullname, email) {
        (Some(name), Some(mail)) if !mail.contains('<') => format!("{name} <{mail}>"),
        (_, Some(mail)) if mail.contains('<') => mail.to_owned(),
        _ => author.to_owned(),
    };
    let well_formed = chosen
        .strip_suffix('>')
        .and_then(|s| s.split_once(" <"))
        .is_some_and(|(name, mail)| {
            !name.trim().is_empty() && mail.contains('@') && !mail.contains(['<', '>'])
        });
    if !well_formed || chosen.chars().any(char::is_control) {
        bail!("maintainer {chosen:?} is not `Name <address>`: set DEBFULLNAME and DEBEMAIL");
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_line_is_read_and_odd_ones_refused() {
        let (v, c, p) = parse_version_line("proxy 0.1.0 (commit fa4822f0a1b2, release build)\n")
            .expect("a release line");
        assert_eq!(
            (v.as_str(), c.as_str(), p.as_str()),
            ("0.1.0", "fa4822f0a1b2", "release")
        );
        for bad in [
            "proxy 0.1.0 (commit unknown, debug build)",
            "proxy 0.1.0",
            "other 0.1.0 (commit fa4822f0a1b2, release build)",
            "proxy 0.1.0 (commit fa48;rm, release build)",
            "proxy  (commit fa4822f0a1b2, release build)",
        ] {
            assert!(parse_version_line(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_package_version_orders_commits_and_pre_releases() {
        let v = |version, count, dirty| deb_version(version, count, "fa4822f0a1b2", dirty);
        assert_eq!(v("0.1.0", 412, false).unwrap(), "0.1.0+git412.fa4822f0a1b2");
        assert_eq!(
            v("0.2.0-rc.1", 7, true).unwrap(),
            "0.2.0~rc.1+git7.fa4822f0a1b2.dirty"
        );
        assert!(v("v1", 1, false).is_err());
        assert!(v("1.0 beta", 1, false).is_err());
    }

    #[test]
    fn the_maintainer_comes_from_debian_variables_or_the_commit() {
        let author = "Ann Author <ann@example.org>";
        assert_eq!(maintainer(None, None, author).unwrap(), author);
        assert_eq!(
            maintainer(Some("Pat Packager"), Some("pat@example.net"), author).unwrap(),
            "Pat Packager <pat@example.net>"
        );
        assert_eq!(
            maintainer(None, Some("Pat <pat@example.net>"), author).unwrap(),
            "Pat <pat@example.net>"
        );
        // Only an address, no name: the commit's author rather than half a field.
        assert_eq!(
            maintainer(None, Some("pat@example.net"), author).unwrap(),
            author
        );
        // A newline would add a field to the control file.
        assert!(maintainer(Some("Pat\nEssential: yes"), Some("p@example.net"), author).is_err());
        assert!(maintainer(None, None, "no address").is_err());
    }
}
