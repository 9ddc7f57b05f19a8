//! The data path opened inside the test process, for tests that drive the publisher, the
//! settings and the readers directly (`proxy::dataplane::Dataplane`).

use std::{net::SocketAddr, path::PathBuf};

use super::{TestCgroup, unique};
use crate::features::{self, Feature};

/// What loading the whole data path needs: every program is loaded and attached at once.
pub const DATAPLANE_FEATURES: &[Feature] = &[
    Feature::ConnectHooks,
    Feature::SendmsgHooks,
    Feature::RecvmsgHooks,
    Feature::GetpeernameHooks,
    Feature::CgroupLink,
    Feature::NetnsCookie,
    Feature::SockOps,
    Feature::SkMsg,
    Feature::SockHash,
];

/// Prints `SKIP <test>: <reason>` and returns true when the kernel cannot run the data path.
pub fn skip_without_dataplane(test: &str) -> bool {
    features::skip_unless(test, DATAPLANE_FEATURES)
}

/// The data path opened in this test process (`proxy::dataplane::Dataplane`), attached to a
/// test cgroup under a unique instance name; shut down (unpinned, detached) on drop.
pub struct InProcess {
    dp: Option<proxy::dataplane::Dataplane>,
}

impl InProcess {
    /// Opens the data path on `cgroup` with pins under `/sys/fs/bpf/<unique>/`, sockops included.
    pub fn open(cgroup: &TestCgroup) -> Self {
        Self::open_with(cgroup, true)
    }

    /// Like [`InProcess::open`], attaching sockops only when `follow_sockets`.
    pub fn open_with(cgroup: &TestCgroup, follow_sockets: bool) -> Self {
        Self::open_instance(cgroup, &unique("pti"), follow_sockets)
    }

    /// Like [`InProcess::open_with`], with pins under `/sys/fs/bpf/<instance>/` (which may hold
    /// pins already).
    pub fn open_instance(cgroup: &TestCgroup, instance: &str, follow_sockets: bool) -> Self {
        Self::open_options(&proxy::dataplane::DataplaneOptions {
            cgroup: cgroup.path().to_owned(),
            bpffs: PathBuf::from("/sys/fs/bpf"),
            instance: instance.to_owned(),
            follow_sockets,
            kernel_log: proxy_core::config::KernelLogLevel::Off,
            kernel_maps: proxy_core::config::MapSizes::default(),
        })
    }

    /// Like [`InProcess::open_with`] without sockops, the programs loaded with the kernel log
    /// level `kernel_log`.
    pub fn open_logging(
        cgroup: &TestCgroup,
        kernel_log: proxy_core::config::KernelLogLevel,
    ) -> Self {
        Self::open_options(&proxy::dataplane::DataplaneOptions {
            cgroup: cgroup.path().to_owned(),
            bpffs: PathBuf::from("/sys/fs/bpf"),
            instance: unique("ptl"),
            follow_sockets: false,
            kernel_log,
            kernel_maps: proxy_core::config::MapSizes::default(),
        })
    }

    fn open_options(opts: &proxy::dataplane::DataplaneOptions) -> Self {
        let dp = proxy::dataplane::Dataplane::open(opts)
            .unwrap_or_else(|e| panic!("opening the data path: {e:?}"));
        Self { dp: Some(dp) }
    }

    /// A counter by name.
    pub fn counter(&self, name: &str) -> u64 {
        self.counters()
            .into_iter()
            .find_map(|(n, v)| (n == name).then_some(v))
            .unwrap_or_else(|| panic!("no counter {name}"))
    }
}

impl std::ops::Deref for InProcess {
    type Target = proxy::dataplane::Dataplane;
    fn deref(&self) -> &Self::Target {
        self.dp.as_ref().expect("open")
    }
}

impl std::ops::DerefMut for InProcess {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.dp.as_mut().expect("open")
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(dp) = self.dp.take() {
            dp.shutdown();
        }
    }
}

/// A service spec with one priority of equally weighted hosts.
pub fn spec(
    name: &str,
    vip: SocketAddr,
    udp: bool,
    flags: u32,
    hosts: &[SocketAddr],
) -> proxy::dataplane::ServiceSpec {
    let proto = if udp {
        proxy_common::service::PROTO_UDP
    } else {
        proxy_common::service::PROTO_TCP
    };
    let priorities = if hosts.is_empty() {
        Vec::new()
    } else {
        vec![hosts.iter().map(|h| (*h, 1)).collect()]
    };
    proxy::dataplane::ServiceSpec {
        name: name.to_owned(),
        key: proxy::dataplane::publish_key(vip.ip(), vip.port(), proto),
        flags,
        priorities,
        max_connections: None,
        drop_overload: 0,
    }
}
