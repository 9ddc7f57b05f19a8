//! An OCI image layout, written without a container tool or a registry: one layer (a tar of
//! the binary, the shared libraries it loads and their Debian copyright files, the package's
//! copyright and third-party licences, the example configuration), its config, manifest and
//! index as JSON, every blob named by its sha256.
//!
//! The binary is the package's, byte for byte, at /usr/local/bin/proxy (where
//! docs/deploy/daemonset.yaml runs it). Its libraries are the build machine's, found with `ldd`
//! and attributed to their Debian packages with `dpkg -S`. The layer's tar is reproducible:
//! sorted names, owner 0, the commit's time on every entry, gzip without a name or time.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use serde_json::json;

use super::{Facts, deb};
use crate::util;

/// Where the image has the daemon.
pub const BINARY: &str = "/usr/local/bin/proxy";
/// Where the image has the example configuration.
pub const EXAMPLE: &str = "/usr/share/doc/proxy/examples/proxy.yaml";

/// An image layout and the tag its index names the image by.
pub struct Image {
    pub layout: PathBuf,
    pub tag: String,
}

/// Writes the layout to `out/oci` from the stripped `binary` (staging in `out/image-root`), the
/// layer compressed with gzip at `level`.
pub fn build(
    binary: &Path,
    facts: &Facts,
    out: &Path,
    level: u8,
    notices: &[u8],
) -> anyhow::Result<Image> {
    let rootfs = out.join("image-root");
    copy(binary, &rootfs, BINARY, 0o755)?;
    let ldd = util::output(Command::new("ldd").arg(binary), "ldd")?;
    let mut packages = Vec::new();
    for lib in parse_ldd(&ldd)? {
        let mode = fs::metadata(&lib)?.permissions().mode() & 0o777;
        copy(Path::new(&lib), &rootfs, &lib, mode)?;
        let owner = util::output(Command::new("dpkg").args(["-S", &lib]), "dpkg -S")
            .with_context(|| format!("{lib} belongs to no Debian package"))?;
        let package = owner.split(':').next().unwrap_or_default().to_owned();
        if !packages.contains(&package) {
            let copyright = format!("/usr/share/doc/{package}/copyright");
            copy(Path::new(&copyright), &rootfs, &copyright, 0o644)?;
            packages.push(package);
        }
    }
    let repo = util::workspace_root();
    copy(&repo.join(deb::EXAMPLE_SOURCE), &rootfs, EXAMPLE, 0o644)?;
    copy(
        &repo.join("packaging/copyright"),
        &rootfs,
        "/usr/share/doc/proxy/copyright",
        0o644,
    )?;
    let notices_at = rootfs.join(super::notices::PATH);
    fs::write(&notices_at, notices)?;
    fs::set_permissions(&notices_at, fs::Permissions::from_mode(0o644))?;
    // Where the daemonset mounts its configuration, and what a process expects to find.
    for (dir, mode) in [("etc/proxy", 0o755), ("run", 0o755), ("tmp", 0o1777)] {
        fs::create_dir_all(rootfs.join(dir))?;
        fs::set_permissions(rootfs.join(dir), fs::Permissions::from_mode(mode))?;
    }

    let layout = out.join("oci");
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs)?;
    let tar = out.join("layer.tar");
    layer_tar(&rootfs, &tar, facts.epoch)?;
    let diff_id = sha256(&tar)?;
    util::run(
        Command::new("gzip").arg(format!("-{level}n")).arg(&tar),
        "gzip the layer",
    )?;
    let layer = blob(&blobs, &fs::read(tar.with_extension("tar.gz"))?)?;
    fs::remove_file(tar.with_extension("tar.gz"))?;
    let tag = image_tag(&facts.deb_version);
    let labels = json!({
        "org.opencontainers.image.title": "proxy",
        "org.opencontainers.image.version": facts.version,
        "org.opencontainers.image.revision": facts.commit,
        "org.opencontainers.image.created": facts.created_rfc3339,
        "org.opencontainers.image.licenses": "MIT OR Apache-2.0",
        "org.opencontainers.image.description": format!(
            "eBPF transparent proxy; shared libraries from the Debian packages {}",
            packages.join(", ")
        ),
    });
    let config = json!({
        "created": facts.created_rfc3339,
        "architecture": oci_architecture(&facts.architecture)?,
        "os": "linux",
        "config": {
            "Entrypoint": [BINARY],
            "Cmd": ["run", "--config", "/etc/proxy/proxy.yaml"],
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
            "Labels": labels,
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{diff_id}")] },
        "history": [{
            "created": facts.created_rfc3339,
            "created_by": "cargo xtask dist",
            "comment": "the proxy binary, its shared libraries and their copyright files",
        }],
    });
    let config = blob(&blobs, &serde_json::to_vec(&config)?)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", &config),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar+gzip", &layer)],
        "annotations": labels,
    });
    let manifest = blob(&blobs, &serde_json::to_vec(&manifest)?)?;
    let mut entry = descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
    entry["annotations"] = json!({ "org.opencontainers.image.ref.name": tag });
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry],
    });
    fs::write(layout.join("index.json"), serde_json::to_vec(&index)?)?;
    fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    fs::remove_dir_all(&rootfs)?;
    Ok(Image { layout, tag })
}

