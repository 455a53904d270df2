//! One SVG per `bench pressure` cell (the runs' `--json` objects): three
//! panels sharing the x axis (seconds since start) — completions against the offered
//! rate, pickup p99, dead tuples — one colour per system, the phases as bands.

use std::{iter, path::Path};

use anyhow::{bail, Context, Result};
use plotters::chart::SeriesLabelPosition::UpperRight;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// One run's samples, read out of its JSON object (`None`: null or missing).
struct Run {
    system: String,
    workload: String,
    colour: RGBColor,
    t: Vec<f64>,
    completed: Vec<Option<f64>>,
    offered: Vec<Option<f64>>,
    p99: Vec<Option<f64>>,
    dead: Vec<Option<f64>>,
}

/// A phase as an interval of the x axis: name, start, end.
type Phase = (String, f64, f64);

/// One line of a panel: label, colour, dashed, and `y[i]` at `t[i]` (a gap where `None`).
struct Line<'a>(String, RGBColor, bool, &'a [f64], Vec<Option<f64>>);

/// What the panels share: the x extent and the phases.
struct Frame {
    x_max: f64,
    phases: Vec<Phase>,
}

fn parse(v: &Value) -> Result<Run> {
    let system = v["system"].as_str().context("a run without \"system\"")?;
    let Some(samples) = v["samples"].as_array().filter(|s| !s.is_empty()) else {
        bail!("{system}: no samples to draw");
    };
    let field = |k: &str| samples.iter().map(|s| s[k].as_f64()).collect::<Vec<_>>();
    let t = field("t_s").into_iter().collect::<Option<Vec<_>>>();
    Ok(Run {
        system: system.to_owned(),
        workload: v["workload"].as_str().unwrap_or("?").to_owned(),
        colour: match (system, v["workload"].as_str()) {
            ("idemstage", Some("queue")) => RGBColor(23, 190, 207),
            ("idemstage", _) => RGBColor(31, 119, 180),
            ("awa", _) => RGBColor(214, 39, 40),
            _ => RGBColor(44, 160, 44),
        },
        t: t.context(format!("{system}: a sample without a numeric \"t_s\""))?,
        completed: field("completed_per_s"),
        offered: field("offered_per_s"),
        p99: field("pickup_p99_ms"),
        dead: field("dead_tuples_total"),
    })
}

