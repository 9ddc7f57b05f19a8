//! Loading, attaching, pinning and removing the kernel programs.

use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    programs::{Program, links::PinnedLink},
};
use proxy_common::abi::{self, maps, pins, programs};
use proxy_core::config::{KernelLogLevel, MapSizes};
use tracing::{debug, info, warn};

use super::{
    DataplaneError, EBPF_OBJECT,
    attach::{attach, attach_pair, attach_splice, load},
    maps::KernelMaps,
    mounts,
    pair::PairSplicer,
    pins::{self as pin_files, RetiredPins},
    publish::Publisher,
    runtime::{OriginalDestinations, PassiveReport, RuntimeMaps},
};

// The programs and maps by role (names in `proxy_common::abi`):
// - the cgroup programs (`programs::CGROUP`: sock_addr hooks and sockops) are attached through
//   bpf_link in that order, detached in reverse, and their links pinned (`pins::LINKS`); sockops
//   only when the data path follows sockets (`DataplaneOptions::follow_sockets`);
// - the sk_msg program is attached to the sockhash `maps::SPLICE` (prog-attach: aya 0.14 has no
//   bpf_link for sockmaps); the attachment lives as long as the map, which is pinned; the program
//   is pinned too (`pins::PROG_SPLICE`), so it can be inspected and is removed with the instance;
// - the stream verdict program of proxy-pair splicing is attached to `maps::PAIR_SOCKS` the same
//   way and pinned (`pins::PROG_PAIR`). Optional: when it cannot be attached the rest of the data
//   path runs and `Dataplane::pair_splicer` says why;
// - `maps::SOCK_VIP` is socket local storage, a BTF map: its aya-ebpf definition cannot ask for
//   pinning, so it is pinned here by path, like the legacy maps are by name, and a restarted
//   daemon adopts it (the entries live in the sockets, so adopting the map keeps getpeername
//   right for connections opened before the restart).

/// Where and as what the data path runs.
#[derive(Clone, Debug)]
pub struct DataplaneOptions {
    /// The cgroup v2 directory to attach to; created when missing.
    pub cgroup: PathBuf,
    /// Mount point of bpffs; mounted when nothing is mounted there.
    pub bpffs: PathBuf,
    /// Instance name: pins go to `<bpffs>/<instance>/`.
    pub instance: String,
    /// Attach sockops, which follows the connections of proxy-mode services (their original
    /// destination) and of clusters with outlier detection (passive health), and splices local
    /// socket pairs. The kernel runs it about five times per TCP connection of the cgroup, even
    /// where it has nothing to do (0.4-0.5 µs per connect on 6.18), so a data path whose
    /// services are all plain kernel-path ones goes without. Then publishing a service that
    /// needs it, or turning splicing on, is refused ([`DataplaneError::NoSockops`]).
    pub follow_sockets: bool,
    /// The level of the programs' log records, fixed at load ([`KernelLogLevel::Off`]: none,
    /// and no reader of the log buffer).
    pub kernel_log: KernelLogLevel,
    /// The sizes of the service, slot table and backend maps; a previous run's pins of other
    /// sizes are refused ([`DataplaneError::PinnedSize`]).
    pub kernel_maps: MapSizes,
}

