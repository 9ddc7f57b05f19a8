//! The files of the steady-state user: the directories it writes and the instance's sockets an
//! earlier daemon left, handed to it (cap_chown) while the daemon is still root.

use std::path::Path;

use super::PrivilegeError;

/// Makes `dir` belong to the steady-state user `uid`:`gid`: a missing one is created (one
/// level, mode 0700, as the daemon would create it after the drop) and handed over; an
/// existing one is handed over only when it is the daemon's own (`ours`: `/run/proxy` or the
/// pin directory, which a daemon of another user may have left), if it is a directory and not
/// a link; group and others lose write access to it. Any other existing directory stays as it
/// is: the admin then refuses it by name.
pub(super) fn own_dir(dir: &Path, uid: u32, gid: u32, ours: bool) -> Result<(), PrivilegeError> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
    let fail = |source| PrivilegeError::RuntimeDir {
        path: dir.to_owned(),
        source,
    };
    let created = match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        // Its parent is missing or not writable: the admin reports that by name.
        Err(_) if !ours => return Ok(()),
        Err(e) => return Err(fail(e)),
    };
    if !created && !ours {
        return Ok(());
    }
    let meta = std::fs::symlink_metadata(dir).map_err(fail)?;
    if !meta.is_dir() {
        return Err(fail(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "not a directory (a link?); remove it",
        )));
    }
    if (meta.uid(), meta.gid()) != (uid, gid) {
        std::os::unix::fs::lchown(dir, Some(uid), Some(gid)).map_err(fail)?;
    }
    // Only its owner writes it.
    if meta.mode() & 0o022 != 0 {
        let mode = std::fs::Permissions::from_mode(meta.mode() & 0o7755);
        std::fs::set_permissions(dir, mode).map_err(fail)?;
    }
    Ok(())
}

/// Makes the socket file at `path`, if there is one, belong to `uid`:`gid`: an earlier daemon
/// of the instance left it (killed before it removed it, or still running while systemd's
/// `RuntimeDirectory=` set-up handed `/run/proxy` and everything in it back to root at this
/// unit's start). The steady-state user then probes it: a stale one is replaced, a live one
/// (a takeover's peer) answers. Anything but a socket stays as it is.
pub(super) fn own_socket(path: &Path, uid: u32, gid: u32) -> Result<(), PrivilegeError> {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
    let fail = |source| PrivilegeError::RuntimeDir {
        path: path.to_owned(),
        source,
    };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        // Its directory is already another user's (a daemon of that user left it, and no
        // service manager took it back): that user, handed the directory, probes it itself.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => return Ok(()),
        Err(e) => return Err(fail(e)),
    };
    if meta.file_type().is_socket() && (meta.uid(), meta.gid()) != (uid, gid) {
        std::os::unix::fs::lchown(path, Some(uid), Some(gid)).map_err(fail)?;
    }
    Ok(())
}
