//! The sizes of the kernel maps that hold services and host sets (`kernel_maps`), and what fits
//! in them: the numbers `proxy check`, the xDS client and the host guard refuse by.

use serde::{Deserialize, Serialize};

use super::error::Invalid;

/// The smallest size of any of the three maps: a smaller one holds no useful data path.
pub const MIN_ENTRIES: u32 = 16;

/// The largest `services` and `backends`. The kernel's hash maps take at most 2^27 entries
/// (their bucket array must stay under 4 GiB); kernels before 5.11 also refuse a map whose
/// worst-case memory passes 4 GiB, which a `BACKENDS` entry (about 100 bytes) reaches near 2^25.
pub const MAX_ENTRIES: u32 = 1 << 24;

/// The largest `slot_tables`: a slot table is 4 KiB, so kernels before 5.11 refuse a map of
/// about a million (its worst-case memory passes 4 GiB).
pub const MAX_SLOT_TABLES: u32 = 1 << 19;

/// Named defaults: the sizes the kernel object declares (a `proxy` unit test compares them).
pub mod defaults {
    /// `SERVICES_V2` (and the per-service counters `SVC_COUNTERS_V3`).
    pub fn services() -> u32 {
        65_536
    }
    /// `SLOTS_V2`.
    pub fn slot_tables() -> u32 {
        262_144
    }
    /// `BACKENDS_V2`.
    pub fn backends() -> u32 {
        262_144
    }
}

/// Entries of the kernel maps that hold services and host sets. Fixed when the daemon creates
/// the maps: a reload cannot change them, and a start that finds the instance's maps pinned
/// with other sizes refuses (the pinned maps keep serving).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MapSizes {
    /// Entries of `SERVICES_V2` and of the per-service counters `SVC_COUNTERS_V3`: the most
    /// services the data path holds. 16 to 16,777,216; default 65,536.
    #[serde(default = "defaults::services")]
    pub services: u32,
    /// Entries of `SLOTS_V2`: a service of two or more hosts has one slot table, and a second
    /// while it is republished, so at most half of them are services. 16 to 524,288; default
    /// 262,144.
    #[serde(default = "defaults::slot_tables")]
    pub slot_tables: u32,
    /// Entries of `BACKENDS_V2`: the distinct host addresses of every slot table. A publish
    /// writes the new host set beside the live one, so one cluster may hold at most half of
    /// them ([`MapSizes::max_cluster_hosts`]). 16 to 16,777,216; default 262,144.
    #[serde(default = "defaults::backends")]
    pub backends: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: defaults::services(),
            slot_tables: defaults::slot_tables(),
            backends: defaults::backends(),
        }
    }
}

impl MapSizes {
    /// The most hosts one cluster may have: a publish writes a service's new host set beside
    /// the live one, so a set of more than half of `backends` could not replace one of its own
    /// size.
    #[must_use]
    pub fn max_cluster_hosts(&self) -> usize {
        (self.backends / 2) as usize
    }

    /// The most services: each needs a service entry, and up to two slot tables.
    #[must_use]
    pub fn max_services(&self) -> usize {
        self.services.min(self.slot_tables / 2) as usize
    }