/// The loaded and attached kernel programs and their maps.
pub struct Dataplane {
    /// Keeps programs and maps referenced while the daemon runs.
    ebpf: Ebpf,
    pin_dir: PathBuf,
    cgroup: PathBuf,
    created_cgroup: bool,
    links: Vec<(&'static str, PinnedLink)>,
    follow_sockets: bool,
    publisher: Publisher,
    runtime: RuntimeMaps,
    /// The proxy-pair splicer, or why its program could not be attached.
    pair: Result<PairSplicer, String>,
    /// The reader of the programs' log records, until the daemon takes it; `None` when the
    /// level is off.
    kernel_log: Option<crate::kernel_log::KernelLog>,
    /// This run created the pin directory: there was no previous state to keep.
    fresh: bool,
    /// Host ending's iterators, or why this kernel cannot end sockets (`super::reaper`).
    pub(super) reaper: Result<super::reaper::Reaper, String>,
    /// The instance's lock (`flock` on the pin directory), held while this daemon runs.
    _lock: fs::File,
}

impl Dataplane {
    /// Loads the object, adopting pinned maps of a previous run of this instance, attaches every
    /// program to the cgroup and pins the links. On error, whatever this call attached is
    /// detached again and a pin directory it created is removed.
    pub fn open(opts: &DataplaneOptions) -> Result<Self, DataplaneError> {
        if let Err(err) = crate::sys::raise_memlock_rlimit() {
            debug!(%err, "could not raise RLIMIT_MEMLOCK (only matters before kernel 5.11)");
        }
        let mounted = mounts::ensure_bpffs(&opts.bpffs)?;
        let pin_dir = opts.bpffs.join(&opts.instance);
        let created_pin_dir = !pin_dir.exists();
        fs::create_dir_all(&pin_dir).map_err(|source| DataplaneError::Io {
            what: "creating the pin directory",
            path: pin_dir.clone(),
            source,
        })?;
        let lock = match pin_files::lock_instance(&pin_dir, &opts.instance) {
            Ok(lock) => lock,
            Err(err) => {
                if created_pin_dir {
                    let _ = fs::remove_dir(&pin_dir);
                }
                return Err(err);
            }
        };
        if mounted {
            pin_files::record_owned_bpffs(&pin_dir, &opts.bpffs);
        }
        let previous = pin_files::owned_cgroup(&pin_dir);
        let created_cgroup = !opts.cgroup.exists();
        let mut dataplane = match Self::open_in(opts, &pin_dir, created_cgroup, lock) {
            Ok(dataplane) => dataplane,
            Err(err) => {
                if created_pin_dir {
                    pin_files::remove_ours(&pin_dir);
                }
                if created_cgroup {
                    let _ = fs::remove_dir(&opts.cgroup);
                }
                return Err(err);
            }
        };
        dataplane.adopt_cgroup(previous);
        dataplane.fresh = created_pin_dir;
        Ok(dataplane)
    }

    /// Takes over the cgroup a previous run of this instance created (it was killed before its
    /// clean stop could remove it), and records the cgroup this run owns. A previous run's cgroup
    /// that this configuration no longer names has nothing attached any more (its links were
    /// replaced): it is removed now if it is empty.
    fn adopt_cgroup(&mut self, previous: Option<PathBuf>) {
        match previous {
            Some(old) if old == self.cgroup => self.created_cgroup = true,
            Some(old) => match fs::remove_dir(&old) {
                Ok(()) => {
                    info!(cgroup = %old.display(), "removed the cgroup a previous run created");
                }
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => {
                    warn!(cgroup = %old.display(), %err, "the cgroup a previous run created is not removed (processes still in it?)");
                }
            },
            None => {}
        }
        let owned = self.created_cgroup.then_some(self.cgroup.as_path());
        pin_files::record_owned_cgroup(&self.pin_dir, owned);
    }

