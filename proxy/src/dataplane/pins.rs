//! The files under `<bpffs>/<instance>/`: replacing a previous run's links, unpinning what an
//! earlier version left, removing the instance. What each name is comes from
//! `proxy_common::abi::classify`; a name it does not know is never removed.

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::programs::links::PinnedLink;
use proxy_common::abi::{self, PinKind, pins};
use tracing::{info, warn};

use super::DataplaneError;

/// What [`remove_retired`] found besides this version's pins.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetiredPins {
    /// Pins of earlier versions that were unpinned.
    pub removed: Vec<String>,
    /// Pins of earlier versions that could not be unpinned (logged).
    pub failed: Vec<String>,
    /// Names this version does not know, left in place (logged).
    pub unknown: Vec<String>,
}

/// Removes the pinned link of a previous run, which detaches its program (ours is already
/// attached next to it).
pub(super) fn replace_old_link(path: &Path) {
    if unpin_link(path) {
        info!(link = %path.display(), "replaced the link of a previous run");
    }
}

/// Unpins the link pinned at `path`, which detaches its program; whether there was one. A pin
/// there that is not a link is removed.
pub(super) fn unpin_link(path: &Path) -> bool {
    if !path.exists() {
        return false;
    }
    match PinnedLink::from_pin(path) {
        Ok(old) => old.unpin().map(drop).is_ok(),
        Err(err) => {
            warn!(link = %path.display(), %err, "stale pin is not a link; removing it");
            let _ = fs::remove_file(path);
            false
        }
    }
}

/// Unpins every pin of an earlier version in `dir` (an old map is freed once nothing else holds
/// it; an old link detaches its program) and lists, without touching them, names this version
/// does not know.
pub(super) fn remove_retired(dir: &Path) -> RetiredPins {
    let mut found = RetiredPins::default();
    for name in names(dir) {
        match abi::classify(&name) {
            PinKind::Current => {}
            PinKind::Retired => match fs::remove_file(dir.join(&name)) {
                Ok(()) => {
                    info!(pin = %name, "unpinned what an earlier version left");
                    found.removed.push(name);
                }
                Err(err) => {
                    warn!(pin = %name, %err, "pin of an earlier version not removed");
                    found.failed.push(name);
                }
            },
            PinKind::Unknown => {
                warn!(dir = %dir.display(), pin = %name, "a pin this version does not know (a newer version's, or not ours); leaving it");
                found.unknown.push(name);
            }
        }
    }
    found
}

/// Removes this version's and earlier versions' pins in `dir`, then the directory itself if
/// nothing else is left in it.
pub(super) fn remove_ours(dir: &Path) {
    let mut kept = 0;
    for name in names(dir) {
        if abi::classify(&name) == PinKind::Unknown {
            kept += 1;
            continue;
        }
        if let Err(err) = fs::remove_file(dir.join(&name)) {
            warn!(pin = %dir.join(&name).display(), %err, "pin not removed");
        }
    }
    if kept > 0 {
        warn!(dir = %dir.display(), kept, "pin directory kept: it holds pins this version does not know");
    } else if let Err(err) = fs::remove_dir(dir) {
        warn!(dir = %dir.display(), %err, "pin directory not removed");
    }
}

/// The cgroup a previous run of this instance created, if it recorded one in `dir`.
pub(super) fn owned_cgroup(dir: &Path) -> Option<PathBuf> {
    fs::read_link(dir.join(pins::OWNED_CGROUP)).ok()
}

/// Records in `dir` that this instance created `cgroup` (`None`: that it owns none).
pub(super) fn record_owned_cgroup(dir: &Path, cgroup: Option<&Path>) {
    let link = dir.join(pins::OWNED_CGROUP);
    let _ = fs::remove_file(&link);
    if let Some(cgroup) = cgroup
        && let Err(err) = std::os::unix::fs::symlink(cgroup, &link)
    {
        warn!(link = %link.display(), %err, "could not record the cgroup this daemon created; a restart after a crash will not remove it");
    }
}

/// The bpffs mount point a run of this instance mounted, if one recorded it in `dir`.
pub(super) fn owned_bpffs(dir: &Path) -> Option<PathBuf> {
    fs::read_link(dir.join(pins::OWNED_BPFFS)).ok()
}

