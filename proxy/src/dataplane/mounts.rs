//! Finding the cgroup v2 and bpffs mounts.

use std::{
    fs,
    path::{Path, PathBuf},
};

use tracing::info;

use super::DataplaneError;

/// Mount points in /proc/mounts with filesystem type `fstype`.
fn mounts_of(fstype: &str) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string("/proc/mounts") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, dir, ty) = (fields.next()?, fields.next()?, fields.next()?);
            (ty == fstype).then(|| PathBuf::from(unescape(dir)))
        })
        .collect()
}

/// /proc/mounts escapes spaces and a few other bytes as octal (`\040`).
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut chars = field.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            if let Ok(byte) = u8::from_str_radix(&code, 8) {
                out.push(char::from(byte));
                continue;
            }
            out.push(c);
            out.push_str(&code);
        } else {
            out.push(c);
        }
    }
    out
}

/// The cgroup v2 mount point (`/sys/fs/cgroup` on unified hosts, `/sys/fs/cgroup/unified` on
/// hybrid ones).
pub fn cgroup2_mount() -> Result<PathBuf, DataplaneError> {
    mounts_of("cgroup2")
        .into_iter()
        .next()
        .ok_or(DataplaneError::NoCgroup2)
}

/// An absolute cgroup path as given, or a relative one under the cgroup v2 mount.
/// An absolute path must lie in a cgroup v2 hierarchy: a directory elsewhere (e.g. under the
/// tmpfs `/sys/fs/cgroup` of a hybrid host) would be created and then refused by the kernel with
/// an obscure error.
/// The root of a hierarchy is refused: it holds every process of the host.
pub fn resolve_cgroup(configured: &str) -> Result<PathBuf, DataplaneError> {
    let path = Path::new(configured);
    let mounts = mounts_of("cgroup2");
    in_cgroup2(path, &mounts)
}

fn in_cgroup2(path: &Path, mounts: &[PathBuf]) -> Result<PathBuf, DataplaneError> {
    let resolved = if path.is_absolute() {
        path.to_owned()
    } else {
        mounts.first().ok_or(DataplaneError::NoCgroup2)?.join(path)
    };
    // Compared by components: `/sys/fs/cgroup/` and `/sys/fs/cgroup/.` are the root too.
    let normal = |p: &Path| -> PathBuf {
        p.components()
            .filter(|c| !matches!(c, std::path::Component::CurDir))
            .collect()
    };
    if mounts.iter().any(|m| normal(m) == normal(&resolved)) {
        return Err(DataplaneError::CgroupRoot { path: resolved });
    }
    if mounts.iter().any(|m| resolved.starts_with(m)) {
        Ok(resolved)
    } else {
        Err(DataplaneError::NotCgroup2 {
            path: path.to_owned(),
            mounts: mounts
                .iter()
                .map(|m| m.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }
}

/// Whether `dir` may take a bpffs mount: it does not exist yet, or is an empty directory.
pub fn may_mount_bpffs(dir: &Path) -> Result<(), DataplaneError> {
    let has_files = std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some());
    if has_files {
        return Err(DataplaneError::NotBpffs {
            path: dir.to_owned(),
        });
    }
    Ok(())
}

/// Whether a BPF filesystem is mounted at `dir`.
pub fn is_bpffs(dir: &Path) -> bool {
    mounts_of("bpf").iter().any(|m| m == dir)
}

/// Mounts a bpffs at `bpffs` unless one is there; whether it mounted one.
pub(super) fn ensure_bpffs(bpffs: &Path) -> Result<bool, DataplaneError> {
    if is_bpffs(bpffs) {
        return Ok(false);
    }
    may_mount_bpffs(bpffs)?;
    fs::create_dir_all(bpffs).map_err(|source| DataplaneError::Io {
        what: "creating the bpffs mount point",
        path: bpffs.to_owned(),
        source,
    })?;
    crate::sys::mount_bpffs(bpffs).map_err(|source| DataplaneError::Io {
        what: "mounting bpffs at",
        path: bpffs.to_owned(),
        source,
    })?;
    info!(path = %bpffs.display(), "mounted bpffs");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absolute_cgroup_outside_cgroup2_is_refused() {
        let err = resolve_cgroup("/tmp/not-a-cgroup").unwrap_err();
        assert!(matches!(err, DataplaneError::NotCgroup2 { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("/tmp/not-a-cgroup is not in a cgroup v2 hierarchy"),
            "{err}"
        );
    }

    #[test]
    fn the_cgroup_root_is_refused_however_it_is_written() {
        let mounts = [PathBuf::from("/sys/fs/cgroup")];
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/", "/sys/fs/cgroup/."] {
            let err = in_cgroup2(Path::new(root), &mounts).unwrap_err();
            assert!(
                matches!(err, DataplaneError::CgroupRoot { .. }),
                "{root}: {err}"
            );
        }
        let below = in_cgroup2(Path::new("proxy.slice"), &mounts).unwrap();
        assert_eq!(below, Path::new("/sys/fs/cgroup/proxy.slice"));
        let absolute = in_cgroup2(Path::new("/sys/fs/cgroup/a/b"), &mounts).unwrap();
        assert_eq!(absolute, Path::new("/sys/fs/cgroup/a/b"));
    }

    #[test]
    fn bpffs_is_never_mounted_over_files() {
        let dir = std::env::temp_dir().join(format!("proxy-bpffs-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        may_mount_bpffs(&dir).expect("an empty directory may take the mount");
        may_mount_bpffs(&dir.join("missing")).expect("a missing one is created");
        std::fs::write(dir.join("keep"), b"x").unwrap();
        let err = may_mount_bpffs(&dir).unwrap_err();
        assert!(matches!(err, DataplaneError::NotBpffs { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