    fn open_in(
        opts: &DataplaneOptions,
        pin_dir: &Path,
        created_cgroup: bool,
        lock: fs::File,
    ) -> Result<Self, DataplaneError> {
        if created_cgroup {
            fs::create_dir_all(&opts.cgroup).map_err(|source| DataplaneError::Io {
                what: "creating the cgroup",
                path: opts.cgroup.clone(),
                source,
            })?;
        }
        let features = super::features::probe();
        let log_level = opts.kernel_log.abi();
        let mut ebpf = super::sizes::loader(pin_dir, &opts.kernel_maps)?
            .default_map_pin_directory(pin_dir)
            .map_pin_path(maps::SOCK_VIP, pin_dir.join(maps::SOCK_VIP))
            .override_global(abi::features::GLOBAL, &features, true)
            .override_global(abi::kernel_log::GLOBAL, &log_level, true)
            .load(EBPF_OBJECT)
            .map_err(DataplaneError::Load)?;
        // Before any program is attached: an earlier layout's host sets, carried over, are
        // served until the first publish.
        super::migrate::service_maps_v1(&mut ebpf, pin_dir);
        // Before anything is attached, so that a failure leaves nothing behind.
        let kernel_log = crate::kernel_log::reader(&mut ebpf, opts.kernel_log)?;
        let cgroup_fd = fs::File::open(&opts.cgroup).map_err(|source| DataplaneError::Io {
            what: "opening the cgroup",
            path: opts.cgroup.clone(),
            source,
        })?;
        // The sk_msg program goes on the (possibly adopted) sockhash before sockops can put new
        // sockets there: a socket takes the map's program when it is inserted.
        attach_splice(&mut ebpf, pin_dir)?;
        // Optional: a failure leaves nothing of it attached or pinned, and the daemon runs on.
        let pair_attached = attach_pair(&mut ebpf, pin_dir).map_err(|err| {
            warn!(%err, "proxy-pair splicing unavailable (splice: kernel cannot be used)");
            err.to_string()
        });
        // Attach everything first (links are detached on drop if anything below fails), then
        // replace the pins of a previous run, so that the hand-over has no gap.
        let mut fd_links = Vec::new();
        let mut round_robin = true;
        for (name, pin) in pins::LINKS {
            if name == programs::SOCKOPS && !opts.follow_sockets {
                continue;
            }
            let program = match programs::round_robin_variant(name) {
                Some(variant) if round_robin => match load(&mut ebpf, variant) {
                    Ok(()) => variant,
                    Err(err) => {
                        // The kernel refuses the instruction (before 5.12): the base programs
                        // serve every other policy.
                        info!(%err, "ROUND_ROBIN unavailable on this kernel (BPF atomic fetch-and-add needs 5.12)");
                        round_robin = false;
                        name
                    }
                },
                _ => name,
            };
            fd_links.push((program, pin, attach(&mut ebpf, program, &cgroup_fd)?));
        }
        // A variant loaded before one was refused is not attached: all four or none.
        if !round_robin {
            for entry in &mut fd_links {
                let Some((base, _)) = programs::ROUND_ROBIN_VARIANTS
                    .iter()
                    .find(|(_, variant)| *variant == entry.0)
                else {
                    continue;
                };
                *entry = (base, entry.1, attach(&mut ebpf, base, &cgroup_fd)?);
            }
        }
        if !opts.follow_sockets {
            // A previous run's sockops goes, as its other links are replaced below.
            pin_files::replace_old_link(&pin_dir.join(pins::LINK_SOCKOPS));
        }
        let mut links = Vec::new();
        for (name, pin, link) in fd_links {
            let path = pin_dir.join(pin);
            pin_files::replace_old_link(&path);
            let pinned = link.pin(&path).map_err(|source| DataplaneError::PinLink {
                name,
                path: path.clone(),
                source,
            })?;
            links.push((name, pinned));
        }
        // Every program is loaded: the maps can leave the object.
        let KernelMaps {
            service,
            runtime,
            pair: pair_maps,
        } = KernelMaps::take(&mut ebpf)?;
        let mut publisher = Publisher::new(service, opts.follow_sockets, round_robin)?;
        publisher.set_kernel_features(features);
        let pair = match (pair_attached, pair_maps) {
            (Ok(()), Ok(maps)) => Ok(PairSplicer::new(maps)),
            (Ok(()), Err(err)) => return Err(err),
            (Err(why), _) => Err(why),
        };
        info!(cgroup = %opts.cgroup.display(), pins = %pin_dir.display(), adopted = publisher.adopted(), sockops = opts.follow_sockets, round_robin, econnrefused = features & abi::features::SET_RETVAL != 0, kernel_log = ?opts.kernel_log, "data path attached");
        Ok(Self {
            // Before `ebpf` moves: the iterators read its SOCK_HOST_V2.
            reaper: super::reaper::load_from(&ebpf),
            ebpf,
            pin_dir: pin_dir.to_owned(),
            cgroup: opts.cgroup.clone(),
            created_cgroup,
            links,
            follow_sockets: opts.follow_sockets,
            publisher,
            runtime: RuntimeMaps::new(runtime),
            pair,
            kernel_log,
            fresh: false,
            _lock: lock,
        })
    }

