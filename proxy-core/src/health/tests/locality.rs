//! Localities and the assignment policy from the configuration file to routing: STATIC and
//! DNS endpoints carry their group's locality and weight, `locality_weighted_lb_config` and
//! `load_assignment.policy` reach the membership's routing, and bad values are refused.

use std::{path::Path, sync::Arc};

use crate::{
    config::{Config, ConfigError},
    health::{
        AssignmentPolicy, Balance, DropOverload, matrix::ClusterMembership, random::SeededRandom,
    },
    host::{EdsHealth, Host},
    lb::kernel_levels,
};

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("test.yaml"))
}

/// A cluster `web` of `kind` with zone a (weight 1: ports 80, 81 UNHEALTHY) and zone b
/// (weight 3: port 82), and `extra` lines of cluster fields.
fn zoned(kind: &str, extra: &str) -> String {
    format!(
        "\
clusters:
  - name: web
    type: {kind}
{extra}
    load_assignment:
      endpoints:
        - locality: {{ region: eu, zone: a }}
          load_balancing_weight: 1
          lb_endpoints:
            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 80 }} }} }}
            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 81 }} }} }}
              health_status: UNHEALTHY
        - locality: {{ region: eu, zone: b }}
          load_balancing_weight: 3
          lb_endpoints:
            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 82 }} }} }}
"
    )
}

const WEIGHTED: &str = "    common_lb_config: { locality_weighted_lb_config: {} }";

