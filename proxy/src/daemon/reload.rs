//! What a reload changes: the difference between the configuration in force and a new one, as
//! the clusters to start and stop, the services to republish or remove, and whether the proxy
//! path takes new services; or why the new one needs a restart instead.
//!
//! Equality is by value over every field of a cluster or a service (their derived `PartialEq`,
//! which covers the fields serde skips). A cluster that is equal keeps its running discovery, health
//! state and watches; a service that is equal, and whose clusters all stay, keeps its publisher,
//! so its kernel entry is not rewritten.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use proxy_common::service::ServiceKey;
use proxy_core::config::{
    Cluster, Config, Service, ServiceMode, sources::xds::clusters::eds_clusters,
};

/// The difference a reload applies.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Clusters to start: new, or changed (started before the old instance stops).
    pub start: BTreeSet<String>,
    /// Clusters to stop: removed, or changed.
    pub stop: BTreeSet<String>,
    /// The xDS connections restart: the `xds` block, or a staying EDS cluster's
    /// `eds_cluster_config`, changed. Every EDS cluster is then in `start` and `stop`.
    /// Otherwise EDS clusters added or removed are subscribed or unsubscribed on the running
    /// streams, and the others keep theirs.
    pub xds_restart: bool,
    /// Services whose publisher is started or replaced: new, changed, or reading a cluster in
    /// `start`.
    pub publish: BTreeSet<ServiceKey>,
    /// Services to remove from the kernel.
    pub remove: BTreeSet<ServiceKey>,
    /// The proxy path's services change: a successor proxy with the new table takes over the
    /// listening sockets, and the old one drains its live connections.
    pub proxy_path: bool,
    /// Clusters and services that stay as they run.
    pub kept_clusters: usize,
    pub kept_services: usize,
}

impl Plan {
    /// One line for the log and the reload command.
    pub fn summary(&self) -> String {
        let started = self.start.difference(&self.stop).count();
        let stopped = self.stop.difference(&self.start).count();
        let replaced = self.start.intersection(&self.stop).count();
        format!(
            "clusters: {started} added, {stopped} removed, {replaced} changed, {} unchanged; \
             services: {} published, {} removed, {} unchanged{}{}",
            self.kept_clusters,
            self.publish.len(),
            self.remove.len(),
            self.kept_services,
            if self.xds_restart {
                "; the xDS connections restarted"
            } else {
                ""
            },
            if self.proxy_path {
                "; the proxy path took the new services (live connections drain on the old)"
            } else {
                ""
            }
        )
    }

    /// Whether nothing changes.
    pub fn is_empty(&self) -> bool {
        self.start.is_empty()
            && self.stop.is_empty()
            && self.publish.is_empty()
            && self.remove.is_empty()
            && !self.proxy_path
    }
}

/// Why a reload needs a restart: the fields named, with what a restart would do.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}; restart the daemon to apply this (nothing was changed)")]
pub struct NeedsRestart(pub String);

/// The proxy path as a plan sees it.
#[derive(Clone, Copy, Debug)]
pub struct ProxyPath {
    /// Whether it runs now.
    pub running: bool,
    /// Whether the new configuration's file declares the proxy path
    /// ([`Config::declares_proxy`]): then it runs even while nothing uses it (a chain that
    /// waits for Consul's entries, LDS without an HTTP listener yet), with an empty table.
    pub declared: bool,
}

