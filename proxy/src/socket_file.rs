//! A unix socket file this daemon bound (the admin interface's, the takeover socket): dropping
//! it removes the file, if it is still the one this daemon bound (same device and inode), so a
//! stop never removes a newer daemon's socket at the same path.

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

/// The file of a bound unix socket, removed on drop.
pub(crate) struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
    /// What it is, for the log line of a failed removal.
    what: &'static str,
}

impl SocketFile {
    /// The socket just bound at `path` (its device and inode are read now).
    pub(crate) fn bound(path: &Path, what: &'static str) -> std::io::Result<Self> {
        let meta = std::fs::symlink_metadata(path)?;
        Ok(Self {
            path: path.to_owned(),
            id: (meta.dev(), meta.ino()),
            what,
        })
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id);
        if ours && let Err(err) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %err, "removing the {} socket", self.what);
        }
    }
}
