//! The Consul catalog backend through the daemon and the kernel (root): a real Consul 1.8.7
//! agent; registrations and check states changed live move connects from a fresh cgroup and
//! namespace.

use std::{net::SocketAddr, time::Duration};

use integration_tests::{
    consul::{Consul, service},
    kernel::{BannerServers, Daemon, Netns, TestCgroup, require_root, unique},
};

/// Bound of every wait for connects to follow a change.
const WITHIN: Duration = Duration::from_secs(20);

fn wait(netns: &Netns, cgroup: &TestCgroup, want: &[&str]) {
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    integration_tests::kernel::wait_for_backends(netns, cgroup, vip, want, WITHIN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_changes_move_connects() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.51:8080", "127.0.0.52:8080");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
        ],
    );
    let consul = Consul::start("dc1").await;
    consul
        .register(service("web-1", "web", "127.0.0.51", 8080))
        .await;
    consul
        .register(service("web-2", "web", "127.0.0.52", 8080))
        .await;
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    cluster_type:\n      name: proxy.clusters.consul\n      typed_config: {{ address: \"{}\", service: web, datacenter: dc1, wait: 1s }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("t"),
        cgroup.path().display(),
        consul.http_addr(),
    );
    let _daemon = tokio::task::block_in_place(|| Daemon::start(&config));
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a, b]));
    consul.deregister("web-2").await;
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a]));
}
