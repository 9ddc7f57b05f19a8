//! The balancing parts of a CDS cluster in the file's form: `common_lb_config` and an inline
//! assignment's `policy`.

use envoy_types::pb::envoy::config::{
    cluster::v3::cluster::{
        CommonLbConfig as ProtoCommonLbConfig, common_lb_config::LocalityConfigSpecifier,
    },
    endpoint::v3::cluster_load_assignment::Policy as ProtoPolicy,
};
use serde_json::{Map, Value, json};

use super::{ResourceError, refuse_residual};
use crate::health::drop_overload::Denominator;

/// Field numbers of `Cluster.CommonLbConfig` not honoured.
const COMMON_LB_FIELDS: &[(u64, &str)] = &[
    (4, "update_merge_window"),
    (5, "ignore_new_hosts_until_first_hc"),
    (6, "close_connections_on_host_set_change"),
    (7, "consistent_hashing_lb_config"),
    (8, "override_host_status"),
];

/// `common_lb_config` in the file's form: `healthy_panic_threshold`,
/// `locality_weighted_lb_config` and `zone_aware_lb_config`; any other field is refused by
/// name.
pub(super) fn common_lb_form(common: &ProtoCommonLbConfig) -> Result<Value, (String, String)> {
    let clear = |c: &mut ProtoCommonLbConfig| {
        c.healthy_panic_threshold = None;
        c.locality_config_specifier = None;
    };
    refuse_residual(common, clear, COMMON_LB_FIELDS, |field| {
        ResourceError::Unsupported {
            kind: "cluster",
            name: String::new(),
            field,
        }
    })
    .map_err(|e| match e {
        ResourceError::Unsupported { field, .. } | ResourceError::Invalid { field, .. } => (
            format!("common_lb_config.{field}"),
            "is not supported".to_owned(),
        ),
    })?;
    let mut out = Map::new();
    if let Some(p) = &common.healthy_panic_threshold {
        out.insert("healthy_panic_threshold".into(), json!({"value": p.value}));
    }
    match &common.locality_config_specifier {
        Some(LocalityConfigSpecifier::LocalityWeightedLbConfig(_)) => {
            out.insert("locality_weighted_lb_config".into(), json!({}));
        }
        Some(LocalityConfigSpecifier::ZoneAwareLbConfig(zone)) => {
            let mut z = Map::new();
            if let Some(p) = &zone.routing_enabled {
                z.insert("routing_enabled".into(), json!({"value": p.value}));
            }
            if let Some(size) = &zone.min_cluster_size {
                z.insert("min_cluster_size".into(), json!(size.value));
            }
            if zone.fail_traffic_on_panic {
                z.insert("fail_traffic_on_panic".into(), json!(true));
            }
            out.insert("zone_aware_lb_config".into(), Value::Object(z));
        }
        None => {}
    }
    Ok(Value::Object(out))
}

/// `ClusterLoadAssignment.policy` in the file's form: `overprovisioning_factor`,
/// `weighted_priority_health` and `drop_overloads` (checked by the file's rules);
/// `endpoint_stale_after` is refused by name.
pub(super) fn policy_form(policy: &ProtoPolicy) -> Result<Value, (String, String)> {
    if policy.endpoint_stale_after.is_some() {
        return Err((
            "load_assignment.policy.endpoint_stale_after".into(),
            "is not supported".into(),
        ));
    }
    let mut out = Map::new();
    if !policy.drop_overloads.is_empty() {
        out.insert("drop_overloads".into(), drop_overloads_form(policy)?);
    }
    if let Some(factor) = policy.overprovisioning_factor {
        out.insert("overprovisioning_factor".into(), json!(factor.value));
    }
    if policy.weighted_priority_health {
        out.insert("weighted_priority_health".into(), json!(true));
    }
    Ok(Value::Object(out))
}

/// `policy.drop_overloads` in the file's form; a denominator outside the enum is refused as
/// the proto's `defined_only` rule refuses it.
fn drop_overloads_form(policy: &ProtoPolicy) -> Result<Value, (String, String)> {
    let mut entries = Vec::new();
    for (index, drop) in policy.drop_overloads.iter().enumerate() {
        let (numerator, number) = drop
            .drop_percentage
            .as_ref()
            .map_or((0, 0), |p| (p.numerator, p.denominator));
        let Some(denominator) = Denominator::from_proto(number) else {
            return Err((
                format!(
                    "load_assignment.policy.drop_overloads[{index}].drop_percentage.denominator"
                ),
                format!("value must be one of the defined enum values, not {number}"),
            ));
        };
        let percentage = json!({"numerator": numerator, "denominator": denominator});
        entries.push(json!({"category": drop.category, "drop_percentage": percentage}));
    }
    Ok(Value::Array(entries))
}