fn phases(v: &Value) -> Vec<Phase> {
    let mut start = 0.0;
    let list = v["phases"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    list.iter()
        .filter_map(|p| {
            let (name, s) = (p["name"].as_str()?.to_owned(), p["s"].as_f64()?);
            start += s;
            Some((name, start - s, start))
        })
        .collect()
}

/// The contiguous runs of non-null points.
fn segments(t: &[f64], y: &[Option<f64>]) -> Vec<Vec<(f64, f64)>> {
    let mut out = vec![Vec::new()];
    for (&x, y) in t.iter().zip(y) {
        match y {
            Some(y) => out.last_mut().unwrap().push((x, *y)),
            None if out.last().unwrap().is_empty() => {}
            None => out.push(Vec::new()),
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// Axis labels: 1.5k, 20k, 2M, 0.25, 100.
fn short(v: f64) -> String {
    match v.abs() {
        a if a >= 1e6 => format!("{}M", (v / 1e5).round() / 10.0),
        a if a >= 1e3 => format!("{}k", (v / 1e2).round() / 10.0),
        _ => format!("{}", (v * 1000.0).round() / 1000.0),
    }
}

/// The largest value of the lines times `headroom` (at least 1): a linear axis from 0.
fn top(lines: &[Line], headroom: f64) -> f64 {
    (max(lines.iter().flat_map(|l| l.4.iter().flatten())) * headroom).max(1.0)
}

/// The largest value, 0 if none.
fn max<'a>(values: impl Iterator<Item = &'a f64>) -> f64 {
    values.fold(0.0, |a, &b| a.max(b))
}

impl Frame {
    /// Panel `idx` (0 at the top: it has the legend; 2 at the bottom: the x axis title).
    fn panel<Y>(&self, area: &Area, idx: usize, desc: &str, lines: &[Line], y: Y) -> Result<()>
    where
        Y: AsRangedCoord<Value = f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let mut chart = ChartBuilder::on(area)
            .margin(8)
            .margin_right(24)
            .x_label_area_size(if idx == 2 { 40 } else { 22 })
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..self.x_max, y)?;
        let (x_max, y_lo, y_hi) = (self.x_max, chart.y_range().start, chart.y_range().end);
        let mut mesh = chart.configure_mesh();
        mesh.y_desc(desc).light_line_style(WHITE.mix(0.0));
        mesh.x_label_formatter(&|v| short(*v));
        mesh.y_label_formatter(&|v| short(*v));
        mesh.x_desc(if idx == 2 { "seconds since start" } else { "" });
        mesh.draw()?;
        for (name, start, end) in &self.phases {
            let band = match name.as_str() {
                "warmup" => RGBColor(128, 128, 128).mix(0.18),
                "stress" => RGBColor(255, 170, 0).mix(0.15),
                "recovery" => RGBColor(0, 170, 80).mix(0.08),
                _ => RGBColor(128, 128, 128).mix(0.06),
            };
            let corners = [(*start, y_lo), (end.min(x_max), y_hi)];
            chart.draw_series(iter::once(Rectangle::new(corners, band.filled())))?;
            let (at, font) = ((start + x_max * 0.005, y_hi), ("sans-serif", 13));
            chart.draw_series(iter::once(Text::new(name.clone(), at, font)))?;
        }
        for Line(label, colour, dashed, t, y) in lines {
            let style = colour.stroke_width(if *dashed { 1 } else { 2 });
            if idx == 0 {
                let legend = chart.draw_series(LineSeries::new(vec![], style))?;
                let gap = if *dashed { 5 } else { 0 };
                legend.label(label.as_str()).legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + PathElement::new(vec![(0, 0), (7, 0)], style)
                        + PathElement::new(vec![(7 + gap, 0), (19, 0)], style)
                });
            }
            for seg in segments(t, y) {
                if seg.len() == 1 {
                    chart.draw_series(iter::once(Circle::new(seg[0], 2, style.filled())))?;
                } else if *dashed {
                    chart.draw_series(DashedLineSeries::new(seg, 6, 4, style))?;
                } else {
                    chart.draw_series(LineSeries::new(seg, style))?;
                }
            }
        }
        if idx == 0 {
            let mut legend = chart.configure_series_labels();
            let grey = RGBColor(180, 180, 180);
            legend.position(UpperRight).border_style(grey);
            legend.label_font(("sans-serif", 13));
            legend.background_style(WHITE.mix(0.85)).draw()?;
        }
        Ok(())
    }
}

