//! Field groups: serde fields declared once and spliced into every struct that takes them.
//!
//! A cluster's DNS fields are both [`DnsSettings`](super::sources::dns::DnsSettings), what the
//! DNS source runs with, and fields of [`Cluster`](super::Cluster), where the file and CDS put
//! them; its health fields are both `health::ClusterHealthConfig` and fields of `Cluster`.
//! serde's `flatten` would nest one struct in the other, but it collects the fields it does not
//! know into a buffer first, so `deny_unknown_fields` cannot be used with it and a bad value
//! loses its file:line:column. So each group is a macro holding its field list (docs, serde
//! attributes, types), and [`splice!`] appends the lists to a struct written out as usual:
//!
//! ```text
//! splice! {
//!     { #[derive(Deserialize)] #[serde(deny_unknown_fields)] pub struct Cluster { pub name: String, } }
//!     [dns_cluster_fields, dns_file_fields, health_fields]
//! }
//! ```
//!
//! declares `Cluster` with `name` and then every DNS and health field, each with its own doc
//! and serde attributes: one derived `Deserialize`, so unknown fields, error texts and locations
//! are serde's as for any field. The copies between the structs come from the same list
//! (`health_fields!(@copy self, ...)` is a `ClusterHealthConfig` of `self`'s health fields), and
//! so does the list of the fields set (`@changed`); see [`group!`].
//!
//! A group macro is `macro_rules! name { ($($args:tt)*) => { group! { Type [$($args)*] fields } } }`
//! ([`group!`]); serde paths in its attributes (`default = "..."`, `with = "..."`) are
//! written from the crate root, since the fields land in other modules.

/// Appends the field lists of the groups named in `[...]` to the struct in `{...}`, in that
/// order, after its own fields (which must end with a comma). Each group is asked for its list
/// in turn ([`group!`] calls back here with it).
macro_rules! splice {
    // A group left: ask it for its fields; it calls back with them appended.
    ({ $($item:tt)* } [$next:ident $(, $rest:ident)*] $($lists:tt)*) => {
        $next! { { $($item)* } [$($rest),*] $($lists)* }
    };
    // Every list collected: the struct with its own fields, then the groups'.
    (
        {
            $(#[$meta:meta])*
            $vis:vis struct $name:ident { $($own:tt)* }
        }
        []
        $([ $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)? ])*
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $($own)*
            $($( $(#[$field_meta])* pub $field: $ty, )*)*
        }
    };
}

/// The body of a group macro: `group! { Type [args] fields }`. With `args` of
/// `@copy source` (and `, extra: value` pairs for `Type`'s fields outside the group) it is the
/// `Type` literal of `source`'s group fields; `@assign target, source` sets `target`'s group
/// fields to `source`'s; `@changed value, reference` is an array of `(bool, &str)`, each group
/// field's name with whether it differs between the two. Any other `args` are [`splice!`]'s,
/// and the fields are handed back to it.
macro_rules! group {
    // `@copy source, extra: value, ...`: a `Type` of `source`'s group fields and the extras.
    (
        $group:path [@copy $source:expr $(, $extra:ident : $value:expr)* $(,)?]
        $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)?
    ) => {
        {
            // A struct literal takes a type's name, not a path fragment: name it here.
            type Group = $group;
            Group {
                $( $field: ::core::clone::Clone::clone(&$source.$field), )*
                $( $extra: $value, )*
            }
        }
    };
    // `@assign target, source`: every group field of `target` set to `source`'s.
    (
        $group:path [@assign $target:expr, $source:expr]
        $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)?
    ) => {
        $( $target.$field = ::core::clone::Clone::clone(&$source.$field); )*
    };
    // `@changed value, reference`: `(differs, field name)` for every group field.
    (
        $group:path [@changed $value:expr, $reference:expr]
        $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)?
    ) => {
        [ $( ($value.$field != $reference.$field, stringify!($field)) ),* ]
    };
    ($group:path [$($args:tt)*] $($fields:tt)*) => {
        $crate::config::fields::splice! { $($args)* [$($fields)*] }
    };
}

pub(crate) use group;
pub(crate) use splice;

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::{
        config::{Cluster, Config, sources::dns::DnsSettings},
        health::ClusterHealthConfig,
    };

    const ENDPOINT: &str = "load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: web.test, port_value: 80 } } } } ] } ] }";
    /// Every field of `dns_cluster_fields`, away from its default.
    const DNS_CLUSTER: &str = "dns_refresh_rate: 2s, respect_dns_ttl: true, dns_failure_refresh_rate: { base_interval: 1s, max_interval: 4s }, dns_jitter: 0.5s, dns_lookup_family: V4_ONLY";
    /// Every field of `dns_file_fields`, away from its default.
    const DNS_FILE: &str = "dns_resolvers: ['127.0.0.1:5353'], dns_stale_bound: 30s";
    /// Every field of `health_fields`, away from its default.
    const HEALTH: &str = "health_checks: [ { timeout: 1s, interval: 2s, unhealthy_threshold: 2, healthy_threshold: 1, tcp_health_check: {} } ], outlier_detection: { consecutive_5xx: 3 }, common_lb_config: { healthy_panic_threshold: { value: 0 } }, ignore_health_on_host_removal: true";

    fn cluster(fields: &str) -> Cluster {
        let yaml =
            format!("clusters:\n  - {{ name: a, type: STRICT_DNS, {ENDPOINT}, {fields} }}\n");
        Config::parse(&yaml, Path::new("t.yaml"))
            .expect("valid")
            .clusters
            .remove(0)
    }

    /// A group's fields read into `Cluster` come out of its copy as the group's own struct
    /// reads them: no field is left out of a copy.
    #[test]
    fn the_copies_carry_every_field_of_their_group() {
        let dns = format!("{DNS_CLUSTER}, {DNS_FILE}");
        let want: DnsSettings = serde_norway::from_str(&format!("{{ {dns} }}")).unwrap();
        assert_ne!(want, DnsSettings::default());
        let parsed = cluster(&format!("{dns}, {HEALTH}"));
        assert_eq!(parsed.dns_settings(), want);
        let health: ClusterHealthConfig =
            serde_norway::from_str(&format!("{{ {HEALTH} }}")).unwrap();
        assert_ne!(health, ClusterHealthConfig::default());
        assert_eq!(parsed.health_config(), health);
    }

    /// Envoy's `DnsCluster` typed_config takes `dns_cluster_fields` into the cluster, and
    /// refuses `dns_file_fields` as unknown.
    #[test]
    fn envoy_dns_cluster_takes_the_shared_group_only() {
        let typed = |fields: &str| {
            format!("cluster_type: {{ name: envoy.cluster.dns, typed_config: {{ {fields} }} }}")
        };
        let yaml = |fields: &str| {
            format!(
                "clusters:\n  - {{ name: a, {ENDPOINT}, {} }}\n",
                typed(fields)
            )
        };
        let parsed = Config::parse(&yaml(DNS_CLUSTER), Path::new("t.yaml")).expect("valid");
        let want: DnsSettings = serde_norway::from_str(&format!("{{ {DNS_CLUSTER} }}")).unwrap();
        assert_eq!(parsed.clusters[0].dns_settings(), want);
        for field in ["dns_resolvers: []", "dns_stale_bound: 30s"] {
            let err = Config::parse(&yaml(field), Path::new("t.yaml")).unwrap_err();
            assert!(err.to_string().contains("unknown field"), "{field}: {err}");
        }
    }
}
