//! SVG charts of a run, drawn from its summary (what `report` writes to docs/bench/summary.json:
//! per row, per `metric.key`, the median, min and max over runs, absolute and as a ratio to S0),
//! so they can be drawn again from the committed summary without measuring (`--charts-only`).
//!
//! Each system under test keeps one colour in every chart ([`Peer`]): ours (the kernel path and
//! our proxy in every mode) a strong colour, the peers muted. Every chart names its axes. Text is
//! SVG text, laid out with plotters' built-in size estimate: no font file is needed.

use std::{collections::BTreeMap, path::Path};

use anyhow::Context as _;
use plotters::prelude::*;
use serde::Deserialize;

/// Who a row measures: its colour and its legend entry, the same in every chart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Peer {
    Ours,
    Direct,
    Nft,
    Haproxy,
    Nginx,
    Envoy,
}

impl Peer {
    fn of(row: &str) -> Self {
        match row.split_whitespace().next().unwrap_or_default() {
            "S0" => Self::Direct,
            "S2" | "S2b" => Self::Nft,
            _ if row.ends_with(" haproxy") => Self::Haproxy,
            _ if row.ends_with(" nginx") => Self::Nginx,
            _ if row.ends_with(" envoy") => Self::Envoy,
            _ => Self::Ours,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Ours => "ours (S1 kernel path, S3-S6 our proxy)",
            Self::Direct => "direct connection (S0)",
            Self::Nft => "nft DNAT (S2)",
            Self::Haproxy => "HAProxy",
            Self::Nginx => "nginx",
            Self::Envoy => "Envoy",
        }
    }

    /// Ours a strong vermilion; the peers light, desaturated hues of their own.
    fn colour(self) -> RGBColor {
        match self {
            Self::Ours => RGBColor(0xd5, 0x3e, 0x00),
            Self::Direct => RGBColor(0xb0, 0xb0, 0xb0),
            Self::Nft => RGBColor(0xd9, 0xc5, 0x8a),
            Self::Haproxy => RGBColor(0x9d, 0xbc, 0xd8),
            Self::Nginx => RGBColor(0xa3, 0xcc, 0xae),
            Self::Envoy => RGBColor(0xc3, 0xb1, 0xd6),
        }
    }
}

/// Median, min and max over runs.
#[derive(Clone, Copy, Debug, Deserialize)]
struct Stat {
    median: f64,
    min: f64,
    max: f64,
}

/// One `metric.key` of a row.
#[derive(Debug, Deserialize)]
struct Entry {
    abs: Stat,
    ratio: Option<Stat>,
}

/// A run's summary, rows in the report's order.
pub struct Summary {
    rows: Vec<(String, BTreeMap<String, Entry>)>,
}

impl Summary {
    /// Reads the summary `report` writes (`summary_json`).
    pub fn from_json(value: &serde_json::Value) -> anyhow::Result<Self> {
        let map: BTreeMap<String, BTreeMap<String, Entry>> =
            serde_json::from_value(value.clone()).context("not a run's summary")?;
        let mut rows: Vec<_> = map.into_iter().collect();
        rows.sort_by_key(|(row, _)| super::report::row_order(row));
        Ok(Self { rows })
    }

    fn get(&self, row: &str, what: &str) -> Option<&Entry> {
        let (_, m) = self.rows.iter().find(|(r, _)| r == row)?;
        m.get(what)
    }

    /// `(label, peer, stat)` of every row with `what`, the ratio or the absolute value.
    fn bars(&self, what: &str, ratio: bool, only: &str) -> Vec<(String, Peer, Stat)> {
        self.rows
            .iter()
            .filter(|(row, _)| row.contains(only))
            .filter_map(|(row, m)| {
                let e = m.get(what)?;
                let s = if ratio { e.ratio? } else { e.abs };
                Some((row.replace(" lo", ""), Peer::of(row), s))
            })
            .collect()
    }
}

/// Draws every chart into `dir`; false if one could not be drawn (the report then links none).
pub fn draw(summary: &Summary, dir: &Path) -> bool {
    let mut ok = true;
    for (name, result) in [
        ("ratios", ratios(summary, &dir.join("ratios.svg"))),
        ("scaling", scaling(summary, &dir.join("scaling.svg"))),
        ("latency", latency(summary, &dir.join("latency.svg"))),
    ] {
        if let Err(e) = result {
            crate::util::detail(format!("chart {name}: {e}"));
            ok = false;
        }
    }
    ok
}

