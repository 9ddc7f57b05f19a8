//! Consul discovery chains executed by the kernel path (root): the real daemon compiles the
//! chain from config entries, and connects from a fresh cgroup in a fresh network namespace
//! follow it: a 90/10 split by subset, a redirect, and failover when the primary's hosts fail
//! their active health checks (and back when they recover); the opt-ins beyond Consul
//! (health-aware splits, tcp splits, failover on a healthy share); a resolver's `LoadBalancer`
//! choosing for the kernel, and its `HashPolicies` leaving the chain out. And entries live from
//! a real Consul: a `consul config write` moves connects within one watch round trip, and moves
//! a proxy-mode HTTP service without one failed request.

use std::{
    io::Read as _,
    net::{SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use integration_tests::{
    consul::Consul,
    http_servers::{Servers, http_server},
    kernel::{
        BannerServers, Daemon, InCgroup, Netns, Probe, TestCgroup, assert_share, free_port,
        http_get, require_root, unique, wait_for_backends,
    },
};

const VIP: &str = "127.77.0.1:80";

fn header(cgroup: &TestCgroup) -> String {
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\n",
        unique("t"),
        cgroup.path().display()
    )
}

fn endpoint(addr: SocketAddr, version: &str) -> String {
    format!(
        "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n              metadata: {{ filter_metadata: {{ envoy.lb: {{ version: {version} }} }} }}\n",
        addr.ip(),
        addr.port()
    )
}

fn cluster(name: &str, endpoints: &str, extra: &str) -> String {
    format!(
        "  - name: {name}\n{extra}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}"
    )
}

#[test]
fn split_by_subset_follows_the_weights() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (v1, v2): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.12:8082".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(v1, "v1", false), (v2, "v2", false)]);
    let config = format!(
        "{}clusters:\n{}config_entries:\n  - {{ Kind: service-defaults, Name: web, Protocol: http }}\n  - Kind: service-splitter\n    Name: web\n    Splits: [{{ Weight: 90, ServiceSubset: v1 }}, {{ Weight: 10, ServiceSubset: v2 }}]\n  - Kind: service-resolver\n    Name: web\n    Subsets:\n      v1: {{ Filter: \"Service.Meta.version == v1\" }}\n      v2: {{ Filter: \"Service.Meta.version == v2\" }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n",
        header(&cgroup),
        cluster("web", &(endpoint(v1, "v1") + &endpoint(v2, "v2")), ""),
    );
    let daemon = Daemon::start(&config);
    let n = 2000;
    let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
    assert!(probe.errors.is_empty(), "{probe:?}");
    assert_share("v1", probe.count("v1"), n, 0.9);
    assert_share("v2", probe.count("v2"), n, 0.1);

    let (code, body) = http_get(daemon.admin, "/chain/web").expect("admin");
    assert_eq!(code, 200);
    let chain: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(chain["StartNode"], "splitter:web.default.default");
    assert_eq!(
        chain["Targets"]["v2.web.default.default.dc1"]["ServiceSubset"],
        "v2"
    );
}

#[test]
fn redirect_sends_connects_to_the_redirected_service() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (web, other): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.13:8083".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(web, "web", false), (other, "other", false)]);
    let config = format!(
        "{}clusters:\n{}{}config_entries:\n  - {{ Kind: service-resolver, Name: web, Redirect: {{ Service: other }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n",
        header(&cgroup),
        cluster("web", &endpoint(web, "a"), ""),
        cluster("other", &endpoint(other, "b"), ""),
    );
    let _daemon = Daemon::start(&config);
    let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), 50, false);
    assert_eq!(probe.count("other"), 50, "{probe:?}");
}

/// Fast TCP health checking (connect only) so the test sees transitions within a second.
const FAST_TCP_CHECK: &str = "    health_checks:\n      - { timeout: 0.2s, interval: 0.2s, no_traffic_interval: 0.2s, unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {} }\n";