    /// The proxy-pair splicer (`splice: kernel`), or why the kernel cannot splice pairs.
    pub fn pair_splicer(&self) -> Result<PairSplicer, DataplaneError> {
        self.pair
            .clone()
            .map_err(|why| DataplaneError::PairUnavailable { why })
    }

    /// The reader of the programs' log records, for the task that shows them (once; `None`
    /// when `kernel_log` is off).
    pub fn take_kernel_log(&mut self) -> Option<crate::kernel_log::KernelLog> {
        self.kernel_log.take()
    }

    /// What the kernel reports about a loaded program of the object (`None` if the object has
    /// no such program or it is not loaded).
    pub fn program_info(&self, name: &str) -> Option<aya::programs::ProgramInfo> {
        let program = self.ebpf.program(name)?;
        let info = match program {
            Program::CgroupSockAddr(p) => p.info(),
            Program::SockOps(p) => p.info(),
            Program::SkMsg(p) => p.info(),
            Program::SkSkb(p) => p.info(),
            _ => return None,
        };
        info.ok()
    }

    /// The publisher of service host sets.
    pub fn publisher(&mut self) -> &mut Publisher {
        &mut self.publisher
    }

    /// What the hooks counted for the service at `key` (`None` if it is not published).
    pub fn service_counts(
        &self,
        key: &proxy_common::service::ServiceKey,
    ) -> Option<proxy_common::counters::ServiceCounts> {
        self.publisher.service_counts(key)
    }

    /// The kernel's connection counts of a limited service ([`Publisher::cx_counts`]).
    pub fn cx_counts(
        &self,
        key: &proxy_common::service::ServiceKey,
    ) -> Option<proxy_common::limit::CxOpen> {
        self.publisher.cx_counts(key)
    }

    /// The connects the kernel dropped for the service at `key` ([`Publisher::drop_count`]).
    pub fn drop_count(&self, key: &proxy_common::service::ServiceKey) -> Option<u64> {
        self.publisher.drop_count(key)
    }

    /// Whether the service at `key` runs on an older host set ([`Publisher::publish_state`]).
    pub fn publish_state(&self, key: &proxy_common::service::ServiceKey) -> super::PublishState {
        self.publisher.publish_state(key)
    }

    /// Which of the services at `keys` carried traffic ([`Publisher::used`]).
    pub fn used_services(&self, keys: &[proxy_common::service::ServiceKey]) -> Vec<bool> {
        self.publisher.used(keys)
    }

    /// Counters summed over CPUs, with their names.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        self.runtime.counters()
    }

    /// The run-time maps: settings, counters, original destinations, passive health.
    pub fn runtime(&mut self) -> &mut RuntimeMaps {
        &mut self.runtime
    }

    /// Sets the proxy listener that proxy-mode services of `addr`'s family are redirected to
    /// (kept in a map: moving the listener needs no reload).
    pub fn set_proxy_listener(&mut self, addr: SocketAddr) -> Result<(), DataplaneError> {
        self.runtime.set_proxy_listener(addr)
    }

    /// Turns splicing of local socket pairs on or off, for connections established from now on.
    /// Turning it on needs sockops ([`DataplaneOptions::follow_sockets`]).
    pub fn set_splice(&mut self, on: bool) -> Result<(), DataplaneError> {
        if on && !self.follow_sockets {
            return Err(DataplaneError::NoSockops {
                what: "splicing".to_owned(),
            });
        }
        self.runtime.set_splice(on)
    }

    /// Whether the `_rr` program variants are attached, so ROUND_ROBIN services can be
    /// published (kernels with BPF atomic fetch-and-add, 5.12).
    pub fn round_robin(&self) -> bool {
        self.publisher.round_robin()
    }

    /// Whether sockops is attached ([`DataplaneOptions::follow_sockets`]).
    pub fn follows_sockets(&self) -> bool {
        self.follow_sockets
    }

    /// The service address a connection accepted by the proxy listener was dialled to, from the
    /// accepted socket's peer and local addresses; `None` if it was not redirected.
    pub fn original_destination(&self, peer: SocketAddr, local: SocketAddr) -> Option<SocketAddr> {
        self.runtime.original_destinations().lookup(peer, local)
    }