/// `--charts-only`: draws the charts again from the committed docs/bench/summary.json.
pub fn redraw(root: &Path) -> anyhow::Result<()> {
    let dir = root.join("docs/bench");
    let file = dir.join("summary.json");
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?;
    let summary = Summary::from_json(&value).with_context(|| file.display().to_string())?;
    anyhow::ensure!(draw(&summary, &dir), "a chart could not be drawn (above)");
    Ok(())
}

type Res = Result<(), Box<dyn std::error::Error>>;
type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// Axis titles of one panel.
struct Axes<'a> {
    x: &'a str,
    y: &'a str,
}

/// One panel: a horizontal bar per row in its peer's colour (first row on top), a min-max
/// whisker, and `reference` as a vertical line.
fn bars(
    area: &Area<'_>,
    title: &str,
    axes: &Axes<'_>,
    rows: &[(String, Peer, Stat)],
    reference: Option<f64>,
) -> Res {
    let n = rows.len().max(1);
    let xmax = rows
        .iter()
        .map(|r| r.2.max)
        .fold(reference.unwrap_or(0.0), f64::max)
        * 1.1
        + 1e-9;
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .caption(title, ("sans-serif", 18))
        .x_label_area_size(45)
        .y_label_area_size(140)
        // A segmented 0..k range draws k + 1 segments: 0..n-1 gives exactly n.
        .build_cartesian_2d(0.0..xmax, (0..n.saturating_sub(1).max(1)).into_segmented())?;
    // Row i sits in segment n - 1 - i, so the first row is on top.
    let at = |i: usize| n - 1 - i;
    let names: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    let fmt = |v: &SegmentValue<usize>| {
        match v {
            SegmentValue::CenterOf(j) if *j < n => names.get(n - 1 - j).map(|s| (*s).to_owned()),
            _ => None,
        }
        .unwrap_or_default()
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&fmt)
        .label_style(("sans-serif", 12))
        .x_desc(axes.x)
        .y_desc(axes.y)
        .axis_desc_style(("sans-serif", 14))
        .draw()?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        let mut bar = Rectangle::new(
            [
                (0.0, SegmentValue::Exact(at(i))),
                (r.2.median, SegmentValue::Exact(at(i) + 1)),
            ],
            r.1.colour().filled(),
        );
        bar.set_margin(3, 3, 0, 0);
        bar
    }))?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        ErrorBar::new_horizontal(
            SegmentValue::CenterOf(at(i)),
            r.2.min,
            r.2.median,
            r.2.max,
            BLACK.stroke_width(1),
            8,
        )
    }))?;
    if let Some(x) = reference {
        chart.draw_series(LineSeries::new(
            [(x, SegmentValue::Exact(0)), (x, SegmentValue::Exact(n))],
            BLACK.stroke_width(1),
        ))?;
    }
    Ok(())
}

/// A strip naming the colour of every peer, the same in every chart.
fn legend(area: &Area<'_>) -> Res {
    let mut x = 20;
    for peer in [
        Peer::Ours,
        Peer::Direct,
        Peer::Nft,
        Peer::Haproxy,
        Peer::Nginx,
        Peer::Envoy,
    ] {
        area.draw(&Rectangle::new(
            [(x, 12), (x + 16, 28)],
            peer.colour().filled(),
        ))?;
        area.draw(&Text::new(peer.name(), (x + 22, 13), ("sans-serif", 14)))?;
        let width = i32::try_from(peer.name().len()).unwrap_or(40) * 8;
        x += width + 50;
    }
    Ok(())
}

/// A figure of `panels` stacked panels under the legend strip.
fn figure<'a>(root: &Area<'a>, panels: usize) -> Result<Vec<Area<'a>>, Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let (top, rest) = root.split_vertically(40);
    legend(&top)?;
    Ok(rest.split_evenly((panels, 1)))
}

fn ratios(s: &Summary, file: &Path) -> Res {
    let root = SVGBackend::new(file, (1100, 1500)).into_drawing_area();
    let panels = figure(&root, 3)?;
    for (area, (title, what)) in panels.iter().zip([
        ("Bulk, 1 stream, loopback", "bulk_p1.gbps"),
        (
            "Request/response 1 B, 1 connection, loopback",
            "rr_1b_c1.tps",
        ),
        ("Connections per second, loopback", "cps.cps"),
    ]) {
        let axes = Axes {
            x: "x S0 (1.0 = direct connection; bar: median, whisker: min-max over runs)",
            y: "row (loopback)",
        };
        bars(area, title, &axes, &s.bars(what, true, " lo"), Some(1.0))?;
    }
    root.present()?;
    Ok(())
}

