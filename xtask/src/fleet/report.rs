//! What the harness reports: per kind of change, the convergence time until every node serves
//! it (the slowest node's time per change), the time of each single node's observation, and how
//! the nodes differ; as JSON under target/fleet/ and as a short table.

use std::fmt::Write as _;

use serde::Serialize;

/// The `p`-th percentile (0 < p <= 100) of `values` by the nearest-rank method: the smallest
/// value with at least p % of the values at or below it. None when empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() || !(p > 0.0 && p <= 100.0) {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// p50, p99 and max of a sample, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    pub count: usize,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
}

impl Spread {
    pub fn of(values: &[f64]) -> Self {
        Self {
            count: values.len(),
            p50_ms: percentile(values, 50.0),
            p99_ms: percentile(values, 99.0),
            max_ms: percentile(values, 100.0),
        }
    }
}

/// One kind of change over all its changes. `observed[c][n]`: change c's time at node n, None
/// when node n did not see it within the bound.
#[derive(Debug, Serialize)]
pub struct Kind {
    pub name: String,
    pub changes: usize,
    /// Per change, the slowest node's time (a change with a node that timed out is left out
    /// and counted in `timeouts`).
    pub every_node: Spread,
    /// Every (change, node) observation.
    pub each_node: Spread,
    /// Each node's median over the changes, lowest and highest.
    pub node_p50_min_ms: Option<f64>,
    pub node_p50_max_ms: Option<f64>,
    /// Observations that did not happen within the bound.
    pub timeouts: usize,
    /// The raw times, `[change][node]`, milliseconds.
    pub observed_ms: Vec<Vec<Option<f64>>>,
}

impl Kind {
    pub fn new(kind: &str, observed: Vec<Vec<Option<f64>>>) -> Self {
        let every: Vec<f64> = observed
            .iter()
            .filter(|c| c.iter().all(Option::is_some))
            .filter_map(|c| c.iter().flatten().copied().reduce(f64::max))
            .collect();
        let each: Vec<f64> = observed.iter().flatten().flatten().copied().collect();
        let nodes = observed.first().map_or(0, Vec::len);
        let node_p50: Vec<f64> = (0..nodes)
            .filter_map(|n| {
                let mine: Vec<f64> = observed.iter().filter_map(|c| c[n]).collect();
                percentile(&mine, 50.0)
            })
            .collect();
        Self {
            name: kind.to_owned(),
            changes: observed.len(),
            every_node: Spread::of(&every),
            each_node: Spread::of(&each),
            node_p50_min_ms: node_p50.iter().copied().reduce(f64::min),
            node_p50_max_ms: node_p50.iter().copied().reduce(f64::max),
            timeouts: observed.iter().flatten().filter(|o| o.is_none()).count(),
            observed_ms: observed,
        }
    }
}

/// The whole run.
#[derive(Debug, Serialize)]
pub struct Report {
    pub control_plane: String,
    pub nodes: u32,
    pub services: u32,
    pub backends: u32,
    pub changes_per_kind: u32,
    pub poll_interval_ms: u64,
    pub bring_up_s: f64,
    pub measure_s: f64,
    /// The machine's 1-minute load average when the measurement began and ended (everything
    /// runs on this machine, so other work on it shows in the figures).
    pub load_before: Option<f64>,
    pub load_after: Option<f64>,
    pub kinds: Vec<Kind>,
}

/// The 1-minute load average (`/proc/loadavg`).
pub fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"))
}

/// The short table: one row per kind.
pub fn table(report: &Report) -> String {
    let mut out = format!(
        "{:<12} {:>7}  {:>26}  {:>26}  {:>15}  {:>8}\n",
        "change",
        "changes",
        "every node p50/p99/max ms",
        "one node p50/p99/max ms",
        "node p50 range",
        "timeouts"
    );
    for k in &report.kinds {
        let three = |s: &Spread| format!("{} / {} / {}", ms(s.p50_ms), ms(s.p99_ms), ms(s.max_ms));
        let _ = writeln!(
            out,
            "{:<12} {:>7}  {:>26}  {:>26}  {:>15}  {:>8}",
            k.name,
            k.changes,
            three(&k.every_node),
            three(&k.each_node),
            format!("{}-{}", ms(k.node_p50_min_ms), ms(k.node_p50_max_ms)),
            k.timeouts
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&v, 0.0), None);
        assert_eq!(percentile(&v, 101.0), None);
    }

    #[test]
    fn every_node_is_the_slowest_node_and_timeouts_leave_the_change_out() {
        let k = Kind::new(
            "register",
            vec![
                vec![Some(1.0), Some(4.0)],
                vec![Some(2.0), None],
                vec![Some(3.0), Some(6.0)],
            ],
        );
        assert_eq!(
            k.every_node,
            Spread {
                count: 2,
                p50_ms: Some(4.0),
                p99_ms: Some(6.0),
                max_ms: Some(6.0)
            }
        );
        assert_eq!(k.each_node.count, 5);
        assert_eq!(k.each_node.max_ms, Some(6.0));
        assert_eq!(
            (k.node_p50_min_ms, k.node_p50_max_ms),
            (Some(2.0), Some(4.0))
        );
        assert_eq!(k.timeouts, 1);
        assert!(
            table(&Report {
                control_plane: "consul".into(),
                nodes: 2,
                services: 3,
                backends: 1,
                changes_per_kind: 3,
                poll_interval_ms: 5,
                bring_up_s: 1.0,
                measure_s: 1.0,
                load_before: None,
                load_after: None,
                kinds: vec![k],
            })
            .contains("4.0 / 6.0 / 6.0")
        );
    }
}