#[test]
fn failover_when_the_primary_fails_health_checks_and_back() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    // The daemon health-checks from the host's loopback; clients connect inside the namespace.
    // The primary's address is a free host port with nothing listening: its check fails.
    let primary = free_port();
    let backup: SocketAddr = "127.0.0.22:8082".parse().unwrap();
    let health_target = TcpListener::bind(backup).expect("backup health endpoint on the host");
    let _servers = BannerServers::start(
        &netns,
        &[(primary, "primary", false), (backup, "backup", false)],
    );
    let config = format!(
        "{}clusters:\n{}{}config_entries:\n  - Kind: service-resolver\n    Name: web\n    Failover:\n      '*': {{ Service: backup }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n",
        header(&cgroup),
        cluster("web", &endpoint(primary, "a"), FAST_TCP_CHECK),
        cluster("backup", &endpoint(backup, "b"), FAST_TCP_CHECK),
    );
    let _daemon = Daemon::start(&config);
    let vip: SocketAddr = VIP.parse().unwrap();
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 30, false);
    assert_eq!(probe.count("backup"), 30, "primary is down: {probe:?}");

    // The primary comes up on the host: its check passes and traffic returns to it.
    let _primary_up = TcpListener::bind(primary).expect("primary health endpoint");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, 10, false);
        if probe.count("primary") == 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "traffic did not return to the primary: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(health_target);
}

#[test]
fn a_split_leg_without_hosts_fails_its_share_unless_health_aware() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (web, canary): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.14:8084".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(web, "web", false), (canary, "canary", false)]);
    let entries = "config_entries:\n  - { Kind: service-defaults, Name: web, Protocol: http }\n  - { Kind: service-defaults, Name: canary, Protocol: http }\n  - Kind: service-splitter\n    Name: web\n    Splits: [{ Weight: 80, Service: web }, { Weight: 20, Service: canary }]\n";
    // The canary's only host is marked UNHEALTHY: that leg has nowhere to go.
    let canary_endpoint = endpoint(canary, "c").replace(
        "              metadata:",
        "              health_status: UNHEALTHY\n              metadata:",
    );
    let config = |options: &str| {
        format!(
            "{}clusters:\n{}{}{entries}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web{options} }}\n",
            header(&cgroup),
            cluster("web", &endpoint(web, "a"), ""),
            cluster("canary", &canary_endpoint, ""),
        )
    };
    let n = 1000;
    let vip: SocketAddr = VIP.parse().unwrap();
    {
        let _daemon = Daemon::start(&config(""));
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, n, false);
        assert_share("web", probe.count("web"), n, 0.8);
        let refused = probe.errors.get("ECONNREFUSED").copied().unwrap_or(0);
        assert_share("refused", refused, n, 0.2);
    }
    let _daemon = Daemon::start(&config(", chain_options: { health_aware_splits: true }"));
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 200, false);
    assert_eq!(
        probe.count("web"),
        200,
        "health-aware: the canary's share goes to web: {probe:?}"
    );
}