    /// A handle on the original destinations for another task (it shares the map, so it does
    /// not borrow the data path).
    pub fn original_destinations(&self) -> OriginalDestinations {
        self.runtime.original_destinations().clone()
    }

    /// The kernel path's connects per host address ([`RuntimeMaps::host_connects`]).
    pub fn host_connects(
        &self,
    ) -> Result<std::collections::HashMap<SocketAddr, u64>, DataplaneError> {
        self.runtime.host_connects()
    }

    /// The kernel's passive health signal: per backend, cumulative connect failures and resets.
    pub fn passive_counters(&self) -> Result<Vec<PassiveReport>, DataplaneError> {
        self.runtime.passive_counters()
    }

    /// The pin directory of this instance.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Unpins what an earlier version of the daemon left in this instance's directory
    /// (`proxy_common::abi::RETIRED`), and logs pins this version does not know (which stay).
    /// Call it once this daemon serves: its programs are attached (done by [`Dataplane::open`],
    /// which replaced the old links) and every service was published once. Until then the old
    /// pins keep what a rollback to the old version would adopt.
    pub fn remove_retired_pins(&self) -> RetiredPins {
        pin_files::remove_retired(&self.pin_dir)
    }

    /// Leaves the data path as it is: programs attached, maps and links pinned, serving the last
    /// published state, for the next start to adopt (the stop before a restart or an upgrade).
    /// Nothing is detached, not even sk_msg from its sockhash: the handles are forgotten, and
    /// the kernel closes them when the process exits, which releases the instance's lock.
    pub fn release(self) {
        info!(pins = %self.pin_dir.display(), "data path left serving the last published state; the next start adopts it, `proxy uninstall` removes it");
        std::mem::forget(self);
    }

    /// Hands the instance over to a daemon that takes over (`proxy run --takeover`): like
    /// [`Dataplane::release`], but the instance's lock and this process's link descriptors
    /// close now. The pins keep the programs attached until the new daemon replaces them with
    /// its own (as after a stop), so the two daemons' programs never run side by side while
    /// this one drains.
    pub fn hand_over(self) {
        let Self {
            ebpf,
            pin_dir,
            links,
            publisher,
            runtime,
            pair,
            _lock: lock,
            ..
        } = self;
        drop(links);
        drop(lock);
        // Forgotten, as in `release`: dropping the object would detach sk_msg.
        std::mem::forget((ebpf, publisher, runtime, pair));
        info!(pins = %pin_dir.display(), "data path handed over to the daemon taking over");
    }

    /// After a failed start: removes what this run created, and keeps what it adopted. A run
    /// that found a previous state pinned leaves it serving ([`Dataplane::release`]); one that
    /// created the instance removes it ([`Dataplane::shutdown`]).
    pub fn abandon(self) {
        if self.fresh {
            self.shutdown();
        } else {
            self.release();
        }
    }

    /// Detaches every program, removes every pin of this and earlier versions, and removes the
    /// cgroup if this daemon created it (and it is empty). After this the kernel holds nothing of
    /// this instance; pins this version does not know stay, with their directory.
    pub fn shutdown(self) {
        let Self {
            ebpf,
            pin_dir,
            cgroup,
            created_cgroup,
            links,
            follow_sockets: _,
            publisher,
            runtime,
            pair,
            kernel_log,
            fresh: _,
            reaper,
            _lock,
        } = self;
        for (name, link) in links.into_iter().rev() {
            match link.unpin() {
                Ok(fd_link) => drop(fd_link),
                Err(err) => warn!(program = name, %err, "unpinning link failed"),
            }
        }
        // Dropping the object detaches sk_msg from the sockhash; removing the pins frees the maps.
        drop((publisher, runtime, pair, kernel_log, reaper, ebpf));
        pin_files::remove_ours(&pin_dir);
        if created_cgroup && let Err(err) = fs::remove_dir(&cgroup) {
            warn!(cgroup = %cgroup.display(), %err, "cgroup not removed (processes still in it?)");
        }
        info!("data path detached and unpinned");
    }
}
