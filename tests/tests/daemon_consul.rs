//! The Consul catalog backend through the daemon and the kernel (root): a real Consul 1.8.7
//! agent; registrations and check states changed live move connects from a fresh cgroup and
//! namespace, also after a change of Consul's entries that starts no cluster; and ACL tokens
//! against an agent whose ACLs deny by default.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    consul::{Consul, service},
    kernel::{
        BannerServers, Daemon, Netns, TempDir, TestCgroup, require_root, unique, wait_for_backends,
    },
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

/// Polls `/stats` until `cluster.web.consul.acl_denied` exceeds `above` (bounded by [`WITHIN`]).
fn wait_denied(daemon: &Daemon, above: u64) {
    let deadline = std::time::Instant::now() + WITHIN;
    while daemon.stat("cluster.web.consul.acl_denied") <= above {
        assert!(
            std::time::Instant::now() < deadline,
            "no ACL denial counted within {WITHIN:?}:\n{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A Consul with default-deny ACLs: the right token (from a token file) gives the hosts; a
/// wrong token, no token, a token whose policy cannot read the service and one that cannot read
/// its nodes keep the last hosts, are counted and logged with the reason; the
/// fixed token recovers without a restart. No token shows in the log, `/config_dump` or
/// `/stats`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_tokens_never_drain_and_never_show() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.53:8080", "127.0.0.54:8080");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
        ],
    );
    let master = format!("master-{}", unique("tok"));
    let wrong = format!("wrong-{}", unique("tok"));
    let consul = Consul::start_with_acls("dc1", &master).await;
    consul
        .register(service("web-1", "web", "127.0.0.53", 8080))
        .await;
    consul
        .register(service("web-2", "web", "127.0.0.54", 8080))
        .await;
    let dir = TempDir::new();
    let token_file = dir.0.join("consul.token");
    std::fs::write(&token_file, format!("{master}\n")).expect("write token");
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    cluster_type:\n      name: proxy.clusters.consul\n      typed_config: {{ address: \"http://{addr}\", service: web, wait: 1s, token_file: \"{}\", retry_backoff: {{ base_interval: 0.1s, max_interval: 0.5s }} }}\n  - name: api\n    cluster_type:\n      name: proxy.clusters.consul\n      typed_config: {{ address: \"{addr}\", service: api, token: \"{master}\" }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("t"),
        cgroup.path().display(),
        token_file.display(),
        addr = consul.http_addr(),
    );
    let daemon = tokio::task::block_in_place(|| Daemon::start(&config));
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a, b]));

    std::fs::write(&token_file, &wrong).expect("rotate to a wrong token");
    tokio::task::block_in_place(|| wait_denied(&daemon, 0));
    consul.deregister("web-2").await;
    std::fs::write(&token_file, "").expect("no token");
    let denied = tokio::task::block_in_place(|| daemon.stat("cluster.web.consul.acl_denied"));
    tokio::task::block_in_place(|| wait_denied(&daemon, denied));
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a, b]));
    // A token Consul knows, whose policy does not reach `web`: Consul answers an empty list.
    let narrow = consul
        .create_token(
            "service \"api\" { policy = \"read\" }\nnode_prefix \"\" { policy = \"read\" }",
        )
        .await;
    std::fs::write(&token_file, &narrow).expect("a token without service:read on web");
    let denied = tokio::task::block_in_place(|| daemon.stat("cluster.web.consul.acl_denied"));
    tokio::task::block_in_place(|| wait_denied(&daemon, denied));
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a, b]));
    // A token that may read every service but no node: Consul's health answer leaves out the
    // instances on nodes it may not read, so it is empty too.
    let nodeless = consul
        .create_token("service_prefix \"\" { policy = \"read\" }")
        .await;
    std::fs::write(&token_file, &nodeless).expect("a token without node:read");
    let denied = tokio::task::block_in_place(|| daemon.stat("cluster.web.consul.acl_denied"));
    tokio::task::block_in_place(|| wait_denied(&daemon, denied));
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a, b]));
    let log = daemon.log_text();
    for why in [
        "consul does not know the ACL token from consul.token_file",
        "no consul ACL token is set",
        "may not read service \"web\"",
        "may read service \"web\" but not all nodes",
    ] {
        assert_eq!(log.matches(why).count(), 1, "{why:?} logged once:\n{log}");
    }

    std::fs::write(&token_file, &master).expect("fix the token");
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a]));
    let (_, dump) = tokio::task::block_in_place(|| daemon.get("/config_dump")).expect("dump");
    let (_, own) =
        tokio::task::block_in_place(|| daemon.get("/config_dump?format=proxy")).expect("own dump");
    let (_, stats) = tokio::task::block_in_place(|| daemon.get("/stats")).expect("stats");
    let log = daemon.log_text();
    assert!(log.contains("accept the token again"), "{log}");
    for (what, text) in [
        ("log", &log),
        ("/config_dump", &dump),
        ("/config_dump?format=proxy", &own),
        ("/stats", &stats),
    ] {
        assert!(
            ![&master, &wrong, &narrow, &nodeless]
                .iter()
                .any(|secret| text.contains(secret.as_str())),
            "a token shows in the {what}:\n{text}"
        );
    }
    assert!(own.contains("<redacted>"), "{own}");
}