/// The two opt-ins beyond Consul that no other test runs through the kernel. `tcp_splits`: a
/// splitter on a tcp service splits connects by weight. `failover_threshold_percent`: a target
/// with one healthy host of four (25 %) serves while the threshold is unset (Consul fails over
/// only when none is healthy), and fails over to the resolver's failover target at 50.
#[test]
fn chain_opt_ins_split_tcp_and_fail_over_on_a_healthy_share() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let addr = |last: u8, port: u16| SocketAddr::from(([127, 0, 0, last], port));
    let (web, canary, backup) = (addr(31, 8081), addr(32, 8082), addr(33, 8083));
    let _servers = BannerServers::start(
        &netns,
        &[
            (web, "web", false),
            (canary, "canary", false),
            (backup, "backup", false),
        ],
    );
    let vip: SocketAddr = VIP.parse().unwrap();

    let split = format!(
        "{}clusters:\n{}{}config_entries:\n  - Kind: service-splitter\n    Name: web\n    Splits: [{{ Weight: 70, Service: web }}, {{ Weight: 30, Service: canary }}]\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web, chain_options: {{ tcp_splits: true }} }}\n",
        header(&cgroup),
        cluster("web", &endpoint(web, "a"), ""),
        cluster("canary", &endpoint(canary, "c"), ""),
    );
    {
        let _daemon = Daemon::start(&split);
        let n = 1000;
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, n, false);
        assert!(probe.errors.is_empty(), "{probe:?}");
        assert_share("canary", probe.count("canary"), n, 0.3);
    }

    // Three of web's four hosts are UNHEALTHY: 25 % healthy.
    let unhealthy = |a: SocketAddr| {
        endpoint(a, "a").replace(
            "              metadata:",
            "              health_status: UNHEALTHY\n              metadata:",
        )
    };
    let web_hosts = endpoint(web, "a")
        + &unhealthy(addr(34, 8084))
        + &unhealthy(addr(35, 8085))
        + &unhealthy(addr(36, 8086));
    let failover = |options: &str| {
        format!(
            "{}clusters:\n{}{}config_entries:\n  - Kind: service-resolver\n    Name: web\n    Failover:\n      '*': {{ Service: backup }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web{options} }}\n",
            header(&cgroup),
            cluster("web", &web_hosts, ""),
            cluster("backup", &endpoint(backup, "b"), ""),
        )
    };
    {
        let _daemon = Daemon::start(&failover(""));
        wait_for_backends(&netns, &cgroup, vip, &["web"], Duration::from_secs(10));
    }
    let _daemon = Daemon::start(&failover(
        ", chain_options: { failover_threshold_percent: 50 }",
    ));
    wait_for_backends(&netns, &cgroup, vip, &["backup"], Duration::from_secs(10));
}

/// Bound from a `consul config write`'s return to the first connect that follows it: one watch
/// round trip (the blocking query wakes on the write, `consul_real`'s `ROUND_TRIP`, 1 s with
/// its reasons, measured at about 50 ms) plus the daemon's composition, apply and publish,
/// which happen in the same turn of its run loop (milliseconds). A daemon that waited for the
/// next poll instead would take the watch's `wait` (30 s).
const WRITE_TO_TRAFFIC: Duration = Duration::from_secs(1);