/// One SVG per cell: `runs` are the JSON objects of one cell (ours, and awa's if it ran).
pub fn draw_cell(runs: &[Value], out: &Path) -> anyhow::Result<()> {
    let ours = runs.iter().find(|r| r["system"] == "idemstage");
    let head = ours.or(runs.first()).context("no runs to draw")?;
    let parsed = runs.iter().map(parse).collect::<Result<Vec<_>>>()?;
    let phases = phases(head);
    let end = phases.last().map_or(0.0, |p| p.2);
    let x_max = max(parsed.iter().flat_map(|r| &r.t)).max(end).max(1.0);
    let frame = Frame { x_max, phases };
    let text = |k: &str| head[k].as_str().unwrap_or("?");
    let workload = text("workload");
    let offered = head["offered_per_s"].as_f64().unwrap_or(f64::NAN);
    let title = format!("{} · {workload} · offered {offered} jobs/s", text("cell"));
    let lines = |f: fn(&Run) -> &Vec<Option<f64>>| -> Vec<Line> {
        let label = |r: &Run| match r.workload == workload {
            true => r.system.clone(),
            false => format!("{} ({})", r.system, r.workload),
        };
        let line = |r| Line(label(r), r.colour, false, &r.t, f(r).clone());
        parsed.iter().map(line).collect()
    };

    // Offered: the first run's in grey, another run's in its colour where it differs.
    let mut throughput = lines(|r| &r.completed);
    for (i, r) in parsed.iter().enumerate() {
        if i > 0 && r.offered == parsed[0].offered {
            continue;
        }
        let (label, colour) = match i {
            0 => ("offered".to_owned(), RGBColor(90, 90, 90)),
            _ => (format!("offered ({})", r.system), r.colour),
        };
        throughput.push(Line(label, colour, true, &r.t, r.offered.clone()));
    }
    let mut pickup = lines(|r| &r.p99);
    let dead = lines(|r| &r.dead);

    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let root = SVGBackend::new(out, (1100, 1000)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&title, ("sans-serif", 22))?;
    let areas = root.split_evenly((3, 1));
    let y = 0.0..top(&throughput, 1.35); // headroom for the legend
    frame.panel(&areas[0], 0, "completed jobs/s", &throughput, y)?;
    let all = pickup.iter().flat_map(|l| l.4.iter().flatten());
    let min_positive = |a: f64, &b: &f64| if b > 0.0 { a.min(b) } else { a };
    let lo = all.clone().fold(f64::INFINITY, min_positive);
    let hi = max(all);
    if hi / lo > 100.0 {
        let (lo, hi) = (lo / 1.5, hi * 1.5);
        for l in &mut pickup {
            l.4.iter_mut().flatten().for_each(|v| *v = v.max(lo)); // 0 ms on the floor
        }
        let y = (lo..hi).log_scale();
        frame.panel(&areas[1], 1, "pickup p99 ms (log)", &pickup, y)?;
    } else {
        let y = 0.0..top(&pickup, 1.1);
        frame.panel(&areas[1], 1, "pickup p99 ms", &pickup, y)?;
    }
    let y = 0.0..top(&dead, 1.1);
    frame.panel(&areas[2], 2, "dead tuples (hot tables)", &dead, y)?;
    root.present()
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::draw_cell;

    /// 20 samples, 5 s apart: clean 0-20 s, stress 20-80 s, recovery 80-100 s; `k`
    /// scales the pickup times and lowers the stress throughput.
    fn run(system: &str, k: f64) -> Value {
        let sample = |i: u32| {
            let t = f64::from(i) * 5.0;
            let phase = ["clean", "stress", "recovery"][(t > 20.0) as usize + (t > 80.0) as usize];
            let stress = phase == "stress";
            let p99 = (i % 7 != 3).then(|| k * if stress { 3.0 * f64::from(i) } else { 1.0 });
            let dead = f64::from(i * 1000 + (i % 4) * 20_000) * (1.0 + k / 40.0);
            json!({"t_s": t, "phase": phase, "offered_per_s": if stress { 600.0 } else { 400.0 },
                   "completed_per_s": if stress { 560.0 - k } else { 398.0 },
                   "pickup_p50_ms": p99.map(|p| p / 4.0), "pickup_p95_ms": null,
                   "pickup_p99_ms": p99, "backlog": 3, "dead_tuples": {"jobs": dead},
                   "dead_tuples_total": dead, "index_bytes_total": 0})
        };
        json!({"scenario": "pressure", "system": system, "workload": "queue",
               "cell": "idle_in_tx", "workers": 2, "offered_per_s": 400.0,
               "stress_offered_per_s": 600.0, "sample_every_s": 5, "hot_tables": ["jobs"],
               "phases": [{"name": "clean", "s": 20}, {"name": "stress", "s": 60},
                          {"name": "recovery", "s": 20}],
               "samples": (1..=20).map(sample).collect::<Vec<_>>()})
    }

    fn draw(runs: &[Value], name: &str) -> anyhow::Result<String> {
        let file = format!("pressure_plot_{}_{name}.svg", std::process::id());
        let path = std::env::temp_dir().join(file);
        let result = draw_cell(runs, &path).map(|()| std::fs::read_to_string(&path).unwrap());
        let _ = std::fs::remove_file(&path);
        result
    }

    #[test]
    fn draws_both_systems_and_the_phases() {
        let runs = [run("idemstage", 2.0), run("awa", 40.0)];
        let svg = draw(&runs, "both").unwrap();
        assert!(svg.len() > 1000 && svg.starts_with("<svg"), "{svg}");
        for text in "idemstage awa clean stress recovery idle_in_tx (log)".split(' ') {
            assert!(svg.contains(text), "{text} missing");
        }
    }

    #[test]
    fn draws_ours_alone() {
        let svg = draw(&[run("idemstage", 2.0)], "ours").unwrap();
        assert!(svg.contains("idemstage") && !svg.contains("awa") && !svg.contains("(log)"));
    }

    #[test]
    fn empty_samples_is_an_error() {
        let mut empty = run("idemstage", 1.0);
        empty["samples"] = json!([]);
        assert!(draw(&[empty], "empty").is_err());
        assert!(draw(&[], "none").is_err());
    }
}