/// A change that starts no cluster leaves every running cluster as it runs: here a Consul
/// entry that moves a chain service (`c` split to `leg`, a cluster the file already runs),
/// after which a catalog change of another service (`a`, a Consul catalog cluster) still
/// reaches the kernel. (Such a change once started every cluster again, and the services it
/// did not touch kept the hosts they had.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_change_keeps_the_other_clusters_following_the_catalog() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a1, a2, c, leg) = (
        "127.0.0.55:8080",
        "127.0.0.56:8080",
        "127.0.0.57:8080",
        "127.0.0.58:8080",
    );
    let _servers = BannerServers::start(
        &netns,
        &[a1, a2, c, leg].map(|addr| (addr.parse().unwrap(), addr, false)),
    );
    let consul = Consul::start("dc1").await;
    consul
        .register(service("a-1", "a", "127.0.0.55", 8080))
        .await;
    consul
        .register(service("a-2", "a", "127.0.0.56", 8080))
        .await;
    for name in ["c", "leg"] {
        let entry =
            serde_json::json!({"Kind": "service-defaults", "Name": name, "Protocol": "http"});
        let (status, body) = consul.write_config(&entry).await;
        assert_eq!(status, 200, "{entry}: {body}");
    }
    let statics = |name: &str, addr: &str| {
        let (ip, port) = addr.split_once(':').unwrap();
        format!(
            "  - name: {name}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: \"{ip}\", port_value: {port} }} }} }}\n"
        )
    };
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: a\n    cluster_type:\n      name: proxy.clusters.consul\n      typed_config: {{ address: \"{addr}\", service: a, datacenter: dc1, wait: 1s }}\n{}{}consul_config_entries: {{ address: \"{addr}\", datacenter: dc1 }}\nservices:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: a }}\n  - {{ name: c, address: 127.77.0.3, port: 80, chain: c }}\n",
        unique("t"),
        cgroup.path().display(),
        statics("c", c),
        statics("leg", leg),
        addr = consul.http_addr(),
    );
    let daemon = tokio::task::block_in_place(|| Daemon::start(&config));
    let chain_vip: SocketAddr = "127.77.0.3:80".parse().unwrap();
    tokio::task::block_in_place(|| {
        wait(&netns, &cgroup, &[a1, a2]);
        wait_for_backends(&netns, &cgroup, chain_vip, &[c], WITHIN);
    });
    // A running Consul cluster counts its blocking queries (one a `wait`); a cluster started
    // again would count from 0.
    let attempts = || daemon.stat("cluster.a.update_attempt");
    let before = tokio::task::block_in_place(|| {
        let deadline = Instant::now() + WITHIN;
        while attempts() < 4 {
            assert!(Instant::now() < deadline, "cluster a made no 4 queries");
            std::thread::sleep(Duration::from_millis(100));
        }
        attempts()
    });
    let split = serde_json::json!({"Kind": "service-splitter", "Name": "c",
        "Splits": [{"Weight": 100, "Service": "leg"}]});
    let (status, body) = consul.write_config(&split).await;
    assert_eq!(status, 200, "{split}: {body}");
    let after = tokio::task::block_in_place(|| {
        wait_for_backends(&netns, &cgroup, chain_vip, &[leg], WITHIN);
        attempts()
    });
    assert!(
        after >= before,
        "cluster a was started again by the entry change ({before} queries, then {after}):\n{}",
        daemon.log_text()
    );
    consul.deregister("a-2").await;
    tokio::task::block_in_place(|| wait(&netns, &cgroup, &[a1]));
}