/// Connects to the VIP until a connect reaches `v2` (bounded by `within`), then 20 more; returns
/// `{"first_v2": <ns since base>, "after": {banner: count}, "errors": n}`.
fn until_v2(base: Instant, within: Duration) -> String {
    let once = || -> std::io::Result<String> {
        let mut stream = TcpStream::connect_timeout(&VIP.parse().unwrap(), Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        Ok(text.lines().next().unwrap_or_default().to_owned())
    };
    let (mut first_v2, mut errors) = (None, 0_u32);
    let mut after = std::collections::BTreeMap::<String, u32>::new();
    let deadline = base + within;
    while first_v2.is_none() && Instant::now() < deadline {
        match once() {
            Ok(banner) if banner == "v2" => first_v2 = Some(base.elapsed().as_nanos()),
            Ok(_) => {}
            Err(_) => errors += 1,
        }
    }
    for _ in 0..20 {
        match once() {
            Ok(banner) => *after.entry(banner).or_default() += 1,
            Err(_) => errors += 1,
        }
    }
    serde_json::json!({"first_v2": first_v2, "after": after, "errors": errors}).to_string()
}

/// Entries live from a real Consul: the daemon starts on Consul's resolver (everything to the
/// v1 subset), and a `consul config write` of a splitter sending everything to v2 moves the
/// connects of a loop running meanwhile within [`WRITE_TO_TRAFFIC`] of the write's return. A
/// splitter Consul accepts but this daemon cannot use leaves only its chain on the one in force:
/// connects stay on v2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consul_config_write_moves_connects_within_one_watch_round_trip() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (v1, v2): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.12:8082".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(v1, "v1", false), (v2, "v2", false)]);
    let consul = Consul::start("dc1").await;
    let entries = [
        serde_json::json!({"Kind": "service-defaults", "Name": "web", "Protocol": "http"}),
        serde_json::json!({"Kind": "service-resolver", "Name": "web", "DefaultSubset": "v1",
            "Subsets": {"v1": {"Filter": "Service.Meta.version == v1"},
                        "v2": {"Filter": "Service.Meta.version == v2"}}}),
    ];
    for entry in &entries {
        let (status, body) = consul.write_config(entry).await;
        assert_eq!(status, 200, "{entry}: {body}");
    }
    let config = format!(
        "{}clusters:\n{}consul_config_entries: {{ address: \"{}\", datacenter: dc1 }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n",
        header(&cgroup),
        cluster("web", &(endpoint(v1, "v1") + &endpoint(v2, "v2")), ""),
        consul.http_addr(),
    );
    let daemon = tokio::task::block_in_place(|| Daemon::start(&config));
    let vip: SocketAddr = VIP.parse().unwrap();
    let within = Duration::from_secs(15);
    tokio::task::block_in_place(|| wait_for_backends(&netns, &cgroup, vip, &["v1"], within));

    let base = Instant::now();
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || until_v2(base, within));
    let split = serde_json::json!({"Kind": "service-splitter", "Name": "web",
        "Splits": [{"Weight": 100, "ServiceSubset": "v2"}]});
    let (status, body) = consul.write_config(&split).await;
    let written = base.elapsed();
    assert_eq!(status, 200, "{split}: {body}");
    let report = tokio::task::block_in_place(|| client.wait(within + Duration::from_secs(10)));
    let report: serde_json::Value = serde_json::from_str(&report).expect(&report);
    let first_v2 = report["first_v2"].as_u64().map(Duration::from_nanos);
    let Some(first_v2) = first_v2 else {
        panic!(
            "no connect reached v2 within {within:?}: {report}\n{}",
            daemon.log_text()
        );
    };
    let took = first_v2.saturating_sub(written);
    eprintln!("write to the first connect on v2: {took:?}");
    assert!(took < WRITE_TO_TRAFFIC, "{took:?}: {report}");
    assert_eq!(report["errors"], 0, "{report}");
    assert_eq!(report["after"], serde_json::json!({"v2": 20}), "{report}");

    // Consul 1.8.7 accepts a negative weight; this daemon cannot use it: the chain that reads it
    // keeps the chain in force (the others would compose on), and says why.
    let negative = serde_json::json!({"Kind": "service-splitter", "Name": "web",
        "Splits": [{"Weight": 200, "ServiceSubset": "v1"}, {"Weight": -100, "ServiceSubset": "v2"}]});
    let (status, body) = consul.write_config(&negative).await;
    assert_eq!(status, 200, "{negative}: {body}");
    let refused = "the service keeps the chain in force";
    let logged = tokio::task::block_in_place(|| daemon.wait_log(refused, within));
    assert!(logged, "{}", daemon.log_text());
    assert!(
        daemon.log_text().contains("negative Weight"),
        "{}",
        daemon.log_text()
    );
    let probe =
        tokio::task::block_in_place(|| Probe::run(&netns, Some(cgroup.path()), vip, 50, false));
    assert_eq!(probe.count("v2"), 50, "the state in force stays: {probe:?}");
    // The first union, the splitter to v2, the negative splitter (published; its chain kept).
    assert_eq!(daemon.stat("consul_entries.entries_change"), 3);
    assert_eq!(daemon.stat("server.chain_failures"), 1, "web's chain kept");
    assert_eq!(daemon.stat("consul_entries.update_failure"), 0);
}

/// GETs `/` on the VIP, one request per connection, until v2 has answered and then v1 has
/// answered 200 times in a row (bounded by `within`); writes the number of runs of one answer
/// so far to `progress` as each run starts. Returns the runs, `["v1 /", 120]` and so on, and
/// the failures, as JSON.
fn http_runs(within: Duration, progress: &std::path::Path) -> String {
    let once = || -> std::io::Result<String> {
        let mut stream = TcpStream::connect_timeout(&VIP.parse().unwrap(), Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        std::io::Write::write_all(
            &mut stream,
            b"GET / HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n",
        )?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        match text.split_once("\r\n\r\n") {
            Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_owned()),
            _ => Ok(format!(
                "not 200: {}",
                text.lines().next().unwrap_or_default()
            )),
        }
    };
    let deadline = Instant::now() + within;
    let (mut runs, mut errors) = (Vec::<(String, u32)>::new(), Vec::<String>::new());
    let settled = |runs: &[(String, u32)]| {
        runs.iter().any(|(answer, _)| answer == "v2 /")
            && runs
                .last()
                .is_some_and(|(answer, n)| answer == "v1 /" && *n >= 200)
    };
    while !settled(&runs) && Instant::now() < deadline {
        let answer = once().unwrap_or_else(|e| format!("error: {e}"));
        if answer.starts_with("error") || answer.starts_with("not 200") {
            errors.push(answer);
            continue;
        }
        match runs.last_mut() {
            Some((last, n)) if *last == answer => *n += 1,
            _ => {
                runs.push((answer, 1));
                std::fs::write(progress, runs.len().to_string()).expect("the progress file");
            }
        }
    }
    serde_json::json!({"runs": runs, "errors": errors}).to_string()
}

