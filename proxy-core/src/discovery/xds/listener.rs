//! What an LDS listener becomes before it is checked: a service in the file's form with the
//! config entries of its chain ([`ListenerForm`]), shared by the `tcp_proxy` (`lds`) and the
//! HTTP connection manager (`hcm`) decoders, and the weights-to-percentages rule both use.

use serde_json::{Value, json};

/// What a listener holds: the service's file form, and the splitter of a weighted split.
#[derive(Clone, Debug, PartialEq)]
pub struct ListenerForm {
    /// The service, in the configuration file's JSON form.
    pub service: Value,
    /// Config entries in Consul's JSON form: the service-splitter of `weighted_clusters`, or
    /// the chain of an HTTP listener's routes.
    pub entries: Vec<Value>,
    /// The clusters the listener names (it waits until every one is known).
    pub clusters: Vec<String>,
    /// Whether a cluster not known refuses the listener (Envoy's `validate_clusters` of an
    /// inline route table) instead of holding it until the cluster arrives.
    pub validate_clusters: bool,
    /// An HTTP listener's RDS route configuration: the form has no chain until it is held.
    pub rds: Option<String>,
}

/// Weights as Consul split percentages in hundredths, summing to exactly 100 (largest
/// remainders); `None` without clusters or with a total of 0.
pub(crate) fn percentages(weights: &[(String, u32)]) -> Option<Vec<Value>> {
    let total: u64 = weights.iter().map(|(_, w)| u64::from(*w)).sum();
    if weights.is_empty() || total == 0 {
        return None;
    }
    let mut parts: Vec<(u64, u64)> = weights
        .iter()
        .map(|(_, w)| {
            (
                u64::from(*w) * 10_000 / total,
                u64::from(*w) * 10_000 % total,
            )
        })
        .collect();
    let given: u64 = parts.iter().map(|(p, _)| p).sum();
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(parts[i].1));
    for &i in order.iter().take(usize::try_from(10_000 - given).ok()?) {
        parts[i].0 += 1;
    }
    let splits = weights
        .iter()
        .zip(parts)
        .map(|((name, _), (hundredths, _))| {
            #[expect(clippy::cast_precision_loss, reason = "at most 10,000")]
            let percent = hundredths as f64 / 100.0;
            json!({"Weight": percent, "Service": name})
        });
    Some(splits.collect())
}
