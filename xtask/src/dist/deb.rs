//! The Debian package: its file tree, its control files, `dpkg-deb --build`.
//!
//! The units and the sysusers.d entry are the repository's own (`docs/deploy`), with their
//! leading comment (how to install them by hand) replaced by one saying where they came from,
//! and the binary's path changed to the package's. The daemon goes to /usr/sbin: it is a system
//! daemon with a section 8 manual page, and /usr/bin/proxy belongs to Debian's libproxy-tools.

use std::{
    fs,
    io::Write as _,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use super::Facts;
use crate::util;

/// Where the package puts the daemon.
pub const BINARY: &str = "usr/sbin/proxy";
/// Where the package puts the example configuration.
pub const EXAMPLE: &str = "usr/share/doc/proxy/examples/proxy.yaml";
/// The repository's example the package ships (the one docs/deploy installs by hand).
pub const EXAMPLE_SOURCE: &str = "examples/static.yaml";

/// The path docs/deploy's files give the binary (an install by hand).
const HAND_INSTALLED: &str = "/usr/local/bin/proxy";

/// The packaged units point at the manual page the package installs (docs/deploy's cannot:
/// `systemd-analyze verify` in the tests would look for it on the test machine).
const UNIT_SECTION: &str = "[Unit]\n";
const UNIT_SECTION_WITH_MANUAL: &str = "[Unit]\nDocumentation=man:proxy(8)\n";

/// A file of the repository shipped with its leading comment replaced: (source, destination,
/// the new leading comment, replacements each of which must apply).
type Shipped = (
    &'static str,
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

const SHIPPED: &[Shipped] = &[
    (
        "docs/deploy/proxy.service",
        "lib/systemd/system/proxy.service",
        "systemd unit of the node daemon, from the proxy package (docs/deploy/proxy.service of\n\
         the repository, where its comments explain it). Not enabled on installation: write\n\
         /etc/proxy/proxy.yaml first (an example: /usr/share/doc/proxy/examples/proxy.yaml),\n\
         then `systemctl enable --now proxy`.",
        &[
            (HAND_INSTALLED, "/usr/sbin/proxy"),
            (
                "docs/deploy/proxy.sysusers",
                "/usr/lib/sysusers.d/proxy.conf, as the package's postinst does",
            ),
            (UNIT_SECTION, UNIT_SECTION_WITH_MANUAL),
        ],
    ),
    (
        "docs/deploy/proxy@.service",
        "lib/systemd/system/proxy@.service",
        "systemd template for restarts and upgrades by takeover, from the proxy package\n\
         (docs/deploy/proxy@.service of the repository, where its comments explain it):\n\
         proxy@blue and proxy@green take turns (`proxy run --takeover`).",
        &[
            (HAND_INSTALLED, "/usr/sbin/proxy"),
            (UNIT_SECTION, UNIT_SECTION_WITH_MANUAL),
        ],
    ),
    (
        "docs/deploy/proxy.sysusers",
        "usr/lib/sysusers.d/proxy.conf",
        "The daemon's steady-state user (`proxy run --user ebpf-proxy` in proxy.service and\n\
         proxy@.service), created by the proxy package's postinst with systemd-sysusers.",
        &[],
    ),
];

/// The shells whose completions the package ships, and where each looks for them.
const COMPLETIONS: &[(&str, &str)] = &[
    ("bash", "usr/share/bash-completion/completions/proxy"),
    ("zsh", "usr/share/zsh/vendor-completions/_proxy"),
    ("fish", "usr/share/fish/vendor_completions.d/proxy.fish"),
];

/// The maintainer scripts of `packaging/`.
const SCRIPTS: &[&str] = &["postinst", "prerm", "postrm"];

/// Builds `out/proxy_<version>_<arch>.deb` around `binary` (already stripped), its data
/// compressed with xz at `level`; `notices` is the gzipped third-party licence text.
pub fn build(
    binary: &Path,
    facts: &Facts,
    out: &Path,
    level: u8,
    notices: &[u8],
) -> anyhow::Result<PathBuf> {
    let repo = util::workspace_root();
    let root = out.join("deb-root");
    put(&root, BINARY, &fs::read(binary)?, 0o755)?;
    for (source, dest, header, replace) in SHIPPED {
        let text =
            fs::read_to_string(repo.join(source)).with_context(|| format!("reading {source}"))?;
        let text =
            packaged_text(&text, header, replace).with_context(|| format!("packaging {source}"))?;
        put(&root, dest, text.as_bytes(), 0o644)?;
    }
    let man = util::output(Command::new(binary).arg("man"), "proxy man")?;
    put(
        &root,
        "usr/share/man/man8/proxy.8.gz",
        &gzip(man.as_bytes())?,
        0o644,
    )?;
    for (shell, dest) in COMPLETIONS {
        let script = util::output(
            Command::new(binary).args(["completions", shell]),
            "proxy completions",
        )?;
        put(&root, dest, script.as_bytes(), 0o644)?;
    }
    let doc = |name: &str| format!("usr/share/doc/proxy/{name}");
    put(
        &root,
        &doc("copyright"),
        &fs::read(repo.join("packaging/copyright"))?,
        0o644,
    )?;
    put(&root, super::notices::PATH, notices, 0o644)?;
    let log = changelog(facts);
    put(&root, &doc("changelog.gz"), &gzip(log.as_bytes())?, 0o644)?;
    put(&root, EXAMPLE, &fs::read(repo.join(EXAMPLE_SOURCE))?, 0o644)?;
    let overrides = fs::read(repo.join("packaging/lintian-overrides"))?;
    put(
        &root,
        "usr/share/lintian/overrides/proxy",
        &overrides,
        0o644,
    )?;

    // The control files, after the tree: md5sums and Installed-Size describe it.
    let entries = walk(&root)?;
    let depends = depends(binary, out)?;
    let template = fs::read_to_string(repo.join("packaging/control"))?;
    let control = fill(
        &template,
        &[
            ("version", &facts.deb_version),
            ("architecture", &facts.architecture),
            ("maintainer", &facts.maintainer),
            ("installed_size", &installed_size(&entries).to_string()),
            ("depends", &depends),
        ],
    )
    .context("filling packaging/control")?;
    put(&root, "DEBIAN/control", control.as_bytes(), 0o644)?;
    let files: Vec<&str> = entries
        .iter()
        .filter(|e| e.size.is_some())
        .map(|e| e.path.as_str())
        .collect();
    let sums = util::output(
        Command::new("md5sum").args(&files).current_dir(&root),
        "md5sum",
    )?;
    put(&root, "DEBIAN/md5sums", sums.as_bytes(), 0o644)?;
    for script in SCRIPTS {
        let text = fs::read(repo.join("packaging").join(script))?;
        put(&root, &format!("DEBIAN/{script}"), &text, 0o755)?;
    }
    util::run(
        Command::new("find")
            .arg(&root)
            .args(["-exec", "touch", "--no-dereference", "--date"])
            .arg(format!("@{}", facts.epoch))
            .args(["{}", "+"]),
        "touch (the commit's time on every file)",
    )?;
    let deb = out.join(format!(
        "proxy_{}_{}.deb",
        facts.deb_version, facts.architecture
    ));
    util::run(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz"])
            .arg(format!("-z{level}"))
            .arg("--build")
            .arg(&root)
            .arg(&deb)
            .env("SOURCE_DATE_EPOCH", facts.epoch.to_string()),
        "dpkg-deb --build",
    )?;
    fs::remove_dir_all(&root)?;
    Ok(deb)
}

/// Writes `bytes` to `root/rel` with `mode`, creating the directories (0755) on the way.
fn put(root: &Path, rel: &str, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    let path = root.join(rel);
    let mut dir = path.parent();
    let mut missing = Vec::new();
    while let Some(d) = dir.filter(|d| !d.exists()) {
        missing.push(d.to_owned());
        dir = d.parent();
    }
    for d in missing.iter().rev() {
        fs::create_dir(d).with_context(|| format!("creating {}", d.display()))?;
        fs::set_permissions(d, fs::Permissions::from_mode(0o755))?;
    }
    fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// `gzip -9n` of `bytes` (no name or time stamp in the header, as Debian asks).
pub fn gzip(bytes: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut child = Command::new("gzip")
        .arg("-9n")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting gzip")?;
    let mut stdin = child.stdin.take().context("gzip's stdin")?;
    let input = bytes.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().context("gzip")?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("the thread feeding gzip panicked"))??;
    if !out.status.success() {
        bail!("gzip failed ({})", out.status);
    }
    Ok(out.stdout)
}

/// A file of the repository as the package ships it: the leading comment block replaced by
/// `header`, each `(from, to)` applied (and required to apply, so that a changed source cannot
/// ship the wrong path silently), and no hand-install path left over.
fn packaged_text(source: &str, header: &str, replace: &[(&str, &str)]) -> anyhow::Result<String> {
    let mut text = String::new();
    for line in header.lines() {
        text.push_str("# ");
        text.push_str(line);
        text.push('\n');
    }
    for line in source.lines().skip_while(|l| l.starts_with('#')) {
        text.push_str(line);
        text.push('\n');
    }
    for (from, to) in replace {
        if !text.contains(from) {
            bail!("no longer mentions {from}: update xtask/src/dist/deb.rs");
        }
        text = text.replace(from, to);
    }
    if text.contains("/usr/local") {
        bail!("still names a path under /usr/local, which a package must not use");
    }
    Ok(text)
}

/// `packaging/control` with each `{key}` replaced; a key the template lacks, a placeholder left
/// over or a value that would add a line (a field) is refused.
fn fill(template: &str, values: &[(&str, &str)]) -> anyhow::Result<String> {
    let mut text = template.to_owned();
    for (key, value) in values {
        let placeholder = format!("{{{key}}}");
        if !text.contains(&placeholder) {
            bail!("the template has no {placeholder}");
        }
        if value.is_empty() || value.chars().any(char::is_control) {
            bail!("{key} {value:?} is empty or has a control character");
        }
        text = text.replace(&placeholder, value);
    }
    if let Some(line) = text.lines().find(|l| l.contains('{')) {
        bail!("a placeholder is left unfilled: {line:?}");
    }
    Ok(text)
}

/// The native package's changelog: one entry, for the commit packaged.
fn changelog(facts: &Facts) -> String {
    format!(
        "proxy ({}) unstable; urgency=medium\n\n  * Built by `cargo xtask dist` from commit {} ({} build).\n\n -- {}  {}\n",
        facts.deb_version, facts.commit, facts.profile, facts.maintainer, facts.created_rfc2822
    )
}

/// The Depends field: the shared libraries the binary loads, as dpkg-shlibdeps names their
/// packages (run in a scratch source tree: it reads `debian/control`).
fn depends(binary: &Path, out: &Path) -> anyhow::Result<String> {
    let tree = out.join("shlibdeps");
    fs::create_dir_all(tree.join("debian"))?;
    fs::write(
        tree.join("debian/control"),
        "Source: proxy\n\nPackage: proxy\nArchitecture: any\n",
    )?;
    let binary = fs::canonicalize(binary)?;
    let found = util::output(
        Command::new("dpkg-shlibdeps")
            .arg("-O")
            .arg(format!("-e{}", binary.display()))
            .current_dir(&tree),
        "dpkg-shlibdeps",
    )?;
    fs::remove_dir_all(&tree)?;
    parse_shlibdeps(&found)
}

/// `shlibs:Depends=libc6 (>= 2.34), libgcc-s1 (>= 4.2)` -> the value.
fn parse_shlibdeps(out: &str) -> anyhow::Result<String> {
    out.lines()
        .find_map(|l| l.strip_prefix("shlibs:Depends="))
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .with_context(|| format!("dpkg-shlibdeps named no dependency: {out:?}"))
}

/// A file or directory of the tree, relative to its root; `size` is `None` for a directory.
pub struct Entry {
    pub path: String,
    pub size: Option<u64>,
}

/// Every file and directory under `root` but `DEBIAN/`, sorted.
pub fn walk(root: &Path) -> anyhow::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            let rel = path.strip_prefix(root)?.to_string_lossy().into_owned();
            if rel == "DEBIAN" {
                continue;
            }
            let meta = fs::symlink_metadata(&path)?;
            if meta.is_dir() {
                pending.push(path);
                entries.push(Entry {
                    path: rel,
                    size: None,
                });
            } else {
                entries.push(Entry {
                    path: rel,
                    size: Some(meta.len()),
                });
            }
        }
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(entries)
}