/// A change from a control plane to a proxy-mode HTTP service is as gapless as a reload: a
/// `consul config write` of a splitter moves the service from v1 to v2, and a delete moves it
/// back, each taken by a successor proxy (the path a reload takes) while a request loop runs
/// through the service; not one request fails, and the answers go from v1 to v2 and settle
/// on v1 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_config_writes_move_a_proxy_mode_service_without_a_failed_request() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (v1, v2): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.12:8082".parse().unwrap(),
    );
    let _servers = Servers::start(&netns, &[(v1, "v1"), (v2, "v2")], http_server);
    // Inside the namespace, where the daemon (and its proxy listener) runs.
    let consul = Consul::start_in(&netns, "dc1").await;
    let entries = [
        serde_json::json!({"Kind": "service-defaults", "Name": "web", "Protocol": "http"}),
        serde_json::json!({"Kind": "service-resolver", "Name": "web", "DefaultSubset": "v1",
            "Subsets": {"v1": {"Filter": "Service.Meta.version == v1"},
                        "v2": {"Filter": "Service.Meta.version == v2"}}}),
    ];
    for entry in &entries {
        let (status, body) = consul.write_config(entry).await;
        assert_eq!(status, 200, "{entry}: {body}");
    }
    let config = format!(
        "{}proxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n{}consul_config_entries: {{ address: \"{}\", datacenter: dc1 }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web, mode: proxy }}\n",
        header(&cgroup),
        cluster("web", &(endpoint(v1, "v1") + &endpoint(v2, "v2")), ""),
        consul.http_addr(),
    );
    // The file alone is fine: `web` waits for Consul's service-defaults, and `proxy check`
    // says so.
    let dir = integration_tests::kernel::TempDir::new();
    let file = dir.0.join("config.yaml");
    std::fs::write(&file, config.replace("{admin}", "127.0.0.1:0")).unwrap();
    let checked = std::process::Command::new(integration_tests::kernel::proxy_bin())
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success(), "{said}");
    assert!(
        said.contains("note: service \"web\" waits for Consul's config entries"),
        "{said}"
    );
    let daemon = tokio::task::block_in_place(|| Daemon::start_in(&netns, &config));
    let took = "the proxy path took the new services";
    // One at the start already: Consul's service-defaults made `web` HTTP, so its chain came
    // with Consul's first answer.
    let at_start = daemon.log_text().matches(took).count();
    let within = Duration::from_secs(30);
    let progress = dir.0.join("runs");
    let client = {
        let progress = progress.clone();
        InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            http_runs(within, &progress)
        })
    };
    // Each change is made once the loop has answers from the state before it.
    let runs_reach = async |n: usize| {
        let deadline = Instant::now() + within;
        loop {
            let text = std::fs::read_to_string(&progress).unwrap_or_default();
            if text.parse::<usize>().is_ok_and(|runs| runs >= n) {
                return;
            }
            assert!(Instant::now() < deadline, "the loop never saw {n} run(s)");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    runs_reach(1).await;
    let split = serde_json::json!({"Kind": "service-splitter", "Name": "web",
        "Splits": [{"Weight": 100, "ServiceSubset": "v2"}]});
    let (status, body) = consul.write_config(&split).await;
    assert_eq!(status, 200, "{split}: {body}");
    let applied = tokio::task::block_in_place(|| daemon.wait_log(took, within));
    assert!(applied, "{}", daemon.log_text());
    runs_reach(2).await;
    consul.delete_config("service-splitter", "web").await;
    let report = tokio::task::block_in_place(|| client.wait(within + Duration::from_secs(10)));
    let report: serde_json::Value = serde_json::from_str(&report).expect(&report);
    eprintln!("requests across two control-plane changes: {report}");
    assert_eq!(report["errors"], serde_json::json!([]), "{report}");
    let order: Vec<&str> = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|run| run[0].as_str())
        .collect();
    // Each change moves the answers; the old proxy may take a connection in the moment it
    // takes to stop accepting (served on its table all the same), so a run may interleave
    // there, but the answers start on v1, reach v2 and settle on v1.
    assert_eq!(order.first(), Some(&"v1 /"), "{report}");
    assert!(order.contains(&"v2 /"), "{report}");
    let last = report["runs"].as_array().unwrap().last().unwrap();
    assert_eq!(last, &serde_json::json!(["v1 /", 200]), "{report}");
    assert_eq!(
        daemon.log_text().matches(took).count() - at_start,
        2,
        "each change taken by a successor proxy:\n{}",
        daemon.log_text()
    );
    assert_eq!(daemon.stat("consul_entries.update_failure"), 0);
}