/// The difference from `old` to `new` (both validated), for a data path attached with sockops
/// (`follow_sockets`) or without. `key` is a service's kernel key.
pub fn plan<'a>(
    old: &'a Config,
    new: &'a Config,
    follow_sockets: bool,
    new_needs_sockops: bool,
    proxy: ProxyPath,
    key: impl Fn(&proxy_core::config::Service) -> ServiceKey,
) -> Result<Plan, NeedsRestart> {
    fixed_fields(old, new)?;
    if new_needs_sockops && !follow_sockets {
        return Err(NeedsRestart(
            "the new configuration needs sockops (proxy mode, outlier detection, LEAST_REQUEST \
             or splice), which this run did not attach"
                .to_owned(),
        ));
    }
    let mut plan = Plan {
        xds_restart: proxy_core::discovery::xds::restart_needed(old, new),
        ..Plan::default()
    };
    let clusters = |c: &'a Config| -> BTreeMap<&'a str, &'a Cluster> {
        c.clusters
            .iter()
            .filter(|cluster| !c.is_original_dst(&cluster.name))
            .map(|cluster| (cluster.name.as_str(), cluster))
            .collect()
    };
    let (olds, news) = (clusters(old), clusters(new));
    let is_eds = |c: &Config, name: &str| eds_clusters(c).iter().any(|(n, _)| n == name);
    for (name, was) in &olds {
        let restarts = plan.xds_restart && is_eds(old, name);
        match news.get(name) {
            Some(now) if super::zones::same_cluster(old, was, new, now) && !restarts => {
                plan.kept_clusters += 1;
            }
            Some(_) => {
                plan.stop.insert((*name).to_owned());
                plan.start.insert((*name).to_owned());
            }
            None => {
                plan.stop.insert((*name).to_owned());
            }
        }
    }
    for name in news.keys().filter(|n| !olds.contains_key(*n)) {
        plan.start.insert((*name).to_owned());
    }
    super::zones::restart_followers(new, &olds, &mut plan);
    plan.proxy_path = proxy_path_changes(old, new, proxy, &plan)?;
    let services = |c: &'a Config| -> BTreeMap<ServiceKey, &'a Service> {
        c.services.iter().map(|svc| (key(svc), svc)).collect()
    };
    let (old_services, new_services) = (services(old), services(new));
    for (k, svc) in new.services.iter().map(|s| (key(s), s)) {
        let reads_restarted = new
            .service_clusters(svc)
            .iter()
            .any(|c| plan.start.contains(c));
        let same = match (old_services.get(&k), new_services.get(&k)) {
            (Some(was), Some(now)) => same_service(old, was, new, now),
            _ => false,
        };
        if same && !reads_restarted {
            plan.kept_services += 1;
        } else {
            plan.publish.insert(k);
        }
    }
    plan.remove = old_services
        .keys()
        .filter(|k| !new_services.contains_key(k))
        .copied()
        .collect();
    Ok(plan)
}

/// The fields that shape what this run attached and bound: the instance and its pins, the
/// cgroup, the admin listener, the proxy listeners and their settings, splicing, the kernel
/// programs' log level, the kernel maps' sizes.
fn fixed_fields(old: &Config, new: &Config) -> Result<(), NeedsRestart> {
    let mut changed = Vec::new();
    if old.instance != new.instance {
        changed.push("instance");
    }
    if old.cgroup != new.cgroup {
        changed.push("cgroup");
    }
    if old.bpffs != new.bpffs {
        changed.push("bpffs");
    }
    if format!("{:?}", old.admin) != format!("{:?}", new.admin) {
        changed.push("admin");
    }
    if old.proxy != new.proxy {
        changed.push("proxy");
    }
    if old.splice != new.splice {
        changed.push("splice");
    }
    // The programs' log level is a read-only global, fixed when they were loaded.
    if old.kernel_log != new.kernel_log {
        changed.push("kernel_log");
    }
    // The maps' sizes are fixed when they are created.
    if old.kernel_maps != new.kernel_maps {
        changed.push("kernel_maps");
    }
    // The steady state was entered once, with no way back to root.
    if old.user != new.user {
        changed.push("user");
    }
    if old.seccomp != new.seccomp {
        changed.push("seccomp");
    }
    // The config entry watch is started with the run.
    if old.consul_config_entries != new.consul_config_entries {
        changed.push("consul_config_entries");
    }
    if changed.is_empty() {
        return Ok(());
    }
    Err(NeedsRestart(format!(
        "changed field(s) that a reload cannot apply: {}",
        changed.join(", ")
    )))
}

/// Whether the proxy path's services change: its table of proxy-mode services, their chains and
/// clusters, the fallback cluster, or a cluster any of them reads that restarts. Then the proxy
/// path gets a successor with the new table ([`Plan::proxy_path`]). Starting or stopping the
/// proxy path altogether (the file's first proxy-mode service or fallback_cluster added, or its
/// last removed), or changing what its listeners do, needs a restart.
fn proxy_path_changes(
    old: &Config,
    new: &Config,
    proxy: ProxyPath,
    plan: &Plan,
) -> Result<bool, NeedsRestart> {
    let runs = new.uses_proxy() || proxy.declared;
    if proxy.running != runs {
        return Err(NeedsRestart(format!(
            "the proxy path would {} (the first proxy-mode service or fallback_cluster added, or \
             the last removed)",
            if runs { "start" } else { "stop" }
        )));
    }
    if old.effective_proxy() != new.effective_proxy() {
        return Err(NeedsRestart(
            "changed field(s) that a reload cannot apply: the ORIGINAL_DST cluster's \
             cleanup_interval, connect_timeout or original_dst_lb_config (the proxy's settings)"
                .to_owned(),
        ));
    }
    let proxied = |c: &Config| -> (String, BTreeSet<String>) {
        let mut clusters: BTreeSet<String> = c.proxy.fallback_cluster.iter().cloned().collect();
        let mut text = String::new();
        for svc in c.services.iter().filter(|s| s.mode == ServiceMode::Proxy) {
            clusters.extend(c.service_clusters(svc));
            let _ = write!(text, "{svc:?} {:?};", c.chains.get(&svc.name));
        }
        for name in &clusters {
            let _ = write!(text, "{:?};", c.cluster(name));
        }
        (text, clusters)
    };
    let ((old_text, old_clusters), (new_text, _)) = (proxied(old), proxied(new));
    let restarted = old_clusters.iter().any(|c| plan.stop.contains(c));
    Ok(old_text != new_text || restarted)
}