/// Installed-Size in KiB as dpkg-gencontrol counts it: each file rounded up to a KiB, one for
/// each directory.
fn installed_size(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .map(|e| e.size.map_or(1, |s| s.div_ceil(1024)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shipped_file_gets_the_package_header_and_paths() {
        let source = "# install by hand:\n#   cp proxy /usr/local/bin/proxy\n\n[Service]\n\
                      # keep this comment\nExecStart=/usr/local/bin/proxy run\n";
        let text = packaged_text(
            source,
            "from the package\nsecond line",
            &[(HAND_INSTALLED, "/usr/sbin/proxy")],
        )
        .unwrap();
        assert_eq!(
            text,
            "# from the package\n# second line\n\n[Service]\n# keep this comment\n\
             ExecStart=/usr/sbin/proxy run\n"
        );
    }

    #[test]
    fn a_shipped_file_that_moved_on_is_refused() {
        let renamed = "[Service]\nExecStart=/opt/proxy run\n";
        assert!(packaged_text(renamed, "h", &[(HAND_INSTALLED, "/usr/sbin/proxy")]).is_err());
        let other_local = "[Service]\nExecStart=/usr/local/bin/proxy\nExecStartPre=/usr/local/x\n";
        assert!(packaged_text(other_local, "h", &[(HAND_INSTALLED, "/usr/sbin/proxy")]).is_err());
    }

    #[test]
    fn the_repository_files_package() {
        let repo = util::workspace_root();
        for (source, _, header, replace) in SHIPPED {
            let text = fs::read_to_string(repo.join(source)).unwrap();
            let shipped = packaged_text(&text, header, replace).unwrap();
            assert!(!shipped.contains("docs/deploy/proxy.sysusers"), "{source}");
            assert_eq!(
                shipped.contains("Documentation=man:proxy(8)"),
                source.ends_with(".service"),
                "{source}"
            );
        }
        let template = fs::read_to_string(repo.join("packaging/control")).unwrap();
        let v = "x";
        let keys = [
            "version",
            "architecture",
            "maintainer",
            "installed_size",
            "depends",
        ];
        let values: Vec<_> = keys.iter().map(|k| (*k, v)).collect();
        fill(&template, &values).unwrap();
    }

    #[test]
    fn the_control_template_takes_only_single_line_values() {
        let template = "Package: proxy\nVersion: {version}\nDepends: {depends}\n";
        let filled = fill(template, &[("version", "1.0"), ("depends", "libc6")]).unwrap();
        assert_eq!(filled, "Package: proxy\nVersion: 1.0\nDepends: libc6\n");
        assert!(fill(template, &[("version", "1.0")]).is_err(), "unfilled");
        assert!(
            fill(
                template,
                &[("version", "1\nEssential: yes"), ("depends", "x")]
            )
            .is_err()
        );
        assert!(
            fill(
                template,
                &[("version", "1"), ("depends", "x"), ("other", "y")]
            )
            .is_err()
        );
        assert!(fill(template, &[("version", ""), ("depends", "x")]).is_err());
    }

    #[test]
    fn shlibdeps_output_and_installed_size() {
        assert_eq!(
            parse_shlibdeps("shlibs:Depends=libc6 (>= 2.34), libgcc-s1 (>= 4.2)\n").unwrap(),
            "libc6 (>= 2.34), libgcc-s1 (>= 4.2)"
        );
        assert!(parse_shlibdeps("").is_err());
        assert!(parse_shlibdeps("shlibs:Depends=\n").is_err());
        let entries = [
            Entry {
                path: "usr".into(),
                size: None,
            },
            Entry {
                path: "usr/a".into(),
                size: Some(1),
            },
            Entry {
                path: "usr/b".into(),
                size: Some(2048),
            },
            Entry {
                path: "usr/c".into(),
                size: Some(0),
            },
        ];
        assert_eq!(installed_size(&entries), 1 + 1 + 2);
    }
}
