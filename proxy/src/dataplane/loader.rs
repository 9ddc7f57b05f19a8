//! Loading, attaching, pinning and removing the kernel programs.

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData, PerCpuArray},
    programs::{CgroupAttachMode, CgroupSockAddr, links::FdLink, links::PinnedLink},
};
use proxy_common::{
    counters,
    service::{Backend, Service, ServiceKey, SlotTable, SlotTableKey},
};
use tracing::{debug, info, warn};

use super::{DataplaneError, EBPF_OBJECT, mounts, publish::Publisher};

/// The cgroup sock_addr programs, attached in this order and detached in reverse.
pub const PROGRAMS: [&str; 4] = ["connect4", "connect6", "getpeername4", "getpeername6"];

/// Where and as what the data path runs.
#[derive(Clone, Debug)]
pub struct DataplaneOptions {
    /// The cgroup v2 directory to attach to; created when missing.
    pub cgroup: PathBuf,
    /// Mount point of bpffs; mounted when nothing is mounted there.
    pub bpffs: PathBuf,
    /// Instance name: pins go to `<bpffs>/<instance>/`.
    pub instance: String,
}

/// The loaded and attached kernel programs and their maps.
pub struct Dataplane {
    /// Keeps programs and maps referenced while the daemon runs.
    _ebpf: Ebpf,
    pin_dir: PathBuf,
    cgroup: PathBuf,
    created_cgroup: bool,
    links: Vec<(&'static str, PinnedLink)>,
    publisher: Publisher,
    counters: PerCpuArray<MapData, u64>,
}

impl Dataplane {
    /// Loads the object, adopting pinned maps of a previous run of this instance, attaches every
    /// program to the cgroup and pins the links. On error, whatever this call attached is
    /// detached again and a pin directory it created is removed.
    pub fn open(opts: &DataplaneOptions) -> Result<Self, DataplaneError> {
        if let Err(err) = crate::sys::raise_memlock_rlimit() {
            debug!(%err, "could not raise RLIMIT_MEMLOCK (only matters before kernel 5.11)");
        }
        ensure_bpffs(&opts.bpffs)?;
        let pin_dir = opts.bpffs.join(&opts.instance);
        let created_pin_dir = !pin_dir.exists();
        fs::create_dir_all(&pin_dir).map_err(|source| DataplaneError::Io {
            what: "creating the pin directory",
            path: pin_dir.clone(),
            source,
        })?;
        let created_cgroup = !opts.cgroup.exists();
        let result = Self::open_in(opts, &pin_dir, created_cgroup);
        if result.is_err() {
            if created_pin_dir {
                remove_pins(&pin_dir);
            }
            if created_cgroup {
                let _ = fs::remove_dir(&opts.cgroup);
            }
        }
        result
    }

    fn open_in(
        opts: &DataplaneOptions,
        pin_dir: &Path,
        created_cgroup: bool,
    ) -> Result<Self, DataplaneError> {
        if created_cgroup {
            fs::create_dir_all(&opts.cgroup).map_err(|source| DataplaneError::Io {
                what: "creating the cgroup",
                path: opts.cgroup.clone(),
                source,
            })?;
        }
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin_dir)
            .load(EBPF_OBJECT)
            .map_err(DataplaneError::Load)?;
        let cgroup_fd = fs::File::open(&opts.cgroup).map_err(|source| DataplaneError::Io {
            what: "opening the cgroup",
            path: opts.cgroup.clone(),
            source,
        })?;
        // Attach everything first (links are detached on drop if anything below fails), then
        // replace the pins of a previous run, so that the hand-over has no gap.
        let mut fd_links = Vec::new();
        for name in PROGRAMS {
            fd_links.push((name, attach(&mut ebpf, name, &cgroup_fd)?));
        }
        let mut links = Vec::new();
        for (name, link) in fd_links {
            let path = pin_dir.join(format!("link_{name}"));
            replace_old_link(&path);
            let pinned = link.pin(&path).map_err(|source| DataplaneError::PinLink {
                name,
                path: path.clone(),
                source,
            })?;
            links.push((name, pinned));
        }
        let publisher = Publisher::new(
            take_map::<HashMap<MapData, ServiceKey, Service>>(&mut ebpf, "SERVICES_V1")?,
            take_map::<HashMap<MapData, SlotTableKey, SlotTable>>(&mut ebpf, "SLOTS_V1")?,
            take_map::<HashMap<MapData, u32, Backend>>(&mut ebpf, "BACKENDS_V1")?,
        )?;
        let counters = take_map::<PerCpuArray<MapData, u64>>(&mut ebpf, "COUNTERS_V1")?;
        info!(cgroup = %opts.cgroup.display(), pins = %pin_dir.display(), adopted = publisher.adopted(), "data path attached");
        Ok(Self {
            _ebpf: ebpf,
            pin_dir: pin_dir.to_owned(),
            cgroup: opts.cgroup.clone(),
            created_cgroup,
            links,
            publisher,
            counters,
        })
    }

