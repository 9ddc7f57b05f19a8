//! `proxy uninstall`: what a stopped daemon left attached and pinned, removed, under the
//! instance's lock.

use std::{
    fs,
    path::{Path, PathBuf},
};

use proxy_common::abi::pins;
use tracing::{info, warn};

use super::{DataplaneError, pins as pin_files};

/// What [`uninstall`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Uninstalled {
    /// Links unpinned, which detached their programs.
    pub links: usize,
    /// The cgroup the instance had created, if it was removed.
    pub cgroup: Option<PathBuf>,
    /// The bpffs a run of the instance had mounted, if it was unmounted (nothing else was
    /// pinned in it).
    pub bpffs: Option<PathBuf>,
}

/// Removes an instance whose daemon is stopped: unpins its links (detaching its programs from
/// the cgroup), removes its pins of this and earlier versions (maps go once nothing holds
/// them, the sk_msg attachment with its sockhash), its directory, and the cgroup a run of it
/// created. Refused with [`DataplaneError::InstanceBusy`] while a daemon runs. `None` when
/// there is nothing pinned for the instance.
pub fn uninstall(bpffs: &Path, instance: &str) -> Result<Option<Uninstalled>, DataplaneError> {
    let pin_dir = bpffs.join(instance);
    if !pin_dir.is_dir() {
        return Ok(None);
    }
    let lock = pin_files::lock_instance(&pin_dir, instance)?;
    let mut done = Uninstalled::default();
    // connect4 last: until then a connect still finds its service. Each program is detached
    // before its pin goes: the unpin alone lets it run on until the kernel frees the pin (an
    // RCU grace period and a workqueue later), so a connect right after `proxy uninstall`
    // returned could still be rewritten.
    for (_, link) in pins::LINKS.iter().rev() {
        let path = pin_dir.join(link);
        if path.exists()
            && let Err(err) = crate::sys::link::detach_pinned(&path)
        {
            warn!(link = %path.display(), %err, "detaching the link; it goes with its pin");
        }
        if pin_files::unpin_link(&path) {
            done.links += 1;
        }
    }
    let owned = pin_files::owned_cgroup(&pin_dir);
    let mounted = pin_files::owned_bpffs(&pin_dir);
    pin_files::remove_ours(&pin_dir);
    // The lock's descriptor is in the mount: it would keep it busy.
    drop(lock);
    if mounted.as_deref() == Some(bpffs) {
        done.bpffs = unmount_if_empty(bpffs);
    }
    if let Some(cgroup) = owned {
        match remove_cgroup(&cgroup) {
            Ok(()) => done.cgroup = Some(cgroup),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                warn!(cgroup = %cgroup.display(), %err, "the instance's cgroup is not removed (processes still in it?)");
            }
        }
    }
    info!(instance, links = done.links, "uninstalled");
    Ok(Some(done))
}

/// Unmounts the bpffs at `bpffs`, which this instance mounted, when nothing is left in it but
/// what the kernel puts in every mount (no other instance, no other program's pins);
/// `Some(bpffs)` when it did.
fn unmount_if_empty(bpffs: &Path) -> Option<PathBuf> {
    // What the kernel puts in every new bpffs mount (its preloaded iterators, 5.10+).
    const KERNEL_ENTRIES: [&str; 2] = ["maps.debug", "progs.debug"];
    let left: Vec<String> = fs::read_dir(bpffs)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !KERNEL_ENTRIES.contains(&name.as_str()))
        .collect();
    if !left.is_empty() {
        info!(bpffs = %bpffs.display(), ?left, "the bpffs this instance mounted stays mounted: other pins are in it");
        return None;
    }
    match crate::sys::unmount(bpffs) {
        Ok(()) => {
            info!(bpffs = %bpffs.display(), "unmounted the bpffs this instance had mounted");
            Some(bpffs.to_owned())
        }
        Err(err) => {
            warn!(bpffs = %bpffs.display(), %err, "the bpffs this instance mounted could not be unmounted");
            None
        }
    }
}

/// Removes an empty cgroup. Processes that just left may still be counted for a moment
/// (`EBUSY`): it is tried again for up to a second.
fn remove_cgroup(cgroup: &Path) -> std::io::Result<()> {
    let mut tries = 50;
    loop {
        match fs::remove_dir(cgroup) {
            Err(err) if err.raw_os_error() == Some(libc::EBUSY) && tries > 0 => {
                tries -= 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            result => return result,
        }
    }
}
