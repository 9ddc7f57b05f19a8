//! `service-splitter`: weighted traffic splits between services and subsets.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, Serializer};

use super::HttpHeaderModifiers;

/// A `service-splitter` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceSplitter {
    /// Service the splitter applies to.
    pub name: String,
    /// Splits; weights must sum to 100.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub splits: Vec<ServiceSplit>,
    /// Free-form metadata.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub meta: BTreeMap<String, String>,
    /// Namespace (Enterprise only; must be empty or `default`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Admin partition (Enterprise only; must be empty or `default`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    /// Raft index from Consul's API, ignored.
    #[serde(skip_serializing)]
    pub create_index: u64,
    /// Raft index from Consul's API, ignored.
    #[serde(skip_serializing)]
    pub modify_index: u64,
    /// Content hash from Consul's API, ignored.
    #[serde(skip_serializing)]
    pub hash: u64,
}

impl ServiceSplitter {
    /// Consul's `Normalize()`: weights are rounded to 0.01.
    pub fn normalize(&mut self) {
        for split in &mut self.splits {
            split.weight = normalize_split_weight(split.weight);
        }
    }
}

/// One leg of a split. Consul stores the weight as a float32; so does this type.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceSplit {
    /// Share of traffic, 0..=100, in 0.01 steps.
    #[serde(serialize_with = "serialize_weight")]
    pub weight: f32,
    /// Service; empty means the splitter's service.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// Subset; set means the split bypasses the next splitter.
    #[serde(alias = "service_subset", skip_serializing_if = "String::is_empty")]
    pub service_subset: String,
    /// Namespace.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Admin partition.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    /// Request header changes.
    #[serde(alias = "request_headers", skip_serializing_if = "Option::is_none")]
    pub request_headers: Option<HttpHeaderModifiers>,
    /// Response header changes.
    #[serde(alias = "response_headers", skip_serializing_if = "Option::is_none")]
    pub response_headers: Option<HttpHeaderModifiers>,
}

impl ServiceSplit {
    /// Consul's `MergeParent`: the child keeps its own fields; request headers merge with the
    /// child winning, response headers merge with the parent winning.
    pub fn merge_parent(&self, parent: &ServiceSplit) -> ServiceSplit {
        ServiceSplit {
            request_headers: HttpHeaderModifiers::merge(
                parent.request_headers.as_ref(),
                self.request_headers.as_ref(),
            ),
            response_headers: HttpHeaderModifiers::merge(
                self.response_headers.as_ref(),
                parent.response_headers.as_ref(),
            ),
            ..self.clone()
        }
    }
}

/// Weight in 0.01 % units (Consul's `scaleWeight`), computed in float32 like Consul.
pub(crate) fn scale_weight(weight: f32) -> i64 {
    f64::from(weight * 100.0).round() as i64
}

/// Rounds a weight to 0.01 (Consul's `NormalizeServiceSplitWeight`).
pub fn normalize_split_weight(weight: f32) -> f32 {
    scale_weight(weight) as f32 / 100.0
}

/// Writes a float32 the way Go's `encoding/json` does: whole numbers without a fraction.
pub(crate) fn serialize_weight<S: Serializer>(weight: &f32, s: S) -> Result<S::Ok, S::Error> {
    if weight.fract() == 0.0 && weight.abs() < 1e15 {
        s.serialize_i64(*weight as i64)
    } else {
        s.serialize_f32(*weight)
    }
}
