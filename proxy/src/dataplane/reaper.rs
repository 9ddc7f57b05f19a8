//! Host ending: the kernel-path sockets connected to hosts that left the routable set are ended
//! with `bpf_sock_destroy` (Linux 6.5), from a TCP and a UDP socket iterator the daemon loads at
//! start (while it still has `CAP_BPF` and `CAP_PERFMON`).
//!
//! connect4/6 record, for services with `SERVICE_F_END`, the service and backend of each socket
//! under its cookie in `SOCK_HOST_V2` ([`SockHost`]). [`Reaper::end`] writes the (service, host)
//! pairs to end into its own map, runs both iterators once over every socket of the daemon's
//! network namespace (the iterators see no other), and each socket whose record is one of them
//! is ended: the application gets `ECONNABORTED` on its next call, a TCP peer a reset. Sockets
//! outside the cgroup, of other services (the same host through another service included) and
//! to other hosts were never recorded or do not match.
//!
//! aya 0.14 cannot relocate a kfunc call, so the two programs (about thirty instructions) are
//! assembled here and loaded with raw bpf(2) (`crate::sys::iter`).

use std::{
    ffi::CStr,
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
};

use aya::maps::{Array, HashMap, Map, MapData, MapError};
use proxy_common::service::{Backend, ServiceKey, SockHost};

use super::btf::{self, BtfError};
use crate::sys::iter as sys;

/// Where the kernel's BTF is.
const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";
/// The kfunc and the two iterator targets, as BTF FUNCs.
const DESTROY: &str = "bpf_sock_destroy";
const ITER_TCP: &str = "bpf_iter_tcp";
const ITER_UDP: &str = "bpf_iter_udp";
/// Key size of the reaper's host map: a `SOCK_HOST_V2` value, which the iterators look up as is.
const SOCK_HOST_SIZE: u32 = size_of::<SockHost>() as u32;
/// Hosts ended in one call, at most: the size of the reaper's host map.
pub const MAX_HOSTS: u32 = 1024;