/// Records in `dir` that this instance mounted the bpffs at `bpffs` (kept across restarts: a
/// later run finds it mounted, but it is still this instance's to unmount).
pub(super) fn record_owned_bpffs(dir: &Path, bpffs: &Path) {
    let link = dir.join(pins::OWNED_BPFFS);
    if let Err(err) = std::os::unix::fs::symlink(bpffs, &link) {
        warn!(link = %link.display(), %err, "could not record the bpffs this daemon mounted; proxy uninstall will leave it mounted");
    }
}

/// The file names in `dir`, sorted (none when it cannot be read).
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().into_string().ok())
        .collect();
    names.sort();
    names
}

/// Takes the instance's lock: an exclusive `flock` on its pin directory, which the kernel
/// releases when the process ends however it ends. A second daemon on the same instance would
/// adopt the first one's pins and links, and the first's stop would then delete them under it.
/// The directory is also made 0700: its pins are the data path's maps and links.
///
/// A previous daemon handed the directory to its steady-state user (`--user`); it is taken
/// back first (cap_chown), since a daemon started as root within the unit's bounding set has
/// neither cap_fowner (for the chmod) nor cap_dac_override (for opening another user's 0700
/// directory). The attach hands it to the user again.
pub(super) fn lock_instance(pin_dir: &Path, instance: &str) -> Result<fs::File, DataplaneError> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt};
    let io = |what, source| DataplaneError::Io {
        what,
        path: pin_dir.to_owned(),
        source,
    };
    let meta = fs::symlink_metadata(pin_dir).map_err(|e| io("reading the pin directory", e))?;
    let me = (crate::sys::effective_uid(), crate::sys::effective_gid());
    if (meta.uid(), meta.gid()) != me {
        std::os::unix::fs::lchown(pin_dir, Some(me.0), Some(me.1)).map_err(|e| {
            io(
                "taking the pin directory back from the user a previous daemon ran as (needs cap_chown)",
                e,
            )
        })?;
    }
    fs::set_permissions(pin_dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| io("making the pin directory private (0700)", e))?;
    let dir = fs::File::open(pin_dir).map_err(|e| io("opening the pin directory", e))?;
    match dir.try_lock() {
        Ok(()) => Ok(dir),
        Err(fs::TryLockError::WouldBlock) => Err(DataplaneError::InstanceBusy {
            instance: instance.to_owned(),
            path: pin_dir.to_owned(),
        }),
        Err(fs::TryLockError::Error(e)) => Err(io("locking the pin directory", e)),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A scratch directory of plain files standing in for pins (removing a pin is removing its
    /// file, whatever the object behind it).
    struct Scratch(PathBuf);

    impl Scratch {
        fn with(test: &str, files: &[&str]) -> Self {
            let dir =
                std::env::temp_dir().join(format!("proxy-pins-{test}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            for f in files {
                fs::write(dir.join(f), b"").unwrap();
            }
            Self(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// An unknown name shaped like a newer version of ours, and another tool's pin.
    const NEWER: &str = "SERVICES_V99";
    const FOREIGN: &str = "someone_elses";

    /// Two retired pins, three current ones, two unknown ones.
    fn files() -> [&'static str; 7] {
        [
            abi::RETIRED[0],
            abi::RETIRED[5],
            abi::maps::SERVICES,
            abi::pins::LINK_CONNECT4,
            abi::pins::PROG_SPLICE,
            NEWER,
            FOREIGN,
        ]
    }

    fn sorted(names: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn retired_pins_go_and_the_rest_stay() {
        let files = files();
        let dir = Scratch::with("retired", &files);
        let found = remove_retired(&dir.0);
        assert_eq!(found.removed, sorted(&files[..2]));
        assert!(found.failed.is_empty());
        assert_eq!(found.unknown, sorted(&files[5..]));
        assert_eq!(names(&dir.0), sorted(&files[2..]));
    }

    #[test]
    fn removing_the_instance_keeps_unknown_pins_and_their_directory() {
        let files = files();
        let dir = Scratch::with("ours", &files);
        remove_ours(&dir.0);
        assert_eq!(names(&dir.0), sorted(&files[5..]));
    }

    #[test]
    fn removing_the_instance_removes_its_directory_when_only_ours_was_there() {
        let dir = Scratch::with("only-ours", &files()[..5]);
        remove_ours(&dir.0);
        assert!(!dir.0.exists());
    }
}