fn latency(s: &Summary, file: &Path) -> Res {
    let root = SVGBackend::new(file, (1100, 1000)).into_drawing_area();
    let panels = figure(&root, 2)?;
    for (area, (title, what)) in panels.iter().zip([
        ("Open loop at 1k msg/s: p50", "ol_1000.p50_us"),
        ("Open loop at 1k msg/s: p99", "ol_1000.p99_us"),
    ]) {
        let axes = Axes {
            x: "latency (microseconds; bar: median, whisker: min-max over runs)",
            y: "row (loopback)",
        };
        bars(area, title, &axes, &s.bars(what, false, ""), None)?;
    }
    root.present()?;
    Ok(())
}

fn scaling(s: &Summary, file: &Path) -> Res {
    let root = SVGBackend::new(file, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let series = [
        (
            Peer::Ours,
            "S1 kernel path",
            ["S1 lo svc=1", "S1 lo svc=1000", "S1 lo svc=10000"],
        ),
        (
            Peer::Nft,
            "S2 nft DNAT",
            ["S2 lo rules=1", "S2 lo rules=1000", "S2 lo rules=10000"],
        ),
    ];
    let points: Vec<Vec<(usize, f64)>> = series
        .iter()
        .map(|(_, _, rows)| {
            rows.iter()
                .enumerate()
                .filter_map(|(i, r)| Some((i, s.get(r, "cps.cps")?.ratio?.median)))
                .collect()
        })
        .collect();
    let ymax = points.iter().flatten().map(|p| p.1).fold(1.0_f64, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .margin(15)
        .caption(
            "Connections per second by number of services, loopback",
            ("sans-serif", 18),
        )
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d((0..2_usize).into_segmented(), 0.0..ymax)?;
    let fmt = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => ["1", "1,000", "10,000"]
            .get(*i)
            .map(|s| (*s).to_owned())
            .unwrap_or_default(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .x_label_formatter(&fmt)
        .x_desc("services (S1) or nft DNAT rules (S2)")
        .y_desc("connections/s, x S0 (1.0 = direct connection)")
        .axis_desc_style(("sans-serif", 14))
        .draw()?;
    for ((peer, name, _), pts) in series.iter().zip(&points) {
        let colour = peer.colour();
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|(i, y)| (SegmentValue::CenterOf(*i), *y)),
                colour.stroke_width(3),
            ))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_has_one_peer_and_ours_stands_apart() {
        for (row, peer) in [
            ("S0 lo", Peer::Direct),
            ("S1 lo svc=1000", Peer::Ours),
            ("S2 veth rules=1", Peer::Nft),
            ("S2b lo", Peer::Nft),
            ("S3 lo haproxy", Peer::Haproxy),
            ("S3 veth nginx", Peer::Nginx),
            ("S3 lo envoy", Peer::Envoy),
            ("S3 lo ours", Peer::Ours),
            ("S5 veth ours", Peer::Ours),
            ("S6 lo", Peer::Ours),
        ] {
            assert_eq!(Peer::of(row), peer, "{row}");
        }
        let all = [
            Peer::Ours,
            Peer::Direct,
            Peer::Nft,
            Peer::Haproxy,
            Peer::Nginx,
            Peer::Envoy,
        ];
        let colours: std::collections::BTreeSet<_> = all.iter().map(|p| p.colour().rgb()).collect();
        assert_eq!(colours.len(), all.len(), "one colour per peer");
        // Saturation (max - min channel) of ours is at least twice any peer's.
        let sat = |p: Peer| {
            let (r, g, b) = p.colour().rgb();
            i32::from(r.max(g).max(b)) - i32::from(r.min(g).min(b))
        };
        for p in &all[1..] {
            assert!(sat(Peer::Ours) >= 2 * sat(*p), "{p:?} is as strong as ours");
        }
    }

    #[test]
    fn the_committed_summary_draws_every_chart_with_axis_titles() {
        let text = include_str!("../../docs/bench/summary.json");
        let value: serde_json::Value = serde_json::from_str(text).unwrap();
        let summary = Summary::from_json(&value).unwrap();
        let dir = std::env::temp_dir().join(format!("proxy-bench-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(draw(&summary, &dir));
        for (chart, titles) in [
            (
                "ratios",
                &["x S0 (1.0 = direct connection;", "row (loopback)"][..],
            ),
            ("latency", &["latency (microseconds;"][..]),
            ("scaling", &["services (S1) or nft DNAT rules (S2)"][..]),
        ] {
            let svg = std::fs::read_to_string(dir.join(format!("{chart}.svg"))).unwrap();
            for title in titles {
                assert!(
                    svg.contains(title),
                    "{chart}.svg has no axis title {title:?}"
                );
            }
            assert!(
                svg.contains("#D53E00") || svg.contains("#d53e00"),
                "{chart}.svg has no bar of ours"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
