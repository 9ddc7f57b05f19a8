//! Finding the cgroup v2 and bpffs mounts.

use std::path::{Path, PathBuf};

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
pub fn resolve_cgroup(configured: &str) -> Result<PathBuf, DataplaneError> {
    let path = Path::new(configured);
    if !path.is_absolute() {
        return Ok(cgroup2_mount()?.join(path));
    }
    let mounts = mounts_of("cgroup2");
    if mounts.iter().any(|m| path.starts_with(m)) {
        Ok(path.to_owned())
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

/// Whether a BPF filesystem is mounted at `dir`.
pub fn is_bpffs(dir: &Path) -> bool {
    mounts_of("bpf").iter().any(|m| m == dir)
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
    fn unescapes_octal() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