/// Whether a service's publisher runs as before: everything it depends on but its clusters'
/// hosts is equal (the service, the clusters it reads and their `lb_policy`, its chain's plan,
/// the datacenter, and what the kernel does while no proxy listens, which depends on whether a
/// chain routes the service and the clusters alone do not show).
fn same_service(old: &Config, was: &Service, new: &Config, now: &Service) -> bool {
    if was != now || old.datacenter != new.datacenter {
        return false;
    }
    let reads = old.service_clusters(was);
    if reads != new.service_clusters(now) {
        return false;
    }
    let policy = |c: &Config, name: &str| c.cluster(name).map(|cluster| cluster.lb_policy);
    // A chain's plan is compared by its `Debug` form; a service without a chain has none.
    let (old_plan, new_plan) = (old.chain_plan(was), new.chain_plan(now));
    let same_plan = match (&old_plan, &new_plan) {
        (None, None) => true,
        _ => format!("{old_plan:?}") == format!("{new_plan:?}"),
    };
    reads
        .iter()
        .all(|name| policy(old, name) == policy(new, name))
        && same_plan
        && proxy_core::kernel::no_proxy_fallback(was, old)
            == proxy_core::kernel::no_proxy_fallback(now, new)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const ENDPOINT: &str = "load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: PORT } } } } ] } ] }";

    fn cluster(name: &str, port: u16) -> String {
        format!(
            "  - {{ name: {name}, {} }}\n",
            ENDPOINT.replace("PORT", &port.to_string())
        )
    }

    fn config(clusters: &[(&str, u16)], services: &[(&str, &str, &str)], extra: &str) -> Config {
        let mut yaml = String::from(extra);
        yaml.push_str("clusters:\n");
        for (name, port) in clusters {
            yaml.push_str(&cluster(name, *port));
        }
        yaml.push_str("services:\n");
        for (name, vip, cluster) in services {
            let _ = writeln!(
                yaml,
                "  - {{ name: {name}, address: {vip}, port: 80, cluster: {cluster} }}"
            );
        }
        Config::parse(&yaml, Path::new("t.yaml")).expect("valid config")
    }

    fn plan_of(old: &Config, new: &Config, proxy: ProxyPath) -> Result<Plan, NeedsRestart> {
        plan(old, new, false, false, proxy, crate::daemon::service_key)
    }

    fn diff(old: &Config, new: &Config) -> Result<Plan, NeedsRestart> {
        let proxy = ProxyPath {
            running: old.uses_proxy(),
            declared: new.uses_proxy(),
        };
        plan(old, new, false, false, proxy, crate::daemon::service_key)
    }

    fn names(set: &BTreeSet<String>) -> Vec<&str> {
        set.iter().map(String::as_str).collect()
    }

    #[test]
    fn the_same_file_changes_nothing() {
        let a = config(&[("a", 1)], &[("s", "127.77.0.1", "a")], "");
        let plan = diff(&a, &a).unwrap();
        assert!(plan.is_empty(), "{plan:?}");
        assert_eq!((plan.kept_clusters, plan.kept_services), (1, 1));
    }

    #[test]
    fn added_removed_and_changed_clusters_and_the_services_reading_them() {
        let old = config(
            &[("stay", 1), ("change", 2), ("gone", 3)],
            &[
                ("s-stay", "127.77.0.1", "stay"),
                ("s-change", "127.77.0.2", "change"),
                ("s-gone", "127.77.0.3", "gone"),
            ],
            "",
        );
        let new = config(
            &[("stay", 1), ("change", 22), ("new", 4)],
            &[
                ("s-stay", "127.77.0.1", "stay"),
                ("s-change", "127.77.0.2", "change"),
                ("s-new", "127.77.0.4", "new"),
            ],
            "",
        );
        let plan = diff(&old, &new).unwrap();
        assert_eq!(names(&plan.start), ["change", "new"]);
        assert_eq!(names(&plan.stop), ["change", "gone"]);
        let key = |vip: &str| {
            crate::daemon::service_key(
                new.services
                    .iter()
                    .chain(&old.services)
                    .find(|s| s.address.to_string() == vip)
                    .unwrap(),
            )
        };
        assert_eq!(
            plan.publish,
            BTreeSet::from([key("127.77.0.2"), key("127.77.0.4")])
        );
        assert_eq!(plan.remove, BTreeSet::from([key("127.77.0.3")]));
        assert_eq!((plan.kept_clusters, plan.kept_services), (1, 1));
        assert_eq!(
            plan.summary(),
            "clusters: 1 added, 1 removed, 1 changed, 1 unchanged; services: 2 published, 1 removed, 1 unchanged"
        );
    }

    #[test]
    fn a_service_moved_to_another_cluster_or_address_is_republished() {
        let old = config(
            &[("a", 1), ("b", 2)],
            &[("s", "127.77.0.1", "a"), ("t", "127.77.0.2", "a")],
            "",
        );
        let new = config(
            &[("a", 1), ("b", 2)],
            &[("s", "127.77.0.1", "b"), ("t", "127.77.0.3", "a")],
            "",
        );
        let plan = diff(&old, &new).unwrap();
        assert!(plan.start.is_empty() && plan.stop.is_empty(), "{plan:?}");
        assert_eq!(plan.publish.len(), 2, "s reads b, t has a new address");
        assert_eq!(plan.remove.len(), 1, "t's old address goes");
    }

    #[test]
    fn fields_of_the_run_need_a_restart() {
        let base = config(&[("a", 1)], &[("s", "127.77.0.1", "a")], "");
        for (extra, field) in [
            ("instance: other\n", "instance"),
            ("cgroup: other\n", "cgroup"),
            ("admin: { address: 127.0.0.1:15999 }\n", "admin"),
            ("splice: true\n", "splice"),
            ("kernel_log: warn\n", "kernel_log"),
            ("kernel_maps: { backends: 1024 }\n", "kernel_maps"),
            ("proxy: { drain_timeout: 3s }\n", "proxy"),
            (
                "consul_config_entries: { address: 127.0.0.1:8501 }\n",
                "consul_config_entries",
            ),
            ("user: nobody\n", "user"),
            ("seccomp: false\n", "seccomp"),
        ] {
            let new = config(&[("a", 1)], &[("s", "127.77.0.1", "a")], extra);
            let err = diff(&base, &new).expect_err(field);
            assert!(err.to_string().contains(field), "{field}: {err}");
            assert!(err.to_string().contains("nothing was changed"), "{err}");
        }
    }

    #[test]
    fn sockops_that_this_run_did_not_attach_need_a_restart() {
        let a = config(&[("a", 1)], &[("s", "127.77.0.1", "a")], "");
        let idle = ProxyPath {
            running: false,
            declared: false,
        };
        let err = plan(&a, &a, false, true, idle, crate::daemon::service_key).unwrap_err();
        assert!(err.0.contains("sockops"), "{err}");
        assert!(plan(&a, &a, true, true, idle, crate::daemon::service_key).is_ok());
    }

    #[test]
    fn proxy_mode_service_changes_give_the_proxy_path_a_successor() {
        let listener = "proxy: { listeners: [\"127.0.0.1:15001\"] }\n";
        let proxied = |port: u16, vip: &str, extra: &str| {
            let yaml = format!(
                "{listener}clusters:\n{}{extra}services:\n  - {{ name: p, address: {vip}, port: 80, cluster: a, mode: proxy }}\n",
                cluster("a", port)
            );
            Config::parse(&yaml, Path::new("t.yaml")).expect("valid config")
        };
        let base = proxied(1, "127.77.0.1", "");
        assert!(diff(&base, &base).unwrap().is_empty());
        // A cluster the proxy reads changes; the service moves; an unrelated cluster comes.
        for (new, proxy_path) in [
            (proxied(2, "127.77.0.1", ""), true),
            (proxied(1, "127.77.0.9", ""), true),
            (proxied(1, "127.77.0.1", &cluster("b", 3)), false),
        ] {
            let plan = diff(&base, &new).expect("applied by a reload");
            assert_eq!(plan.proxy_path, proxy_path, "{plan:?}");
            assert!(!plan.is_empty());
            assert_eq!(
                plan.summary()
                    .contains("the proxy path took the new services"),
                proxy_path
            );
        }
        // Starting or stopping the proxy path needs a restart.
        let direct = config(&[("a", 1)], &[("s", "127.77.0.1", "a")], listener);
        for (old, new) in [(&base, &direct), (&direct, &base)] {
            let err = diff(old, new).expect_err("the proxy path starts or stops");
            assert!(err.0.contains("the proxy path would"), "{err}");
        }
        // A file that declares the proxy path (LDS, or a chain waiting for Consul) keeps it
        // running with an empty table; one that declares it where it does not run yet needs
        // the restart.
        let declared = |running| ProxyPath {
            running,
            declared: true,
        };
        let kept = plan_of(&base, &direct, declared(true)).expect("kept");
        assert!(
            kept.proxy_path,
            "a successor with the empty table: {kept:?}"
        );
        let err = plan_of(&direct, &direct, declared(false)).expect_err("would start");
        assert!(err.0.contains("the proxy path would start"), "{err}");
    }
}
