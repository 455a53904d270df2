//! `cargo xtask pressure`: the pressure cells (`idemstage bench pressure`) for
//! ours (the example pipeline, and a no-op queue) and for awa's no-op queue
//! (bench/peers/awa), one after the other on one server, all at the same offered
//! jobs/s: half of our pipeline workers' peak, measured by the first cell.
//! Writes `target/bench/pressure/<cell>.json` (both runs) and `<cell>.svg` (the
//! picture BENCHMARKS.md links), and prints a markdown table of the summaries.
//!
//! With `--together` the runs of a cell start at the same moment, each on a
//! database of its own on the one server (the long soak: ours and awa's under
//! the same conditions for the same two hours); the rate is then given, not
//! measured: `--jobs-per-s R` offers R jobs/s to every run.
//!
//! usage: cargo xtask pressure [--cells idle_in_tx,active_readers,...]
//!        [--items-per-s R | --jobs-per-s R] [--together]
//!        [--clean-s N] [--stress-s N] [--recovery-s N]
//!        [--workloads pipeline,queue,fan-out] [--pressure-prefetch N]
//!        [--pressure-retention-s S] [--no-awa]

use std::{
    fs, io,
    process::{Command, Output, Stdio},
    thread::{self, JoinHandle},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::bench::{build_awa, build_ours, flag, psql};
use crate::{pressure_plot, project_root, with_database_durable};

const CELLS: [&str; 5] = [
    "idle_in_tx",
    "active_readers",
    "sustained_high_load",
    "event_burst",
    "clean",
];
/// Passed on to ours and awa alike.
const PHASE_FLAGS: [&str; 5] = [
    "--warmup-s",
    "--clean-s",
    "--stress-s",
    "--recovery-s",
    "--sample-every-s",
];

pub fn main(args: &[String]) -> Result<i32> {
    let cells: Vec<String> = match flag(args, "--cells") {
        Some(c) => c.split(',').map(str::to_owned).collect(),
        None => CELLS[..4].iter().map(|c| (*c).to_owned()).collect(),
    };
    if let Some(bad) = cells.iter().find(|c| !CELLS.contains(&c.as_str())) {
        eprintln!(
            "xtask pressure: --cells {bad:?}: give some of {}",
            CELLS.join(",")
        );
        return Ok(2);
    }
    let (mut items_per_s, jobs_per_s) =
        match (rate(args, "--items-per-s"), rate(args, "--jobs-per-s")) {
            (Ok(items), Ok(jobs)) => (items, jobs),
            (Err(bad), _) | (_, Err(bad)) => {
                eprintln!("xtask pressure: {bad}: give a positive number");
                return Ok(2);
            }
        };
    if jobs_per_s.is_some() && items_per_s.is_some() {
        eprintln!("xtask pressure: give --items-per-s or --jobs-per-s, not both");
        return Ok(2);
    }
    let together = args.iter().any(|a| a == "--together");
    if together && jobs_per_s.is_none() {
        eprintln!(
            "xtask pressure: --together needs --jobs-per-s R (no run goes first to measure the peak)"
        );
        return Ok(2);
    }
    let awa_too = !args.iter().any(|a| a == "--no-awa");
    let workloads: Vec<String> = flag(args, "--workloads")
        .unwrap_or_else(|| "pipeline,queue".into())
        .split(',')
        .map(str::to_owned)
        .collect();
    if workloads.is_empty()
        || workloads
            .iter()
            .any(|w| w != "pipeline" && w != "queue" && w != "fan-out")
    {
        eprintln!("xtask pressure: --workloads {workloads:?}: give pipeline, queue, fan-out");
        return Ok(2);
    }
    let root = project_root();
    let target = build_ours(&root)?;
    let ours_bin = target.join("release").join("idemstage");
    let awa_bin = if awa_too {
        Some(build_awa(&root)?)
    } else {
        None
    };
    let dir = target.join("bench").join("pressure");
    fs::create_dir_all(&dir)?;

    let mut phase_args = Vec::new();
    for f in PHASE_FLAGS {
        if let Some(v) = flag(args, f) {
            phase_args.extend([f.to_owned(), v]);
        }
    }
    // Ours only: the pipeline workers' --prefetch, the queue workers' retention.
    let mut ours_args: Vec<String> = Vec::new();
    for f in ["--pressure-prefetch", "--pressure-retention-s"] {
        if let Some(v) = flag(args, f) {
            ours_args.extend([f.to_owned(), v]);
        }
    }
    let mut failed = false;
    let mut rows = Vec::new();
    with_database_durable("idemstage_pressure_bench", None, |url| {
        // The server's URL without the database: awa's and (together) each
        // workload's database are beside ours.
        let base = match url.rsplit_once('/') {
            Some((base, _)) => base,
            None => bail!("DATABASE_URL {url:?} names no database"),
        };
        let awa_url = format!("{base}/awa_pressure_bench");
        if awa_too {
            psql(url, "DROP DATABASE IF EXISTS awa_pressure_bench")?;
            psql(url, "CREATE DATABASE awa_pressure_bench")?;
        }
        let ours_url = |workload: &str| -> Result<String> {
            if !together {
                return Ok(url.to_owned());
            }
            // Together: each workload on its own database (a run resets its own).
            let db = format!("idemstage_pressure_bench_{}", workload.replace('-', "_"));
            psql(url, &format!("DROP DATABASE IF EXISTS {db}"))?;
            psql(url, &format!("CREATE DATABASE {db}"))?;
            Ok(format!("{base}/{db}"))
        };
        for cell in &cells {
            let mut runs = Vec::new();
            let mut offered: Option<f64> = jobs_per_s;
            let mut started: Vec<(String, JoinHandle<io::Result<Output>>)> = Vec::new();
            for workload in &workloads {
                let mut cmd = Command::new(&ours_bin);
                cmd.args([
                    "bench",
                    "pressure",
                    "--json",
                    "--cell",
                    &cell.replace('_', "-"),
                ])
                .args(["--workload", workload])
                .args(&phase_args)
                .args(&ours_args)
                .env("DATABASE_URL", ours_url(workload)?);
                // Units/s: items for the pipeline (four jobs each), jobs for the queue.
                match (offered, workload.as_str()) {
                    (Some(jobs), "queue") => cmd.args(["--items-per-s", &jobs.to_string()]),
                    // Six jobs an item: intake, extract, calculate and three positions.
                    (Some(jobs), "fan-out") => {
                        cmd.args(["--items-per-s", &(jobs / 6.0).to_string()])
                    }
                    (Some(jobs), _) => cmd.args(["--items-per-s", &(jobs / 4.0).to_string()]),
                    (None, _) => match items_per_s {
                        Some(r) => cmd.args(["--items-per-s", &r.to_string()]),
                        None => &mut cmd,
                    },
                };
                eprintln!("xtask pressure: {cell}: idemstage {workload}");
                if together {
                    started.push((format!("idemstage {workload}"), spawn(&mut cmd)?));
                    continue;
                }
                let run = run_json(&mut cmd)?;
                // The first run measured the peak; every later one offers the same.
                offered = offered.or(run["offered_per_s"].as_f64());
                if workload == "pipeline" {
                    items_per_s = items_per_s.or(run["items_per_s"].as_f64());
                }
                runs.push(run);
            }
            let offered = offered.unwrap_or(0.0);
            if let Some(awa) = &awa_bin {
                eprintln!("xtask pressure: {cell}: awa at {offered} jobs/s");
                let mut cmd = Command::new(awa);
                cmd.args(["pressure", "--cell", cell, "--rate", &offered.to_string()])
                    .args(&phase_args)
                    .env("DATABASE_URL", &awa_url);
                if together {
                    started.push(("awa".to_owned(), spawn(&mut cmd)?));
                } else {
                    match run_json(&mut cmd) {
                        Ok(run) => runs.push(run),
                        Err(e) => eprintln!("xtask pressure: {cell}: awa gave no run: {e:#}"),
                    }
                }
            }
            for (name, run) in started {
                let run = run
                    .join()
                    .map_err(|_| anyhow::anyhow!("the thread reading {name} panicked"))?;
                match output_json(run.context("running a pressure cell")?) {
                    Ok(run) => runs.push(run),
                    Err(e) => eprintln!("xtask pressure: {cell}: {name} gave no run: {e:#}"),
                }
            }
            for run in &runs {
                failed |= run["violations"].as_array().is_some_and(|v| !v.is_empty());
                rows.push(row(run));
            }
            fs::write(
                dir.join(format!("{cell}.json")),
                serde_json::to_string_pretty(&runs)?,
            )?;
            pressure_plot::draw_cell(&runs, &dir.join(format!("{cell}.svg")))?;
        }
        Ok(())
    })?;
    println!("| cell | system | offered jobs/s | clean done/s | stress done/s (ratio) | first 240 s ratio | pickup p99 clean → stress (ms) | recovered after s | dead tuples median / max | drained | shutdown s |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|");
    for r in rows {
        println!("{r}");
    }
    eprintln!("xtask pressure: wrote {}", dir.display());
    Ok(if failed { 1 } else { 0 })
}

/// The positive rate `name` gives, if given; `Err` names the flag and its value.
fn rate(args: &[String], name: &str) -> Result<Option<f64>, String> {
    match flag(args, name) {
        Some(v) => match v.parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Some(r)),
            _ => Err(format!("{name} {v:?}")),
        },
        None => Ok(None),
    }
}