/// Copies `from` to `rootfs` + `to` (an absolute path in the image), following links.
fn copy(from: &Path, rootfs: &Path, to: &str, mode: u32) -> anyhow::Result<()> {
    let dest = rootfs.join(to.trim_start_matches('/'));
    let parent = dest.parent().context("a path in the image has a parent")?;
    fs::create_dir_all(parent)?;
    fs::copy(from, &dest).with_context(|| format!("copying {} into the image", from.display()))?;
    fs::set_permissions(&dest, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// A blob's digest (hex) and size.
struct Blob {
    hex: String,
    size: usize,
}

/// Stores `bytes` under `blobs/<sha256>`.
fn blob(blobs: &Path, bytes: &[u8]) -> anyhow::Result<Blob> {
    let staged = blobs.join("incoming");
    fs::write(&staged, bytes)?;
    let hex = sha256(&staged)?;
    fs::rename(&staged, blobs.join(&hex))?;
    Ok(Blob {
        hex,
        size: bytes.len(),
    })
}

fn descriptor(media_type: &str, blob: &Blob) -> serde_json::Value {
    json!({ "mediaType": media_type, "digest": format!("sha256:{}", blob.hex), "size": blob.size })
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    parse_sha256sum(&util::output(
        Command::new("sha256sum").arg(path),
        "sha256sum",
    )?)
}

/// The digest of `sha256sum`'s `<64 hex>  <name>` line.
fn parse_sha256sum(out: &str) -> anyhow::Result<String> {
    let hex = out.split_whitespace().next().unwrap_or_default();
    if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        bail!("unexpected sha256sum output: {out:?}");
    }
    Ok(hex.to_owned())
}

/// A reproducible tar of `rootfs`'s top-level entries.
fn layer_tar(rootfs: &Path, tar: &Path, epoch: u64) -> anyhow::Result<()> {
    let mut top: Vec<String> = fs::read_dir(rootfs)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    util::run(
        Command::new("tar")
            .arg("--create")
            .arg(format!("--file={}", tar.display()))
            .arg(format!("--directory={}", rootfs.display()))
            .args(["--sort=name", "--owner=0", "--group=0", "--numeric-owner"])
            .arg(format!("--mtime=@{epoch}"))
            .args([
                "--format=posix",
                "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
            ])
            .args(&top),
        "tar (the image layer)",
    )
}

/// The binaries and the loader `ldd` lists (the vDSO has no file); a library it cannot find
/// fails, as the image would not run.
fn parse_ldd(out: &str) -> anyhow::Result<Vec<String>> {
    let mut libs = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("not found") {
            bail!("ldd cannot find a library the binary needs: {line}");
        }
        let path = match line.split_once(" => ") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        match path {
            Some(p) if p.starts_with('/') => libs.push(p.to_owned()),
            _ if line.starts_with("linux-vdso") || line.starts_with("linux-gate") => {}
            _ => bail!("unexpected ldd line: {line:?}"),
        }
    }
    if libs.is_empty() {
        bail!("ldd lists no library: {out:?}");
    }
    Ok(libs)
}

/// The tag for a package version: OCI tags allow `[A-Za-z0-9_.-]`, so `+` and `~` become `-`.
fn image_tag(deb_version: &str) -> String {
    deb_version
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// The OCI (Go) name of a Debian architecture.
fn oci_architecture(debian: &str) -> anyhow::Result<&'static str> {
    Ok(match debian {
        "amd64" => "amd64",
        "arm64" => "arm64",
        "armhf" => "arm",
        "i386" => "386",
        "ppc64el" => "ppc64le",
        "s390x" => "s390x",
        "riscv64" => "riscv64",
        other => bail!("no OCI architecture name for Debian's {other}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_lines_give_the_files_to_copy() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f10)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0f)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f11)\n";
        assert_eq!(
            parse_ldd(out).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2",
            ]
        );
        assert!(parse_ldd("\tlibfoo.so.1 => not found\n").is_err());
        assert!(parse_ldd("\tnot a dynamic executable\n").is_err());
        assert!(parse_ldd("").is_err());
    }

    #[test]
    fn digests_tags_and_architectures() {
        let hex = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(parse_sha256sum(&format!("{hex}  /tmp/x\n")).unwrap(), hex);
        assert!(parse_sha256sum("abc  /tmp/x").is_err());
        assert!(parse_sha256sum(&format!("{}  x", hex.to_uppercase())).is_err());
        assert_eq!(
            image_tag("0.2.0~rc.1+git7.fa4822f0a1b2"),
            "0.2.0-rc.1-git7.fa4822f0a1b2"
        );
        assert_eq!(oci_architecture("ppc64el").unwrap(), "ppc64le");
        assert!(oci_architecture("hurd-i386").is_err());
    }
}
