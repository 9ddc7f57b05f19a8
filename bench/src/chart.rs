//! PNG charts with plotters' bitmap backend. Text uses DejaVu Sans (Debian fonts-dejavu-core)
//! through plotters' ab_glyph feature; without the font the charts are drawn without labels
//! and BENCHMARKS.md carries them.

use std::path::Path;

use plotters::{prelude::*, style::FontStyle};

use super::report::Table;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn font_loaded() -> bool {
    static LOADED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOADED.get_or_init(|| match std::fs::read(FONT) {
        Ok(bytes) => plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            Box::leak(bytes.into_boxed_slice()),
        )
        .is_ok(),
        Err(_) => false,
    })
}

/// Draws every chart; false if none could be drawn (the report then links none).
pub fn draw(t: &Table<'_>, dir: &Path) -> bool {
    let text = font_loaded();
    let mut ok = true;
    for (name, result) in [
        ("ratios", ratios(t, &dir.join("ratios.png"), text)),
        ("scaling", scaling(t, &dir.join("scaling.png"), text)),
        ("latency", latency(t, &dir.join("latency.png"), text)),
    ] {
        if let Err(e) = result {
            crate::util::detail(format!("chart {name}: {e}"));
            ok = false;
        }
    }
    ok
}

type Res = Result<(), Box<dyn std::error::Error>>;

/// One panel: a bar per row with a min-max whisker.
fn bars(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    rows: &[(String, f64, f64, f64)],
    text: bool,
    reference: Option<f64>,
) -> Res {
    let n = rows.len().max(1);
    let ymax = rows
        .iter()
        .map(|r| r.3)
        .fold(0.0_f64, f64::max)
        .max(reference.unwrap_or(0.0))
        * 1.15
        + 1e-9;
    let mut b = ChartBuilder::on(area);
    b.margin(10);
    if text {
        b.caption(title, ("sans-serif", 18))
            .x_label_area_size(60)
            .y_label_area_size(60);
    }
    // A segmented 0..k range draws k + 1 segments: 0..n-1 gives exactly n.
    let mut chart =
        b.build_cartesian_2d((0..n.saturating_sub(1).max(1)).into_segmented(), 0.0..ymax)?;
    let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    let fmt = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
        _ => String::new(),
    };
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh();
    if text {
        mesh.x_labels(n)
            .x_label_formatter(&fmt)
            .x_label_style(("sans-serif", 12))
            .y_label_style(("sans-serif", 12));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        let color = Palette99::pick(i).mix(0.8);
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), r.1),
            ],
            color.filled(),
        );
        bar.set_margin(0, 0, 8, 8);
        bar
    }))?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        ErrorBar::new_vertical(
            SegmentValue::CenterOf(i),
            r.2,
            r.1,
            r.3,
            BLACK.stroke_width(2),
            10,
        )
    }))?;
    if let Some(y) = reference {
        chart.draw_series(LineSeries::new(
            [(SegmentValue::Exact(0), y), (SegmentValue::Exact(n), y)],
            RED.stroke_width(1),
        ))?;
    }
    Ok(())
}

fn ratio_rows(t: &Table<'_>, metric: &str, key: &str) -> Vec<(String, f64, f64, f64)> {
    t.rows()
        .into_iter()
        .filter(|r| r.contains(" lo"))
        .filter_map(|r| {
            let s = t.ratio(&r, metric, key)?;
            Some((r.replace(" lo", ""), s.median, s.min, s.max))
        })
        .collect()
}

fn ratios(t: &Table<'_>, file: &Path, text: bool) -> Res {
    let root = BitMapBackend::new(file, (1400, 1200)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((3, 1));
    for (area, (title, metric, key)) in panels.iter().zip([
        ("bulk, 1 stream (x S0, loopback)", "bulk_p1", "gbps"),
        (
            "request/response 1 B, 1 connection (x S0)",
            "rr_1b_c1",
            "tps",
        ),
        ("connections per second (x S0)", "cps", "cps"),
    ]) {
        bars(area, title, &ratio_rows(t, metric, key), text, Some(1.0))?;
    }
    root.present()?;
    Ok(())
}

fn latency(t: &Table<'_>, file: &Path, text: bool) -> Res {
    let root = BitMapBackend::new(file, (1400, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 1));
    for (area, (title, key)) in panels.iter().zip([
        ("open loop 1k msg/s: p50 (us)", "p50_us"),
        ("open loop 1k msg/s: p99 (us)", "p99_us"),
    ]) {
        let rows: Vec<_> = t
            .rows()
            .into_iter()
            .filter_map(|r| {
                let s = t.abs(&r, "ol_1000", key)?;
                Some((r.replace(" lo", ""), s.median, s.min, s.max))
            })
            .collect();
        bars(area, title, &rows, text, None)?;
    }
    root.present()?;
    Ok(())
}

fn scaling(t: &Table<'_>, file: &Path, text: bool) -> Res {
    let root = BitMapBackend::new(file, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let series = [
        (
            "S1 kernel path",
            ["S1 lo svc=1", "S1 lo svc=1000", "S1 lo svc=10000"],
            BLUE,
        ),
        (
            "S2 nft DNAT",
            ["S2 lo rules=1", "S2 lo rules=1000", "S2 lo rules=10000"],
            RED,
        ),
    ];
    let points: Vec<Vec<(usize, f64)>> = series
        .iter()
        .map(|(_, rows, _)| {
            rows.iter()
                .enumerate()
                .filter_map(|(i, r)| Some((i, t.ratio(r, "cps", "cps")?.median)))
                .collect()
        })
        .collect();
    let ymax = points.iter().flatten().map(|p| p.1).fold(1.0_f64, f64::max) * 1.15;
    let mut b = ChartBuilder::on(&root);
    b.margin(15);
    if text {
        b.caption(
            "connections/s x S0 by number of services (1, 1,000, 10,000)",
            ("sans-serif", 18),
        )
        .x_label_area_size(40)
        .y_label_area_size(50);
    }
    let mut chart = b.build_cartesian_2d((0..2_usize).into_segmented(), 0.0..ymax)?;
    let fmt = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => ["1", "1,000", "10,000"]
            .get(*i)
            .map(|s| (*s).to_owned())
            .unwrap_or_default(),
        _ => String::new(),
    };
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_label_formatter(&fmt);
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    for ((name, _, color), pts) in series.iter().zip(&points) {
        let s = chart.draw_series(LineSeries::new(
            pts.iter().map(|(i, y)| (SegmentValue::CenterOf(*i), *y)),
            color.stroke_width(3),
        ))?;
        if text {
            s.label(*name).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