/// A service-resolver's `LoadBalancer` on the kernel path: `Policy: maglev` makes the
/// daemon's direct service hash (its default key, the client's process: every connect of one
/// process reaches one host, though the cluster's own policy is random), and `HashPolicies`,
/// which the kernel cannot key on, leave the chain that reads them out, with the reason logged
/// and counted in `server.chain_failures`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolvers_load_balancer_chooses_on_the_kernel_path() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let hosts: Vec<SocketAddr> = ["127.0.0.11:8081", "127.0.0.12:8082", "127.0.0.13:8083"]
        .iter()
        .map(|h| h.parse().unwrap())
        .collect();
    let banners = ["h1", "h2", "h3"];
    let servers: Vec<(SocketAddr, &str, bool)> = hosts
        .iter()
        .zip(banners)
        .map(|(h, b)| (*h, b, false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    // Consul 1.8's agent has no LoadBalancer yet: the entries are the file's. With Consul's
    // entries configured, a chain the file's cannot serve is left out rather than refused.
    let consul = Consul::start("dc1").await;
    let endpoints: String = hosts.iter().map(|h| endpoint(*h, "a")).collect();
    let config = format!(
        "{}clusters:\n{}{}config_entries:\n  - {{ Kind: service-resolver, Name: web, LoadBalancer: {{ Policy: maglev }} }}\n  - {{ Kind: service-resolver, Name: api, LoadBalancer: {{ Policy: maglev, HashPolicies: [{{ SourceIP: true }}] }} }}\nconsul_config_entries: {{ address: \"{}\", datacenter: dc1 }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n  - {{ name: api, address: 127.77.0.2, port: 80, chain: api }}\n",
        header(&cgroup),
        cluster("web", &endpoints, ""),
        cluster("api", &endpoints, ""),
        consul.http_addr(),
    );
    let daemon = tokio::task::block_in_place(|| Daemon::start(&config));
    let within = Duration::from_secs(15);
    let reason = "sets LoadBalancer.HashPolicies";
    assert!(
        tokio::task::block_in_place(|| daemon.wait_log(reason, within)),
        "{}",
        daemon.log_text()
    );
    assert!(
        daemon.log_text().contains("the service is left out"),
        "{}",
        daemon.log_text()
    );
    assert_eq!(daemon.stat("server.chain_failures"), 1, "api's chain");
    let vip: SocketAddr = VIP.parse().unwrap();
    let deadline = Instant::now() + within;
    // Each probe is a process of its own: every connect of one reaches one host.
    let mut probes = 0;
    while probes < 3 {
        let probe =
            tokio::task::block_in_place(|| Probe::run(&netns, Some(cgroup.path()), vip, 30, false));
        if probe.errors.is_empty() {
            assert_eq!(probe.backends.len(), 1, "one process, one host: {probe:?}");
            probes += 1;
        } else {
            // The chain is not published yet: nothing serves the VIP.
            assert!(Instant::now() < deadline, "web never served: {probe:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