/// The one JSON object a run prints, or why there is none.
fn run_json(cmd: &mut Command) -> Result<Value> {
    output_json(cmd.output().context("running a pressure cell")?)
}

/// A run started now, its output read by a thread of its own (so no run
/// waits on a full pipe while another is read).
fn spawn(cmd: &mut Command) -> Result<JoinHandle<io::Result<Output>>> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting a pressure cell")?;
    Ok(thread::spawn(move || child.wait_with_output()))
}

fn output_json(out: Output) -> Result<Value> {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{'));
    match line {
        Some(l) => serde_json::from_str(l).context("the run's JSON"),
        None => bail!(
            "exit {:?}, no JSON; stderr: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ),
    }
}

fn row(run: &Value) -> String {
    let s = &run["summary"];
    let n = |v: &Value| v.as_f64().map_or("–".to_owned(), |x| format!("{x}"));
    format!(
        "| {} | {} ({}) | {} | {} | {} ({}) | {} | {} → {} | {} | {} / {} | {} | {} |",
        run["cell"].as_str().unwrap_or("?"),
        run["system"].as_str().unwrap_or("?"),
        run["workload"].as_str().unwrap_or("?"),
        n(&run["offered_per_s"]),
        n(&s["clean"]["completed_per_s"]),
        n(&s["stress"]["completed_per_s"]),
        n(&s["stress_completion_ratio"]),
        n(&s["stress_first_240s_completion_ratio"]),
        n(&s["clean"]["pickup_p99_ms"]),
        n(&s["stress"]["pickup_p99_ms"]),
        n(&s["recovered_after_s"]),
        n(&s["dead_tuples_median"]),
        n(&s["dead_tuples_max"]),
        run["drained"],
        n(&run["shutdown_s"]),
    )
}