    /// The publisher of service host sets.
    pub fn publisher(&mut self) -> &mut Publisher {
        &mut self.publisher
    }

    /// Counters summed over CPUs, with their names.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        counters::NAMES
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let total = self
                    .counters
                    .get(&(i as u32), 0)
                    .map(|per_cpu| per_cpu.iter().sum())
                    .unwrap_or(0);
                (*name, total)
            })
            .collect()
    }

    /// The pin directory of this instance.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Detaches every program, removes every pin, and removes the cgroup if this daemon created
    /// it (and it is empty). After this the kernel holds nothing of this instance.
    pub fn shutdown(self) {
        let Self {
            _ebpf,
            pin_dir,
            cgroup,
            created_cgroup,
            links,
            publisher,
            counters,
        } = self;
        for (name, link) in links.into_iter().rev() {
            match link.unpin() {
                Ok(fd_link) => drop(fd_link),
                Err(err) => warn!(program = name, %err, "unpinning link failed"),
            }
        }
        drop((publisher, counters, _ebpf));
        remove_pins(&pin_dir);
        if created_cgroup && let Err(err) = fs::remove_dir(&cgroup) {
            warn!(cgroup = %cgroup.display(), %err, "cgroup not removed (processes still in it?)");
        }
        info!("data path detached and unpinned");
    }
}

fn ensure_bpffs(bpffs: &Path) -> Result<(), DataplaneError> {
    if mounts::is_bpffs(bpffs) {
        return Ok(());
    }
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
    Ok(())
}

fn attach(ebpf: &mut Ebpf, name: &'static str, cgroup: &fs::File) -> Result<FdLink, DataplaneError> {
    let err = |source| DataplaneError::Program { name, source };
    let program: &mut CgroupSockAddr = ebpf
        .program_mut(name)
        .ok_or(aya::programs::ProgramError::NotLoaded)
        .map_err(err)?
        .try_into()
        .map_err(err)?;
    program.load().map_err(err)?;
    // Through bpf_link (5.7+) the kernel takes no attach flags and always allows several
    // programs per hook, which lets a new daemon attach next to the one it replaces.
    let id = program.attach(cgroup, CgroupAttachMode::Single).map_err(err)?;
    let link = program.take_link(id).map_err(err)?;
    FdLink::try_from(link).map_err(|_| DataplaneError::NoBpfLink { name })
}

/// Removes the pinned link of a previous run, which detaches its program (ours is already
/// attached next to it).
fn replace_old_link(path: &Path) {
    if !path.exists() {
        return;
    }
    match PinnedLink::from_pin(path) {
        Ok(old) => {
            if let Ok(fd) = old.unpin() {
                drop(fd);
                info!(link = %path.display(), "replaced the link of a previous run");
            }
        }
        Err(err) => {
            warn!(link = %path.display(), %err, "stale pin is not a link; removing it");
            let _ = fs::remove_file(path);
        }
    }
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DataplaneError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(DataplaneError::Map {
        name,
        source: aya::maps::MapError::InvalidName {
            name: name.to_owned(),
        },
    })?;
    T::try_from(map).map_err(|source| DataplaneError::Map { name, source })
}

/// Removes every pin in `dir` and the directory itself.
fn remove_pins(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if let Err(err) = fs::remove_file(entry.path()) {
                warn!(pin = %entry.path().display(), %err, "pin not removed");
            }
        }
    }
    if let Err(err) = fs::remove_dir(dir) {
        warn!(dir = %dir.display(), %err, "pin directory not removed");
    }
}
