//! `cargo xtask fleet --chart OUT.svg RESULTS.json...`: the convergence of every kind of change
//! in the given runs (the JSON the harness writes under target/fleet/) as one SVG, a row per
//! kind: the slowest node's time per change as a bar to its p50, a line on to its p99, a tick
//! at its max, and the issue's target for its control plane dashed; milliseconds on a log
//! scale. Plain SVG text: no font file, no drawing library.

use std::{fmt::Write as _, path::Path};

use anyhow::{Context as _, bail};
use serde_json::Value;

/// Ours, as in the benchmark charts.
const OURS: &str = "#d53e00";
const WIDTH: f64 = 760.0;
const LEFT: f64 = 230.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const ROW: f64 = 34.0;
/// The axis: 1 ms to 10 s.
const DECADES: [f64; 5] = [1.0, 10.0, 100.0, 1000.0, 10000.0];

/// One row: a kind of change of one run.
#[derive(Debug, PartialEq)]
pub struct Row {
    pub label: String,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub target: f64,
}

/// The issue's p99 target for a control plane, in milliseconds.
fn target_ms(control_plane: &str) -> anyhow::Result<f64> {
    match control_plane {
        "consul" => Ok(1000.0),
        "xds" => Ok(250.0),
        other => bail!("unknown control plane {other:?}"),
    }
}

/// The rows of one results file.
pub fn rows(report: &Value) -> anyhow::Result<Vec<Row>> {
    let plane = report["control_plane"]
        .as_str()
        .context("no control_plane in the results")?;
    let target = target_ms(plane)?;
    let kinds = report["kinds"]
        .as_array()
        .context("no kinds in the results")?;
    kinds
        .iter()
        .map(|kind| {
            let name = kind["name"].as_str().context("a kind without a name")?;
            let every = &kind["every_node"];
            let get = |key: &str| {
                every[key]
                    .as_f64()
                    .with_context(|| format!("{name}: no {key} (every change timed out?)"))
            };
            Ok(Row {
                label: format!("{name} ({plane})"),
                p50: get("p50_ms")?,
                p99: get("p99_ms")?,
                max: get("max_ms")?,
                target,
            })
        })
        .collect()
}

/// x of `ms` on the log axis (clamped to it).
fn x(ms: f64) -> f64 {
    let span = DECADES.len() as f64 - 1.0;
    let at = ms.clamp(DECADES[0], DECADES[DECADES.len() - 1]).log10() / span;
    LEFT + at * (WIDTH - LEFT - RIGHT)
}

/// The chart of `rows`.
pub fn svg(rows: &[Row], title: &str) -> String {
    let height = TOP + ROW * rows.len() as f64 + 70.0;
    let bottom = TOP + ROW * rows.len() as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"22\" font-size=\"14\">{}</text>\n",
        escape(title)
    );
    for ms in DECADES {
        let at = x(ms);
        let _ = writeln!(
            s,
            "<line x1=\"{at:.1}\" y1=\"{TOP}\" x2=\"{at:.1}\" y2=\"{bottom}\" stroke=\"#dddddd\"/>\
             <text x=\"{at:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            bottom + 16.0,
            if ms >= 1000.0 {
                format!("{} s", ms / 1000.0)
            } else {
                format!("{ms} ms")
            }
        );
    }
    for (i, row) in rows.iter().enumerate() {
        let mid = TOP + ROW * (i as f64 + 0.5);
        let (p50, p99, max, target) = (x(row.p50), x(row.p99), x(row.max), x(row.target));
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\
             <rect x=\"{LEFT}\" y=\"{:.1}\" width=\"{:.1}\" height=\"12\" fill=\"{OURS}\"/>\
             <line x1=\"{p50:.1}\" y1=\"{mid:.1}\" x2=\"{p99:.1}\" y2=\"{mid:.1}\" stroke=\"{OURS}\" stroke-width=\"2\"/>\
             <line x1=\"{max:.1}\" y1=\"{:.1}\" x2=\"{max:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\
             <line x1=\"{target:.1}\" y1=\"{:.1}\" x2=\"{target:.1}\" y2=\"{:.1}\" stroke=\"black\" stroke-dasharray=\"3,2\"/>",
            LEFT - 8.0,
            mid + 4.0,
            escape(&row.label),
            mid - 6.0,
            (p50 - LEFT).max(1.0),
            mid - 8.0,
            mid + 8.0,
            mid - 13.0,
            mid + 13.0,
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">from the control plane's change to \
         the slowest node's kernel serving it (log scale)</text>\n<text x=\"{LEFT}\" y=\"{:.1}\">\
         bar: p50; line: to p99; tick: max; dashed: the target for p99</text>\n</svg>",
        (LEFT + WIDTH - RIGHT) / 2.0,
        bottom + 36.0,
        bottom + 56.0,
    );
    s
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Reads `results` and writes their chart to `out`.
pub fn write(out: &Path, results: &[std::path::PathBuf]) -> anyhow::Result<()> {
    if results.is_empty() {
        bail!("--chart needs at least one results file (target/fleet/*.json)");
    }
    let mut all = Vec::new();
    let mut runs = Vec::new();
    for path in results {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let report: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not the harness's results", path.display()))?;
        all.extend(rows(&report).with_context(|| path.display().to_string())?);
        runs.push(format!(
            "{} nodes, {} services",
            report["nodes"], report["services"]
        ));
    }
    runs.dedup();
    let title = format!("Fleet convergence ({})", runs.join("; "));
    std::fs::write(out, svg(&all, &title)).with_context(|| format!("writing {}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_from_the_results_and_the_targets_from_the_issue() {
        let report = serde_json::json!({"control_plane": "xds", "kinds": [
            {"name": "eds-add", "every_node": {"p50_ms": 5.0, "p99_ms": 12.0, "max_ms": 15.5}}]});
        assert_eq!(
            rows(&report).unwrap(),
            [Row {
                label: "eds-add (xds)".into(),
                p50: 5.0,
                p99: 12.0,
                max: 15.5,
                target: 250.0
            }]
        );
        let timed_out = serde_json::json!({"control_plane": "consul", "kinds": [
            {"name": "register", "every_node": {"p50_ms": null}}]});
        let err = format!("{:#}", rows(&timed_out).unwrap_err());
        assert!(err.contains("register: no p50_ms"), "{err}");
        let unknown = serde_json::json!({"control_plane": "etcd", "kinds": []});
        assert!(rows(&unknown).is_err());
    }

    #[test]
    fn the_axis_is_logarithmic_and_clamped() {
        assert!((x(1.0) - LEFT).abs() < 1e-9);
        assert!((x(10000.0) - (WIDTH - RIGHT)).abs() < 1e-9);
        let decade = x(10.0) - x(1.0);
        assert!((x(1000.0) - x(100.0) - decade).abs() < 1e-9);
        assert!((x(0.1) - x(1.0)).abs() < 1e-9, "clamped below 1 ms");
        assert!((x(1e6) - x(10000.0)).abs() < 1e-9, "clamped above 10 s");
    }

    #[test]
    fn the_svg_has_a_row_per_kind_and_escapes_text() {
        let rows = [Row {
            label: "a<b".into(),
            p50: 30.0,
            p99: 70.0,
            max: 100.0,
            target: 1000.0,
        }];
        let svg = svg(&rows, "t & u");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b") && svg.contains("t &amp; u"));
        assert_eq!(svg.matches("stroke-dasharray").count(), 1);
        assert!(svg.contains(OURS));
    }
}