#[test]
fn static_and_dns_hosts_carry_their_groups_locality_and_weight() {
    let config = parse(&zoned("STATIC", WEIGHTED)).unwrap();
    let hosts = config.clusters[0].static_hosts();
    let seen: Vec<(u16, &str, &str, Option<u32>)> = hosts
        .iter()
        .map(|h| {
            let l = &h.locality();
            (
                h.addr.port(),
                l.region.as_str(),
                l.zone.as_str(),
                h.locality_weight,
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (80, "eu", "a", Some(1)),
            (81, "eu", "a", Some(1)),
            (82, "eu", "b", Some(3))
        ]
    );
    let config = parse(&zoned("STRICT_DNS", WEIGHTED)).unwrap();
    let endpoints = config.clusters[0].dns_endpoints();
    assert_eq!(endpoints[2].locality.zone, "b");
    assert_eq!(endpoints[2].locality_weight, Some(3));
    // Without a locality or weight: the defaults, as before.
    let plain = zoned("STATIC", "").replace("          load_balancing_weight: 3\n", "");
    let hosts = parse(&plain).unwrap().clusters[0].static_hosts();
    assert_eq!(hosts[2].locality_weight, None);
    assert!(
        !parse(&plain).unwrap().clusters[0]
            .health_config()
            .balance()
            .locality_weighted
    );
}

#[test]
fn the_policy_and_locality_weighting_reach_routing() {
    let extra = format!("{WEIGHTED}\n    # policy below");
    let text = zoned("STATIC", &extra).replace(
        "      endpoints:\n",
        "      policy: { overprovisioning_factor: 100, weighted_priority_health: true }\n      endpoints:\n",
    );
    let cluster = &parse(&text).unwrap().clusters[0];
    let config = cluster.health_config();
    let want = Balance {
        panic_threshold: 50.0,
        overprovisioning_factor: 100,
        weighted_priority_health: true,
        locality_weighted: true,
        drop_overload: DropOverload::NONE,
    };
    assert_eq!(config.balance(), want);
    // Factor 100: zone a is half available (effective weight 0.5), zone b whole (3).
    let mut membership =
        ClusterMembership::new(false, 50.0, None, Arc::new(SeededRandom::with_seed(1)))
            .balanced(config.balance());
    membership.update_hosts(cluster.static_hosts());
    let level = kernel_levels(&membership.routing()).remove(0);
    let share = |port: u16| {
        level
            .iter()
            .find(|(a, _)| a.port() == port)
            .map(|(_, w)| *w)
    };
    // Priority 0: 2 of 3 hosts healthy at factor 100 is 66 % of the traffic, all of it here.
    assert_eq!(
        (share(80), share(81), share(82)),
        (Some(142_857), None, Some(857_143))
    );
    // A host set that brings its own policy (EDS) replaces the cluster's.
    membership.set_policy(AssignmentPolicy {
        overprovisioning_factor: 140,
        weighted_priority_health: false,
        drop_overload: DropOverload::NONE,
    });
    let level = kernel_levels(&membership.routing()).remove(0);
    let share = |port: u16| {
        level
            .iter()
            .find(|(a, _)| a.port() == port)
            .map(|(_, w)| *w)
    };
    assert_eq!((share(80), share(82)), (Some(189_189), Some(810_811)));
}

/// The file's `policy.drop_overloads` reaches the routing both paths read; a fraction above 1
/// is refused with Envoy's text when the file is read.
#[test]
fn the_files_drop_overloads_reach_routing() {
    let text = zoned("STATIC", "").replace(
        "      endpoints:\n",
        "      policy: { drop_overloads: [{ category: lb, drop_percentage: { numerator: 30 } }] }\n      endpoints:\n",
    );
    let cluster = &parse(&text).unwrap().clusters[0];
    let balance = cluster.health_config().balance();
    assert_eq!(balance.drop_overload.per_million(), 300_000);
    let mut membership =
        ClusterMembership::new(false, 50.0, None, Arc::new(SeededRandom::with_seed(1)))
            .balanced(balance);
    membership.update_hosts(cluster.static_hosts());
    assert_eq!(membership.routing().drop_overload, balance.drop_overload);
    let over = text.replace("numerator: 30", "numerator: 101");
    let error = parse(&over).unwrap_err().to_string();
    assert!(
        error.contains("drop_ratio=1.01(Numerator 101 / Denominator 100)"),
        "{error}"
    );
}

#[test]
fn zero_weights_and_factors_and_unknown_locality_fields_are_refused() {
    let zero_weight =
        zoned("STATIC", "").replace("load_balancing_weight: 3", "load_balancing_weight: 0");
    let zero_factor = zoned("STATIC", "").replace(
        "      endpoints:\n",
        "      policy: { overprovisioning_factor: 0 }\n      endpoints:\n",
    );
    let zone_aware = zoned(
        "STATIC",
        "    common_lb_config: { zone_aware_lb_config: { routing_enabled: { value: 100 } } }",
    );
    let drops = zoned("STATIC", "").replace(
        "      endpoints:\n",
        "      policy: { drop_overloads: [{ category: a }, { category: b }] }\n      endpoints:\n",
    );
    for (text, says) in [
        (zero_weight, "nonzero"),
        (zero_factor, "nonzero"),
        (zone_aware, "zone_aware_lb_config"),
        (drops, "has 2 categories. Envoy only support one."),
    ] {
        let error = parse(&text).expect_err(says).to_string();
        assert!(error.contains(says), "{error}");
    }
}

#[test]
fn an_unhealthy_eds_host_counts_in_its_locality() {
    // EDS health decides routing without active checks: the unhealthy host of zone a halves
    // its locality's availability (1.4 * 1/2 = 0.7 against zone b's 3).
    let config = parse(&zoned("STATIC", WEIGHTED)).unwrap();
    let hosts: Vec<Host> = config.clusters[0].static_hosts();
    assert_eq!(hosts[1].eds_health, EdsHealth::Unhealthy);
    let mut membership =
        ClusterMembership::new(false, 50.0, None, Arc::new(SeededRandom::with_seed(1)))
            .balanced(config.clusters[0].health_config().balance());
    membership.update_hosts(hosts);
    let level = kernel_levels(&membership.routing()).remove(0);
    let weights: Vec<u32> = level.iter().map(|(_, w)| *w).collect();
    assert_eq!(weights, [189_189, 810_811]);
}

/// A source the test drives: it publishes whatever the test sends.
struct Scripted(tokio::sync::watch::Sender<crate::discovery::SourceUpdate>);

impl crate::discovery::DiscoverySource for Scripted {
    fn cluster_name(&self) -> &'static str {
        "web"
    }

    fn updates(&self) -> tokio::sync::watch::Receiver<crate::discovery::SourceUpdate> {
        self.0.subscribe()
    }

    fn named_stats(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}

#[tokio::test(start_paused = true)]
async fn the_cluster_loop_takes_the_policy_that_comes_with_the_hosts() {
    use crate::{
        config::host_guard::HostGuard, discovery::SourceUpdate, health::HealthCheckManager,
        upstream::Upstream,
    };
    // The source stands for EDS: the cluster's own policy is the default.
    let cluster = parse("clusters:\n  - name: web\n")
        .unwrap()
        .clusters
        .remove(0);
    // One of two priority-0 hosts unhealthy, and a backup: P0 keeps 1.4 x 1/2 = 70 % by default.
    let mut down = Host::new(super::support::addr(2));
    down.eds_health = EdsHealth::Unhealthy;
    let mut backup = Host::new(super::support::addr(3));
    backup.priority = 1;
    let hosts = vec![Host::new(super::support::addr(1)), down, backup];
    let mut first = SourceUpdate::default();
    first.advance(hosts.clone());
    first.policy = Some(AssignmentPolicy {
        overprovisioning_factor: 200,
        weighted_priority_health: false,
        drop_overload: DropOverload::NONE,
    });
    let (tx, _) = tokio::sync::watch::channel(first);
    let upstream = Upstream::with_source(
        &cluster,
        &HealthCheckManager::default(),
        Box::new(Scripted(tx.clone())),
        &HostGuard::default(),
    )
    .unwrap();
    let mut routing = upstream.routing();
    let within = std::time::Duration::from_secs(5);
    let load = |r: &crate::health::Routing| r.priorities.first().map(|p| p.healthy_load);
    // Factor 200: P0 whole.
    let got = tokio::time::timeout(within, routing.wait_for(|r| load(r) == Some(100)))
        .await
        .expect("the assignment's factor applies")
        .unwrap()
        .overprovisioning_factor;
    assert_eq!(got, 200);
    // The next assignment brings none: the cluster's own (Envoy's default 140).
    tx.send_modify(|u| {
        u.advance(hosts.clone());
        u.policy = None;
    });
    let got = tokio::time::timeout(within, routing.wait_for(|r| load(r) == Some(70)))
        .await
        .expect("the cluster's own factor applies again")
        .unwrap()
        .overprovisioning_factor;
    assert_eq!(got, 140);
}