/// Why host ending is not available, or failed.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    /// The kernel's BTF could not be read.
    #[error("reading {VMLINUX_BTF} (host ending needs BTF): {0}")]
    NoBtf(#[source] std::io::Error),
    /// The kernel's BTF is malformed.
    #[error("parsing {VMLINUX_BTF}: {0}")]
    Btf(#[from] BtfError),
    /// The kernel lacks a function host ending needs.
    #[error("this kernel has no {0} (host ending needs Linux 6.5 or later)")]
    Missing(&'static str),
    /// A bpf(2) call failed.
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A map operation failed.
    #[error("{what}: {source}")]
    Map {
        what: &'static str,
        #[source]
        source: MapError,
    },
    /// More hosts than one call ends.
    #[error("{0} hosts to end at once; at most {MAX_HOSTS}")]
    TooMany(usize),
}

/// The loaded iterators and their maps.
pub struct Reaper {
    /// The (service, host) pairs being ended (value unused), empty between calls.
    ending: HashMap<MapData, SockHost, u8>,
    /// Sockets ended by the current call (one entry).
    ended: Array<MapData, u64>,
    /// The TCP and UDP iterator links.
    links: [OwnedFd; 2],
}

impl Reaper {
    /// Loads the two iterators, which read `sock_host` (the fd of `SOCK_HOST_V2`).
    pub fn load(sock_host: BorrowedFd<'_>) -> Result<Self, ReaperError> {
        let btf = std::fs::read(VMLINUX_BTF).map_err(ReaperError::NoBtf)?;
        let ids = btf::func_ids(&btf, &[DESTROY, ITER_TCP, ITER_UDP])?;
        let id = |name: &'static str| ids.get(name).copied().ok_or(ReaperError::Missing(name));
        let (destroy, tcp, udp) = (id(DESTROY)?, id(ITER_TCP)?, id(ITER_UDP)?);
        let sys_err = |what| move |source| ReaperError::Sys { what, source };
        let ending_fd = sys::create_map(sys::MAP_HASH, SOCK_HOST_SIZE, 1, MAX_HOSTS, c"END_HOSTS")
            .map_err(sys_err("creating the host map"))?;
        let ended_fd = sys::create_map(sys::MAP_ARRAY, 4, 8, 1, c"END_COUNT")
            .map_err(sys_err("creating the count map"))?;
        let fds = Fds {
            sock_host: raw(sock_host),
            ending: raw(ending_fd.as_fd()),
            ended: raw(ended_fd.as_fd()),
        };
        let program = assemble(&fds, destroy);
        let link = |name: &CStr, target: u32, what| {
            let prog = sys::load_iter_program(name, &program, target).map_err(sys_err(what))?;
            sys::link_iter(prog.as_fd()).map_err(sys_err("linking a socket iterator"))
        };
        let links = [
            link(c"end_tcp", tcp, "loading the TCP socket iterator")?,
            link(c"end_udp", udp, "loading the UDP socket iterator")?,
        ];
        let map = |fd: OwnedFd, what| {
            MapData::from_fd(fd).map_err(|source| ReaperError::Map { what, source })
        };
        let ending = HashMap::try_from(Map::HashMap(map(ending_fd, "opening the host map")?))
            .map_err(|source| ReaperError::Map {
                what: "the host map",
                source,
            })?;
        let ended = Array::try_from(Map::Array(map(ended_fd, "opening the count map")?)).map_err(
            |source| ReaperError::Map {
                what: "the count map",
                source,
            },
        )?;
        Ok(Self {
            ending,
            ended,
            links,
        })
    }

    /// Ends every recorded socket that dialled the service of one of `hosts` and went to its
    /// host; how many were ended. The host map is emptied again whatever happens.
    pub fn end(&mut self, hosts: &[SockHost]) -> Result<u64, ReaperError> {
        if hosts.len() > MAX_HOSTS as usize {
            return Err(ReaperError::TooMany(hosts.len()));
        }
        let map_err = |what| move |source| ReaperError::Map { what, source };
        self.ended
            .set(0, 0, 0)
            .map_err(map_err("resetting the count"))?;
        let mut result = Ok(());
        for host in hosts {
            result = result.and(
                self.ending
                    .insert(host, 1, 0)
                    .map_err(map_err("adding a host")),
            );
        }
        if result.is_ok() {
            for link in &self.links {
                result =
                    result.and(
                        sys::run_iter(link.as_fd()).map_err(|source| ReaperError::Sys {
                            what: "running a socket iterator",
                            source,
                        }),
                    );
            }
        }
        for host in hosts {
            // Absent when its insert failed; nothing else to do about it.
            let _ = self.ending.remove(host);
        }
        result?;
        self.ended.get(&0, 0).map_err(map_err("reading the count"))
    }
}

/// Loads the reaper over the `SOCK_HOST_V2` of `ebpf`, or says why not (logged: the daemon
/// runs on without host ending).
pub(super) fn load_from(ebpf: &aya::Ebpf) -> Result<Reaper, String> {
    let Some(Map::LruHashMap(map)) = ebpf.map(proxy_common::abi::maps::SOCK_HOST) else {
        return Err("the object has no SOCK_HOST_V2 map".to_owned());
    };
    Reaper::load(map.fd().as_fd()).map_err(|err| {
        tracing::info!(%err, "host ending unavailable: kernel-path sockets are not ended when their host leaves");
        err.to_string()
    })
}

impl super::Dataplane {
    /// Ends the kernel-path sockets recorded as connected to `hosts` through `service`
    /// ([`Reaper::end`]).
    pub fn end_hosts(
        &mut self,
        service: ServiceKey,
        hosts: &[Backend],
    ) -> Result<u64, super::DataplaneError> {
        let reaper = self
            .reaper
            .as_mut()
            .map_err(|why| super::DataplaneError::NoHostEnding { why: why.clone() })?;
        let hosts: Vec<_> = hosts
            .iter()
            .map(|&backend| SockHost { service, backend })
            .collect();
        reaper
            .end(&hosts)
            .map_err(|err| super::DataplaneError::NoHostEnding {
                why: err.to_string(),
            })
    }

    /// Why host ending is unavailable on this kernel, if it is.
    pub fn host_ending_unavailable(&self) -> Option<&str> {
        self.reaper.as_ref().err().map(String::as_str)
    }
}

/// The raw fds the programs embed (valid while the reaper holds them; the kernel takes its own
/// references at load).
struct Fds {
    sock_host: i32,
    ending: i32,
    ended: i32,
}

fn raw(fd: BorrowedFd<'_>) -> i32 {
    use std::os::fd::AsRawFd as _;
    fd.as_raw_fd()
}

/// One instruction (linux/bpf_common.h), as the kernel reads it on a little-endian machine.
const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    code as u64
        | ((src << 4 | dst) as u64) << 8
        | (off as u16 as u64) << 16
        | (imm as u32 as u64) << 32
}

/// `r1 = map fd` (`BPF_LD | BPF_IMM | BPF_DW` with `BPF_PSEUDO_MAP_FD`): two instructions.
fn load_map(fd: i32) -> [u64; 2] {
    [insn(0x18, 1, 1, 0, fd), 0]
}

/// The iterator program, the same for TCP and UDP (the socket is the pointer at ctx + 8 in
/// both): cookie = bpf_get_socket_cookie(sk); record = SOCK_HOST[cookie] else skip;
/// ENDING[record] else skip; bpf_sock_destroy(sk) == 0 else skip; ENDED[0] += 1.
fn assemble(fds: &Fds, destroy_btf_id: u32) -> Vec<u64> {
    const EXIT: i16 = i16::MAX; // patched below
    let mut p = vec![
        insn(0x79, 6, 1, 8, 0),    // r6 = *(u64 *)(r1 + 8): the socket
        insn(0x15, 6, 0, EXIT, 0), // if r6 == 0 goto exit
        insn(0xbf, 1, 6, 0, 0),    // r1 = r6
        insn(0x85, 0, 0, 0, 46),   // call bpf_get_socket_cookie
        insn(0x7b, 10, 0, -8, 0),  // *(u64 *)(r10 - 8) = r0
    ];
    p.extend(load_map(fds.sock_host));
    p.extend([
        insn(0xbf, 2, 10, 0, 0),   // r2 = r10
        insn(0x07, 2, 0, 0, -8),   // r2 += -8
        insn(0x85, 0, 0, 0, 1),    // call bpf_map_lookup_elem
        insn(0x15, 0, 0, EXIT, 0), // if r0 == 0 goto exit
        insn(0xbf, 2, 0, 0, 0),    // r2 = r0: the (service, backend) record is the key
    ]);
    p.extend(load_map(fds.ending));
    p.extend([
        insn(0x85, 0, 0, 0, 1),                     // call bpf_map_lookup_elem
        insn(0x15, 0, 0, EXIT, 0),                  // if r0 == 0 goto exit
        insn(0xbf, 1, 6, 0, 0),                     // r1 = r6
        insn(0x85, 0, 2, 0, destroy_btf_id as i32), // call kfunc bpf_sock_destroy
        insn(0x55, 0, 0, EXIT, 0),                  // if r0 != 0 goto exit
        insn(0x62, 10, 0, -12, 0),                  // *(u32 *)(r10 - 12) = 0
        insn(0xbf, 2, 10, 0, 0),                    // r2 = r10
        insn(0x07, 2, 0, 0, -12),                   // r2 += -12
    ]);
    p.extend(load_map(fds.ended));
    p.extend([
        insn(0x85, 0, 0, 0, 1),    // call bpf_map_lookup_elem
        insn(0x15, 0, 0, EXIT, 0), // if r0 == 0 goto exit
        insn(0xb7, 1, 0, 0, 1),    // r1 = 1
        insn(0xdb, 0, 1, 0, 0),    // lock *(u64 *)(r0 + 0) += r1
    ]);
    let exit = p.len();
    p.extend([insn(0xb7, 0, 0, 0, 0), insn(0x95, 0, 0, 0, 0)]); // return 0
    for (at, ins) in p.iter_mut().enumerate() {
        if (*ins >> 16) as u16 as i16 == EXIT && matches!(*ins as u8, 0x15 | 0x55) {
            let off = (exit - at - 1) as i16;
            *ins = (*ins & !(0xffff << 16)) | u64::from(off as u16) << 16;
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_skip_jumps_to_the_exit_and_the_maps_are_pseudo_fds() {
        let fds = Fds {
            sock_host: 7,
            ending: 8,
            ended: 9,
        };
        let p = assemble(&fds, 4242);
        let exit = p.len() - 2;
        assert_eq!(p[exit + 1] as u8, 0x95, "ends with exit");
        let jumps: Vec<_> = (0..p.len())
            .filter(|&i| matches!(p[i] as u8, 0x15 | 0x55))
            .collect();
        assert_eq!(jumps.len(), 5);
        for i in jumps {
            let off = (p[i] >> 16) as u16 as i16;
            assert_eq!(i as i64 + 1 + i64::from(off), exit as i64, "jump at {i}");
        }
        let maps: Vec<_> = p
            .iter()
            .filter(|i| **i as u8 == 0x18)
            .map(|i| ((*i >> 12) & 0xf, (*i >> 32) as i32))
            .collect();
        assert_eq!(maps, [(1, 7), (1, 8), (1, 9)]);
        let kfunc = p
            .iter()
            .find(|i| (**i as u8, (**i >> 12) & 0xf) == (0x85, 2));
        assert_eq!(kfunc.map(|i| (*i >> 32) as u32), Some(4242));
    }

    /// As root on a kernel with `bpf_sock_destroy`: the iterators load, and end exactly the
    /// loopback socket recorded with the host asked for (its peer sees a reset); an unrecorded
    /// socket to the same host stays open.
    #[test]
    fn ends_only_the_recorded_socket_of_the_host_and_service() {
        use std::{
            io::{Read as _, Write as _},
            net::{TcpListener, TcpStream},
        };
        if crate::sys::effective_uid() != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let fd = sys::create_map(9, 8, SOCK_HOST_SIZE, 16, c"TEST_SOCK_HOST").unwrap(); // LRU hash
        let mut reaper = match Reaper::load(fd.as_fd()) {
            Err(ReaperError::Missing(name)) => {
                eprintln!("skipped: this kernel has no {name}");
                return;
            }
            other => other.unwrap(),
        };
        let data = MapData::from_fd(fd).unwrap();
        let mut sock_host: HashMap<_, u64, SockHost> =
            HashMap::try_from(Map::LruHashMap(data)).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let service = |last| {
            let addr = std::net::IpAddr::from([127, 77, 0, last]);
            ServiceKey::new(addr, 80, proxy_common::service::PROTO_TCP)
        };
        let backend = crate::dataplane::backend_of(listener.local_addr().unwrap());
        let host = SockHost {
            service: service(1),
            backend,
        };
        let recorded = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut recorded_peer, _) = listener.accept().unwrap();
        let mut other = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut other_peer, _) = listener.accept().unwrap();
        let cookie = crate::sys::socket_cookie(recorded.as_fd()).unwrap();
        sock_host.insert(cookie, host, 0).unwrap();
        let elsewhere = SockHost {
            backend: crate::dataplane::backend_of("127.0.0.1:1".parse().unwrap()),
            ..host
        };
        assert_eq!(
            reaper.end(&[elsewhere]).unwrap(),
            0,
            "another host: nothing ended"
        );
        let other_service = SockHost {
            service: service(2),
            ..host
        };
        assert_eq!(
            reaper.end(&[other_service]).unwrap(),
            0,
            "the host through another service: nothing ended"
        );
        assert_eq!(reaper.end(&[host]).unwrap(), 1);
        let mut buf = [0u8; 4];
        let err = (&recorded).read(&mut buf).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ECONNABORTED), "{err}");
        let err = recorded_peer.read(&mut buf).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
        other.write_all(b"ping").unwrap();
        other_peer.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        assert_eq!(reaper.ending.keys().count(), 0, "the host map is emptied");
    }
}