    /// Checks each size against what the kernel can hold.
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        let sizes = [
            ("services", self.services, MAX_ENTRIES),
            ("slot_tables", self.slot_tables, MAX_SLOT_TABLES),
            ("backends", self.backends, MAX_ENTRIES),
        ];
        for (field, value, max) in sizes {
            if !(MIN_ENTRIES..=max).contains(&value) {
                return Err(Invalid::new(
                    format!("kernel_maps.{field}"),
                    format!(
                        "{value} entries: must be {MIN_ENTRIES} to {max} (the most the kernel's hash map takes on every supported kernel)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Why `hosts` hosts of one cluster do not fit, or `None` when they do. The text names the
    /// map, its size and the limit; it goes into NACKs, logs and `proxy check` errors.
    #[must_use]
    pub fn hosts_refusal(&self, hosts: usize) -> Option<String> {
        let max = self.max_cluster_hosts();
        (hosts > max).then(|| {
            format!(
                "{hosts} hosts do not fit the kernel maps: BACKENDS_V2 holds {} entries (kernel_maps.backends) and a publish writes the new hosts beside the live ones, so one cluster may have at most {max}",
                self.backends
            )
        })
    }
}

/// Why a host set spread over `levels` distinct priorities cannot be served, or `None` when it
/// can: a service's entry holds a slot table for each of at most `MAX_PRIORITIES` levels, and a
/// publish of more is refused. The text goes into NACKs and logs.
#[must_use]
pub fn levels_refusal(levels: usize) -> Option<String> {
    let max = proxy_common::service::MAX_PRIORITIES as usize;
    (levels > max).then(|| {
        format!(
            "{levels} priority levels do not fit the kernel maps: a service holds a slot table for each of at most {max} levels, so a cluster may use at most {max} distinct priorities"
        )
    })
}

/// Checks what the file itself puts in the maps against `config.kernel_maps`: its sizes, the
/// number of services and each STATIC cluster's hosts (discovered hosts are checked as they
/// arrive: EDS NACKs, DNS and Consul skip the update).
pub(super) fn check_config(config: &super::Config) -> Result<(), Invalid> {
    let maps = &config.kernel_maps;
    maps.validate()?;
    let services = config.services.len();
    if services > maps.max_services() {
        return Err(Invalid::new(
            "services",
            format!(
                "{services} services do not fit the kernel maps: SERVICES_V2 holds {} entries (kernel_maps.services) and SLOTS_V2 {} (kernel_maps.slot_tables, two per service), so at most {}",
                maps.services,
                maps.slot_tables,
                maps.max_services()
            ),
        ));
    }
    for (i, cluster) in config.clusters.iter().enumerate() {
        if cluster.cluster_type != super::ClusterType::Static {
            continue;
        }
        let hosts: usize = cluster.load_assignment.as_ref().map_or(0, |a| {
            a.endpoints.iter().map(|g| g.lb_endpoints.len()).sum()
        });
        if let Some(why) = maps.hosts_refusal(hosts) {
            return Err(Invalid::new(
                format!("clusters[{i}].load_assignment"),
                format!("cluster {:?}: {why}", cluster.name),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_of_backends_is_a_cluster_and_half_of_tables_a_service_count() {
        let maps = MapSizes::default();
        assert_eq!(maps.max_cluster_hosts(), 131_072);
        assert_eq!(maps.max_services(), 65_536);
        let small = MapSizes {
            services: 100,
            slot_tables: 64,
            backends: 17,
        };
        assert_eq!(small.max_cluster_hosts(), 8, "rounded down");
        assert_eq!(small.max_services(), 32, "two tables per service");
        assert_eq!(levels_refusal(4), None);
        assert!(
            levels_refusal(5).is_some_and(|why| why.starts_with("5 priority levels do not fit")),
            "five levels"
        );
        assert_eq!(small.hosts_refusal(8), None);
        let refusal = small.hosts_refusal(9).expect("9 > 8");
        assert!(
            refusal.starts_with("9 hosts do not fit the kernel maps: BACKENDS_V2 holds 17 entries"),
            "{refusal}"
        );
        assert!(refusal.ends_with("at most 8"), "{refusal}");
    }

    #[test]
    fn sizes_outside_what_the_kernel_holds_are_refused_by_field() {
        assert!(MapSizes::default().validate().is_ok());
        let cases = [
            (
                MapSizes {
                    services: 15,
                    ..MapSizes::default()
                },
                "kernel_maps.services",
                "15 entries",
            ),
            (
                MapSizes {
                    backends: MAX_ENTRIES + 1,
                    ..MapSizes::default()
                },
                "kernel_maps.backends",
                "16777217 entries",
            ),
            (
                MapSizes {
                    slot_tables: MAX_SLOT_TABLES + 1,
                    ..MapSizes::default()
                },
                "kernel_maps.slot_tables",
                "must be 16 to 524288",
            ),
        ];
        for (maps, field, text) in cases {
            let err = maps.validate().expect_err(field);
            assert_eq!(err.field, field);
            assert!(err.message.contains(text), "{}", err.message);
        }
        let edges = MapSizes {
            services: MIN_ENTRIES,
            slot_tables: MAX_SLOT_TABLES,
            backends: MAX_ENTRIES,
        };
        assert!(edges.validate().is_ok(), "the bounds themselves are taken");
    }

    fn endpoints(n: u32) -> String {
        let one = |i: u32| {
            let [_, a, b, c] = i.to_be_bytes();
            format!(
                "{{\"endpoint\":{{\"address\":{{\"socket_address\":{{\"address\":\"10.{a}.{b}.{c}\",\"port_value\":80}}}}}}}}"
            )
        };
        let all: Vec<String> = (1..=n).map(one).collect();
        all.join(",")
    }

    fn static_cluster(maps: &str, hosts: u32) -> String {
        format!(
            "{maps}clusters:\n  - name: big\n    load_assignment: {{\"endpoints\":[{{\"lb_endpoints\":[{}]}}]}}\n",
            endpoints(hosts)
        )
    }

    #[test]
    fn check_refuses_a_static_cluster_or_services_that_do_not_fit() {
        let parse = |text: &str| super::super::Config::parse(text, std::path::Path::new("t.yaml"));
        let maps = "kernel_maps: { backends: 16 }\n";
        assert!(parse(&static_cluster(maps, 8)).is_ok(), "8 of 16: fits");
        let err = parse(&static_cluster(maps, 9)).expect_err("9 of 16");
        assert_eq!(err.field(), Some("clusters[0].load_assignment"));
        assert!(
            err.to_string().contains(
                "cluster \"big\": 9 hosts do not fit the kernel maps: BACKENDS_V2 holds 16 entries"
            ),
            "{err}"
        );

        let services = |n: u32| {
            let list: Vec<String> = (1..=n)
                .map(|i| {
                    format!("  - {{ name: s{i}, address: 127.77.0.{i}, port: 80, cluster: c }}\n")
                })
                .collect();
            format!(
                "kernel_maps: {{ services: 16, slot_tables: 64 }}\nclusters:\n  - name: c\nservices:\n{}",
                list.concat()
            )
        };
        assert!(parse(&services(16)).is_ok(), "16 services of 16");
        let err = parse(&services(17)).expect_err("17 services of 16");
        assert_eq!(err.field(), Some("services"));
        assert!(
            err.to_string()
                .contains("17 services do not fit the kernel maps: SERVICES_V2 holds 16 entries"),
            "{err}"
        );

        let err = parse("kernel_maps: { backends: 0 }\n").expect_err("0 entries");
        assert_eq!(err.field(), Some("kernel_maps.backends"));
        assert!(err.to_string().contains("t.yaml:1:"), "located: {err}");
    }

    /// `proxy check` of a file at the default sizes: one host more than half of the default
    /// `BACKENDS_V2` (262,144) is refused, with the numbers the documentation gives.
    #[test]
    fn the_default_limit_is_131072_hosts_per_cluster() {
        let dir = std::env::temp_dir().join(format!("proxy-kernel-maps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("big.yaml");
        std::fs::write(&file, static_cluster("", 131_073)).unwrap();
        let err = super::super::Config::load(&file).expect_err("one host over the default limit");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(err.field(), Some("clusters[0].load_assignment"), "{err}");
        let message = err.to_string();
        assert!(
            message.ends_with("131073 hosts do not fit the kernel maps: BACKENDS_V2 holds 262144 entries (kernel_maps.backends) and a publish writes the new hosts beside the live ones, so one cluster may have at most 131072"),
            "{message}"
        );
    }
}
