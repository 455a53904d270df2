//! `cargo xtask bench`: our benchmarks and their references in one run, on one
//! server, once per durability mode. Ours: `idemstage bench claim|queue|pipeline
//! --json` (release). The references: pgbench on the SQL the claim and a stage
//! execution send (bench/pgbench/, prepared mode), and three job queues doing the
//! queue tests (bench/peers/: pg-boss and graphile-worker on Node.js, awa in Rust).
//! Writes `target/bench/report.json` and prints a markdown table.
//!
//! The inputs are flat objects printed by our own tools, so numbers are picked
//! out by key (the pressure cells, nested, are read with serde_json).

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{cargo, project_root, with_database_durable};

/// Flags of xtask itself, not passed on to `idemstage bench` and the peers.
const OWN_FLAGS: [&str; 2] = ["--durable", "--only"];

/// What `--only` may name: the pairs against pgbench, run alone (no peers, no
/// queue scenario) for a quick look at a ratio.
const ONLY_PARTS: [&str; 4] = ["claims", "stages", "stages-split", "drain"];

/// One row of the table: a measure, ours, a reference and their ratio.
struct Row {
    measure: String,
    ours: String,
    reference: String,
    ratio: String,
}

/// One run of the suite on one server.
struct Suite {
    durable: bool,
    json: String,
    rows: Vec<Row>,
}

pub fn main(args: &[String]) -> Result<i32> {
    let durable = flag(args, "--durable");
    let only = flag(args, "--only");
    if let Some(only) = &only {
        if let Some(bad) = only.split(',').find(|p| !ONLY_PARTS.contains(p)) {
            bail!("--only {bad:?}: give claims, stages, stages-split or drain (comma-separated)");
        }
    }
    let external = env::var("DATABASE_URL").is_ok_and(|u| !u.is_empty());
    let modes: Vec<Option<bool>> = match (durable.as_deref(), external) {
        (None, true) => vec![None],
        (None | Some("both"), false) => vec![Some(false), Some(true)],
        (Some("off"), _) => vec![Some(false)],
        (Some("on"), _) => vec![Some(true)],
        (Some("both"), true) => {
            bail!("--durable both needs the disposable cluster: with DATABASE_URL set, the server's settings are what they are (give --durable on|off to check them)")
        }
        (Some(other), _) => bail!("--durable {other:?}: give off, on or both"),
    };
    let pass: Vec<String> = {
        let mut pass = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            if OWN_FLAGS.contains(&a.as_str()) {
                it.next();
            } else if !OWN_FLAGS.iter().any(|f| a.starts_with(&format!("{f}="))) {
                pass.push(a.clone());
            }
        }
        pass
    };
    let root = project_root();
    let target = build_ours(&root)?;
    // The quick pairs need no peers (npm ci, awa's release build).
    let peers = match only {
        Some(_) => None,
        None => Some(Peers::prepare(&root)?),
    };

    let mut suites = Vec::new();
    for mode in modes {
        let suite = with_database_durable("idemstage_bench", mode, |url| {
            let durable = server_durable(url)?;
            if mode.is_some_and(|m| m != durable) {
                bail!(
                    "the server runs with fsync {}, not as --durable asks: stop the disposable cluster (cargo xtask db stop) or give the other mode",
                    if durable { "on" } else { "off" }
                );
            }
            suite(
                &root,
                &target,
                peers.as_ref(),
                only.as_deref(),
                url,
                &pass,
                durable,
            )
        })?;
        suites.push(suite);
    }

    let report = format!(
        "{{\n  \"runs\": [\n{}\n  ]\n}}\n",
        suites
            .iter()
            .map(|s| s.json.trim_end().to_owned())
            .collect::<Vec<_>>()
            .join(",\n")
    );
    let dir = target.join("bench");
    fs::create_dir_all(&dir)?;
    let path = dir.join("report.json");
    fs::write(&path, &report)?;
    print_table(&suites);
    eprintln!("xtask bench: wrote {}", path.display());
    Ok(0)
}

fn mode_name(durable: bool) -> &'static str {
    if durable {
        "durable"
    } else {
        "fsync off"
    }
}

/// One markdown table, the runs side by side (they have the same rows).
fn print_table(suites: &[Suite]) {
    let mut header = String::from("| measure |");
    let mut rule = String::from("|---|");
    for s in suites {
        let m = mode_name(s.durable);
        header.push_str(&format!(" ours ({m}) | reference ({m}) | ratio |"));
        rule.push_str("---:|---:|---:|");
    }
    println!("{header}\n{rule}");
    let Some(first) = suites.first() else { return };
    for (i, row) in first.rows.iter().enumerate() {
        let mut line = format!("| {} |", row.measure);
        for s in suites {
            match s.rows.get(i) {
                Some(r) => line.push_str(&format!(" {} | {} | {} |", r.ours, r.reference, r.ratio)),
                None => line.push_str(" | | |"),
            }
        }
        println!("{line}");
    }
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}", a / b)
    } else {
        String::new()
    }
}

/// Whether the server at `url` runs with fsync on.
fn server_durable(url: &str) -> Result<bool> {
    Ok(psql(url, "SHOW fsync")?.trim() == "on")
}

/// The 1-minute load average (other work on the machine shares its two cores).
fn load_average() -> f64 {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Builds our `idemstage` binary in release; returns the target directory it is in
/// (`target/release/idemstage`).
pub(crate) fn build_ours(root: &Path) -> Result<PathBuf> {
    let status = cargo()
        .args([
            "build",
            "--release",
            "-p",
            "idemstage-dev",
            "--bin",
            "idemstage",
        ])
        .status()
        .context("cargo build")?;
    if !status.success() {
        bail!("release build failed");
    }
    Ok(env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target")))
}

/// awa's reference built in release, in its own project and target dir (it is no
/// member of our workspace); the path of its binary.
pub(crate) fn build_awa(root: &Path) -> Result<PathBuf> {
    let awa_dir = root.join("bench").join("peers").join("awa");
    eprintln!("xtask: cargo build --release in {}", awa_dir.display());
    let status = cargo()
        .args(["build", "--release", "--locked", "--manifest-path"])
        .arg(awa_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(awa_dir.join("target"))
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .context("cargo build of bench/peers/awa")?;
    if !status.success() {
        bail!("bench/peers/awa: release build failed");
    }
    Ok(awa_dir
        .join("target")
        .join("release")
        .join("idemstage-bench-awa"))
}

/// The peers in bench/peers: how to run each, once built.
struct Peers {
    dir: PathBuf,
    awa: PathBuf,
}

impl Peers {
    /// `npm ci` unless node_modules has every peer (a node_modules left by an
    /// older package.json lacked graphile-worker, and both Node peers failed);
    /// awa built in release, in its own project and target dir (it is no member
    /// of our workspace).
    fn prepare(root: &Path) -> Result<Peers> {
        let dir = root.join("bench").join("peers");
        let modules = dir.join("node_modules");
        if ["pg", "pg-boss", "graphile-worker"]
            .iter()
            .any(|m| !modules.join(m).join("package.json").exists())
        {
            eprintln!("xtask bench: npm ci in {}", dir.display());
            output(
                Command::new("npm")
                    .args(["ci", "--no-audit", "--no-fund"])
                    .current_dir(&dir),
            )?;
        }
        let awa = build_awa(root)?;
        Ok(Peers { dir, awa })
    }

    /// Runs one peer; its JSON, or why there is none (a peer that lost, repeated
    /// or left a job exits non-zero: its numbers are not measurements).
    fn run(&self, name: &str, url: &str, args: &[String]) -> Result<String, String> {
        let mut cmd = match name {
            "awa" => Command::new(&self.awa),
            script => {
                let mut c = Command::new("node");
                c.arg(format!("{script}.mjs"));
                c
            }
        };
        cmd.current_dir(&self.dir).env("DATABASE_URL", url);
        for key in [
            "--jobs",
            "--concurrency",
            "--drain-batch",
            "--drain-loops",
            "--latency-sends",
            "--latency-gap-ms",
        ] {
            if let Some(v) = flag(args, key) {
                cmd.args([key, &v]);
            }
        }
        eprintln!("xtask bench: peer {name}");
        let out = output(&mut cmd).map_err(|e| {
            // The report keeps a line of it; the whole of what the peer printed
            // (its stdout and stderr, the last lines) goes to our stderr, so that a
            // failed peer can be diagnosed after the run.
            let e = format!("{e:#}");
            let lines: Vec<&str> = e.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            eprintln!("xtask bench: peer {name} failed:\n{tail}");
            e
        })?;
        out.lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .map(str::to_owned)
            .ok_or_else(|| format!("{name} printed no JSON"))
    }
}

const PEERS: [(&str, &str); 3] = [
    ("pgboss", "pg-boss"),
    ("graphile", "graphile-worker"),
    ("awa", "awa"),
];

fn suite(
    root: &Path,
    target: &Path,
    peers: Option<&Peers>,
    only: Option<&str>,
    url: &str,
    args: &[String],
    durable: bool,
) -> Result<Suite> {
    let duration = flag(args, "--duration-s").unwrap_or_else(|| "10".into());
    let concurrency = flag(args, "--concurrency").unwrap_or_else(|| "16".into());
    let load_before = load_average();
    let bin = target.join("release").join("idemstage");
    let ours_on = |cpus: Option<&str>, scenario: &str, extra: &[&str]| -> Result<String> {
        let mut cmd = command_on(cpus, &bin);
        // A flag given here replaces the caller's (clap takes each once).
        let given = without_flags(args, extra);
        cmd.args(["bench", scenario, "--json"])
            .args(extra)
            .args(&given)
            .env("DATABASE_URL", url);
        eprintln!(
            "xtask bench ({}): idemstage bench {scenario} {}",
            mode_name(durable),
            args.join(" ")
        );
        output(&mut cmd)
    };
    let ours = |scenario: &str, extra: &[&str]| ours_on(None, scenario, extra);
    let pgbench = find_pgbench()?;
    let pgbench_on = |cpus: Option<&str>,
                      script: &str,
                      extra: &[(&str, &str)]|
     -> Result<(f64, u64)> {
        let path = root.join("bench").join("pgbench").join(script);
        eprintln!("xtask bench: pgbench {script} (prepared), {concurrency} clients, {duration} s");
        let mut cmd = command_on(cpus, &pgbench);
        cmd.args([
            "-n",
            "-M",
            "prepared",
            "-j",
            "2",
            "-c",
            &concurrency,
            "-T",
            &duration,
        ]);
        for (name, value) in PGBENCH_VARIABLES {
            cmd.arg("-D").arg(format!("{name}={value}"));
        }
        cmd.arg("-D").arg(format!("clients={concurrency}"));
        for (name, value) in extra {
            cmd.arg("-D").arg(format!("{name}={value}"));
        }
        let out = output(cmd.arg("-f").arg(&path).arg(url))?;
        if let Some(line) = out.lines().find(|l| l.contains("aborted")) {
            bail!("pgbench {script}: {line}");
        }
        let tps = out
            .lines()
            .find_map(|l| l.strip_prefix("tps = "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("no tps in pgbench output:\n{out}"))?;
        let transactions = out
            .lines()
            .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
            .and_then(|l| l.split('/').next())
            .and_then(|n| n.trim().parse().ok())
            .with_context(|| format!("no transaction count in pgbench output:\n{out}"))?;
        Ok((tps, transactions))
    };
    let run_pgbench = |script: &str, extra: &[(&str, &str)]| pgbench_on(None, script, extra);
    // What a script left in the database, so that a reference that silently did
    // nothing (a claim without a source row inserts nothing and still commits)
    // cannot pass for a fast one.
    let check = |script: &str, what: &str, sql: &str, expected: u64| -> Result<()> {
        let got = psql_number(url, sql)?;
        if got != expected {
            bail!("pgbench {script}: {what}: {got}, expected {expected} (`{sql}`)");
        }
        Ok(())
    };

    let batch = pipeline_batch(args);
    let num = |json: &str, key: &str| -> Result<f64> {
        number(json, key).with_context(|| format!("no number {key:?} in {json}"))
    };
    // The worker against the statements with the job, in PAIR_ROUNDS interleaved
    // rounds (the machine's pace drifts between runs far more than either side
    // differs within one): each side's median, and our last run's JSON.
    // pgbench's round with the job: `pipeline` 1 sends the statements in the
    // round trips the worker takes, 0 each in its own.
    let pg_stage_round = |cpus: Option<&str>, pipeline: &str| -> Result<f64> {
        ours_on(cpus, "claim", &["--setup-only"])?;
        let seeded = seed_stage_jobs(url, &concurrency, &batch)?;
        let (pg, n) = pgbench_on(
            cpus,
            "stage.sql",
            &[
                ("job", "1"),
                ("batch", &batch),
                ("k", "0"),
                ("pipeline", pipeline),
            ],
        )?;
        check_stage(&check, n, seeded)?;
        check(
            "stage.sql",
            "jobs completed",
            "SELECT count(*) FROM jobs WHERE state = 'completed'",
            n,
        )?;
        Ok(pg)
    };
    // The worker against the statements with the job, in PAIR_ROUNDS interleaved
    // rounds (the machine's pace drifts between runs far more than either side
    // differs within one): each side's median (ours, pgbench in the worker's round
    // trips, pgbench one statement a round trip), and our last run's JSON.
    let stage_pair = |cpus: Option<&str>| -> Result<(f64, f64, f64, String)> {
        let (mut ours_per_s, mut last) = (Vec::new(), String::new());
        let (mut pg_per_s, mut pg_sequential) = (Vec::new(), Vec::new());
        for _ in 0..PAIR_ROUNDS {
            pg_per_s.push(pg_stage_round(cpus, "1")?);
            pg_sequential.push(pg_stage_round(cpus, "0")?);
            last = ours_on(cpus, "pipeline", &[])?;
            ours_per_s.push(num(&last, "stages_per_s")?);
        }
        Ok((
            median(ours_per_s),
            median(pg_per_s),
            median(pg_sequential),
            last,
        ))
    };
    // Claims, as the stages: PAIR_ROUNDS interleaved rounds, each reference
    // from the same fixtures as our timed run; medians (insert ours, insert
    // pgbench, skip ours, skip pgbench) and our last run's JSON.
    let claim_pair = |cpus: Option<&str>| -> Result<([f64; 4], String)> {
        let mut per_s: [Vec<f64>; 4] = Default::default();
        let mut last = String::new();
        for _ in 0..PAIR_ROUNDS {
            ours_on(cpus, "claim", &["--setup-only"])?;
            let (pg_insert, n) = pgbench_on(cpus, "claim_insert.sql", &[])?;
            check(
                "claim_insert.sql",
                "runs it claimed",
                "SELECT count(*) FROM stage_runs WHERE worker_id = 'pgbench' AND status = 'running'",
                n,
            )?;
            ours_on(cpus, "claim", &["--setup-only"])?;
            let (pg_skip, _) = pgbench_on(cpus, "claim_skip.sql", &[])?;
            check(
                "claim_skip.sql",
                "runs changed (a skip changes none)",
                "SELECT count(*) FROM stage_runs WHERE NOT (stage = 'done' AND status = 'success' AND attempts = 1)",
                0,
            )?;
            last = ours_on(cpus, "claim", &[])?;
            per_s[0].push(num(&last, "insert_per_s")?);
            per_s[1].push(pg_insert);
            per_s[2].push(num(&last, "skip_per_s")?);
            per_s[3].push(pg_skip);
        }
        Ok((per_s.map(median), last))
    };
    // `--only`: the pairs named, alone; their rows and medians, nothing else.
    if let Some(only) = only {
        let drain = || ours("queue", &[]);
        return quick_pairs(only, durable, url, &claim_pair, &stage_pair, &drain);
    }
    let peers = peers.context("the peers are prepared for a full run")?;
    // The stage's statements alone (job=0), then with the job that carries the
    // execution (job=1: its fetch and its completion, as the worker sends them).
    ours("claim", &["--setup-only"])?;
    let (pg_stage, n) = run_pgbench("stage.sql", &STAGE_ONLY)?;
    check_stage(&check, n, 0)?;
    let queue = ours("queue", &[])?;
    let ([c_ins, pg_insert, c_skip, pg_skip], claim) = claim_pair(None)?;
    let (p_stages, pg_stage_job, pg_stage_sequential, pipeline) = stage_pair(None)?;
    let pipeline_no_prefetch = ours("pipeline", &["--pipeline-batch", "0"])?;
    // The claims and the stage executions again, with the server on one half of
    // the CPUs and the clients (ours, pgbench) on the other, as where workers do
    // not run on the database's host: what our statements cost the server,
    // without our client's CPU taken from it.
    let split = match split_cpus() {
        Some((server, client)) => {
            let pinned = Pinned::server(url, &server, &format!("{server},{client}"))?;
            let on = Some(client.as_str());
            let measured = (|| -> Result<Split> {
                let ([ins, pg_insert, skip, pg_skip], _) = claim_pair(on)?;
                let (stages, pg_stage, pg_stage_sequential, _) = stage_pair(on)?;
                Ok(Split {
                    insert: (ins, pg_insert),
                    skip: (skip, pg_skip),
                    stages: (stages, pg_stage),
                    stages_sequential: (stages, pg_stage_sequential),
                })
            })();
            drop(pinned);
            Some((server, client, measured?))
        }
        None => {
            eprintln!("xtask bench: fewer than 2 CPUs or no taskset: no split-CPU runs");
            None
        }
    };
    let peer_out: Vec<(&str, Result<String, String>)> = PEERS
        .iter()
        .map(|(script, label)| (*label, peers.run(script, url, args)))
        .collect();
    let load_after = load_average();

    let q_enq = num(&queue, "enqueue_per_s")?;
    let q_distinct = num(&queue, "distinct_jobs_created")?;
    let q_drain = num(&queue, "drain_per_s")?;
    let q_loops = num(&queue, "drain_loops")?;
    let q_worker = num(&queue, "worker_drain_per_s")?;
    let q_worker_pf = num(&queue, "worker_drain_prefetch_per_s")?;
    let q_prefetch = num(&queue, "worker_prefetch")?;
    let q_p50 = num(&queue, "latency_ms_p50")?;
    let q_p99 = num(&queue, "latency_ms_p99")?;
    let q_durable_p50 = num(&queue, "latency_durable_lease_ms_p50")?;
    let q_durable_p99 = num(&queue, "latency_durable_lease_ms_p99")?;
    let p_stages_np = num(&pipeline_no_prefetch, "stages_per_s")?;
    let p_rss = num(&pipeline, "worker_peak_rss_mb")?;

    let mut rows = Vec::new();
    let mut row = |measure: &str, ours: String, reference: String, ratio: String| {
        rows.push(Row {
            measure: measure.to_owned(),
            ours,
            reference,
            ratio,
        })
    };
    row(
        "claim, insert path (claims/s; medians of the rounds)",
        format!("{c_ins:.0}"),
        format!("pgbench {pg_insert:.0}"),
        ratio(c_ins, pg_insert),
    );
    row(
        "claim, skip path (claims/s)",
        format!("{c_skip:.0}"),
        format!("pgbench {pg_skip:.0}"),
        ratio(c_skip, pg_skip),
    );
    row(
        &format!("stage executions/s (`PipelineWorker`, {batch} per fetch, prefetch 2x) vs the stage's statements with its job's fetch and completion (medians of {PAIR_ROUNDS} interleaved rounds)"),
        format!("{p_stages:.0}"),
        format!("pgbench {pg_stage_job:.0}"),
        ratio(p_stages, pg_stage_job),
    );
    row(
        "the same worker vs the same statements, each in a round trip of its own (pgbench without `\\startpipeline`; medians)",
        format!("{p_stages:.0}"),
        format!("pgbench {pg_stage_sequential:.0}"),
        ratio(p_stages, pg_stage_sequential),
    );
    row(
        "the same worker vs the stage's statements alone (no fetch, no completion; one round)",
        format!("{p_stages:.0}"),
        format!("pgbench {pg_stage:.0}"),
        ratio(p_stages, pg_stage),
    );
    if let Some((server, client, split)) = &split {
        for (measure, (o, p)) in [
            ("claim, insert path", split.insert),
            ("claim, skip path", split.skip),
            (
                "stage executions (prefetch, with the job, medians)",
                split.stages,
            ),
            (
                "stage executions vs the statements each in its own round trip",
                split.stages_sequential,
            ),
        ] {
            row(
                &format!("{measure}, the server on CPU {server}, the client (ours, pgbench) on CPU {client}"),
                format!("{o:.0}"),
                format!("pgbench {p:.0}"),
                ratio(o, p),
            );
        }
    }
    row(
        "stage executions/s (`PipelineWorker`, prefetch 0, one round) vs the statements with the job",
        format!("{p_stages_np:.0}"),
        format!("pgbench {pg_stage_job:.0}"),
        ratio(p_stages_np, pg_stage_job),
    );
    // Each peer: its numbers, or why it has none.
    let peer = |label: &str| -> Option<&String> {
        peer_out
            .iter()
            .find(|(l, _)| *l == label)
            .and_then(|(_, r)| r.as_ref().ok())
    };
    let failed = |label: &str| -> String {
        peer_out
            .iter()
            .find(|(l, _)| *l == label)
            .and_then(|(_, r)| r.as_ref().err())
            .map(|e| format!("{label}: failed ({})", error_summary(e)))
            .unwrap_or_default()
    };
    let peer_row = |rows: &mut Vec<Row>,
                    measure: &str,
                    ours_v: f64,
                    ours_s: String,
                    label: &str,
                    key: &str,
                    note: &dyn Fn(&str) -> String| {
        let (reference, r) = match peer(label).and_then(|j| number(j, key).map(|v| (j, v))) {
            Some((j, v)) => (format!("{label} {v:.0}{}", note(j)), ratio(ours_v, v)),
            None => (failed(label), String::new()),
        };
        rows.push(Row {
            measure: measure.to_owned(),
            ours: ours_s,
            reference,
            ratio: r,
        });
    };
    let none = |_: &str| String::new();
    peer_row(
        &mut rows,
        "queue drain, raw batched API, each at its fastest loop count (jobs/s)",
        q_drain,
        format!("{q_drain:.0} ({q_loops} loops)"),
        "pg-boss",
        "drain_per_s",
        &|j| format!(" ({} loops)", number(j, "drain_loops").unwrap_or(0.0)),
    );
    if let Some(q16) = number(&queue, "drain_per_s_loops_16") {
        peer_row(
            &mut rows,
            "queue drain, raw batched API, 16 loops each (jobs/s)",
            q16,
            format!("{q16:.0}"),
            "pg-boss",
            "drain_per_s_loops_16",
            &none,
        );
    }
    for (label, key) in [
        ("pg-boss", "worker_c16_per_s"),
        ("graphile-worker", "worker_c16_per_s"),
        ("graphile-worker", "worker_c16_batched_per_s"),
        ("awa", "worker_c16_per_s"),
    ] {
        let config = key.replace("_per_s", "_config");
        peer_row(
            &mut rows,
            "queue drain by a worker at concurrency 16, no-op handler (jobs/s)",
            q_worker,
            format!("{q_worker:.0} (QueueWorker)"),
            label,
            key,
            &|j| format!(" ({})", string(j, &config).unwrap_or_default()),
        );
    }
    for label in ["pg-boss", "graphile-worker", "awa"] {
        peer_row(
            &mut rows,
            "queue drain by a worker as users run it for throughput (ours: QueueWorker with prefetch, median of 3 runs; peers: fastest documented worker configuration, graphile-worker's a median of 3 runs, pg-boss's and awa's the best of their settings) (jobs/s)",
            q_worker_pf,
            format!("{q_worker_pf:.0} (QueueWorker, prefetch {q_prefetch})"),
            label,
            "fast_per_s",
            &|j| format!(" ({})", string(j, "fast_config").unwrap_or_default()),
        );
    }
    for label in ["pg-boss", "graphile-worker", "awa"] {
        peer_row(
            &mut rows,
            "queue drain, each at its fastest (ours: raw API; peers: fastest documented worker configuration) (jobs/s)",
            q_drain,
            format!("{q_drain:.0} ({q_loops} loops)"),
            label,
            "fast_per_s",
            &|j| format!(" ({})", string(j, "fast_config").unwrap_or_default()),
        );
    }
    for label in ["pg-boss", "graphile-worker", "awa"] {
        peer_row(
            &mut rows,
            "enqueue, refusing a duplicate key among live jobs (sends/s)",
            q_enq,
            format!("{q_enq:.0} ({q_distinct} jobs)"),
            label,
            "enqueue_per_s",
            &|j| {
                format!(
                    " ({} jobs)",
                    number(j, "distinct_jobs_created").unwrap_or(0.0)
                )
            },
        );
    }
    for label in ["pg-boss", "graphile-worker", "awa"] {
        let reference = match peer(label) {
            Some(j) => format!(
                "{label} {} / {}",
                number(j, "latency_ms_p50").unwrap_or(f64::NAN),
                number(j, "latency_ms_p99").unwrap_or(f64::NAN)
            ),
            None => failed(label),
        };
        rows.push(Row {
            measure: "pickup latency p50 / p99 (ms; ours: medians of 3 rounds)".into(),
            ours: format!("{q_p50} / {q_p99}"),
            reference,
            ratio: String::new(),
        });
    }
    rows.push(Row {
        measure:
            "pickup latency p50 / p99 (ms), the fetch's commit durable (`LeaseCommit::Durable`; medians of 3 rounds)"
                .into(),
        ours: format!("{q_durable_p50} / {q_durable_p99}"),
        reference: String::new(),
        ratio: String::new(),
    });
    rows.push(Row {
        measure: "worker peak RSS (MB)".into(),
        ours: format!("{p_rss}"),
        reference: String::new(),
        ratio: String::new(),
    });
    rows.push(Row {
        measure: "load average (1 min) before / after".into(),
        ours: format!("{load_before:.1} / {load_after:.1}"),
        reference: String::new(),
        ratio: String::new(),
    });

    let peers_json = peer_out
        .iter()
        .map(|(label, r)| match r {
            Ok(j) => format!("\"{label}\": {}", j.trim()),
            Err(e) => format!(
                "\"{label}\": {{\"error\": \"{}\"}}",
                error_summary(e).replace(['"', '\\'], "'")
            ),
        })
        .collect::<Vec<_>>()
        .join(", ");
    let json = format!(
        r#"    {{
      "machine": {{"cpus": {cpus}, "postgres_durable": {durable}, "clients": {concurrency}, "duration_s": {duration}, "load_before": {load_before}, "load_after": {load_after}}},
      "claim": {{"insert_per_s": {c_ins}, "skip_per_s": {c_skip}, "pgbench_insert_per_s": {pg_insert:.1}, "pgbench_skip_per_s": {pg_skip:.1}, "pgbench_mode": "prepared"}},
      "pipeline": {{"stages_per_s": {p_stages}, "batch": {batch}, "stages_per_s_no_prefetch": {p_stages_np}, "split_cpus": {split_json}, "pgbench_stages_per_s": {pg_stage:.1}, "pgbench_stages_with_job_per_s": {pg_stage_job:.1}, "pgbench_stages_with_job_sequential_per_s": {pg_stage_sequential:.1}, "worker_peak_rss_mb": {p_rss}}},
      "raw": {{"claim": {claim}, "queue": {queue}, "pipeline": {pipeline}, "pipeline_no_prefetch": {pipeline_no_prefetch}}},
      "peers": {{{peers_json}}}
    }}"#,
        cpus = std::thread::available_parallelism().map_or(0, |n| n.get()),
        claim = claim.trim(),
        queue = queue.trim(),
        pipeline = pipeline.trim(),
        pipeline_no_prefetch = pipeline_no_prefetch.trim(),
        split_json = match &split {
            Some((server, client, s)) => format!(
                "{{\"server_cpus\": \"{server}\", \"client_cpus\": \"{client}\", \"claim_insert_per_s\": {}, \"pgbench_claim_insert_per_s\": {:.1}, \"claim_skip_per_s\": {}, \"pgbench_claim_skip_per_s\": {:.1}, \"stages_per_s\": {}, \"pgbench_stages_with_job_per_s\": {:.1}, \"pgbench_stages_with_job_sequential_per_s\": {:.1}}}",
                s.insert.0, s.insert.1, s.skip.0, s.skip.1, s.stages.0, s.stages.1, s.stages_sequential.1
            ),
            None => "null".into(),
        },
    );
    Ok(Suite {
        durable,
        json,
        rows,
    })
}

/// `cargo xtask bench --only claims,stages,stages-split,drain`: the claim pair
/// and the stage pair (each `PAIR_ROUNDS` interleaved rounds against pgbench),
/// on shared CPUs, the stage pair with the server on one CPU and the clients on
/// the other (`stages-split`), and the queue scenario's drains (`drain`, ours
/// alone); their rows and medians only.
type ClaimPair<'a> = dyn Fn(Option<&str>) -> Result<([f64; 4], String)> + 'a;
type StagePair<'a> = dyn Fn(Option<&str>) -> Result<(f64, f64, f64, String)> + 'a;

fn quick_pairs(
    only: &str,
    durable: bool,
    url: &str,
    claim_pair: &ClaimPair<'_>,
    stage_pair: &StagePair<'_>,
    drain: &dyn Fn() -> Result<String>,
) -> Result<Suite> {
    let mut rows = Vec::new();
    let mut extra = Vec::new();
    let mut json = Vec::new();
    let mut row = |measure: &str, ours: f64, reference: f64| {
        rows.push(Row {
            measure: measure.to_owned(),
            ours: format!("{ours:.0}"),
            reference: format!("pgbench {reference:.0}"),
            ratio: ratio(ours, reference),
        })
    };
    for part in only.split(',') {
        match part {
            "claims" => {
                let ([ins, pg_ins, skip, pg_skip], _) = claim_pair(None)?;
                row("claim, insert path (claims/s; medians)", ins, pg_ins);
                row("claim, skip path (claims/s; medians)", skip, pg_skip);
                json.push(format!(
                    "\"claim\": {{\"insert_per_s\": {ins}, \"skip_per_s\": {skip}, \"pgbench_insert_per_s\": {pg_ins:.1}, \"pgbench_skip_per_s\": {pg_skip:.1}}}"
                ));
            }
            "stages" => {
                let (stages, pg, pg_sequential, _) = stage_pair(None)?;
                row(
                    "stage executions/s vs the statements with the job, pipelined (medians)",
                    stages,
                    pg,
                );
                row(
                    "the same vs each statement in a round trip of its own (medians)",
                    stages,
                    pg_sequential,
                );
                json.push(format!(
                    "\"pipeline\": {{\"stages_per_s\": {stages}, \"pgbench_stages_with_job_per_s\": {pg:.1}, \"pgbench_stages_with_job_sequential_per_s\": {pg_sequential:.1}}}"
                ));
            }
            "stages-split" => {
                let (server, client) =
                    split_cpus().context("--only stages-split needs 2 CPUs and taskset")?;
                let pinned = Pinned::server(url, &server, &format!("{server},{client}"))?;
                let measured = stage_pair(Some(client.as_str()));
                drop(pinned);
                let (stages, pg, pg_sequential, _) = measured?;
                row(
                    "split CPUs: stage executions/s vs the statements with the job, pipelined (medians)",
                    stages,
                    pg,
                );
                row(
                    "split CPUs: the same vs each statement in a round trip of its own (medians)",
                    stages,
                    pg_sequential,
                );
                json.push(format!(
                    "\"split\": {{\"server_cpus\": \"{server}\", \"client_cpus\": \"{client}\", \"stages_per_s\": {stages}, \"pgbench_stages_with_job_per_s\": {pg:.1}, \"pgbench_stages_with_job_sequential_per_s\": {pg_sequential:.1}}}"
                ));
            }
            "drain" => {
                let queue = drain()?;
                for key in [
                    "drain_per_s",
                    "worker_drain_per_s",
                    "worker_drain_prefetch_per_s",
                ] {
                    let v = number(&queue, key)
                        .with_context(|| format!("no number {key:?} in {queue}"))?;
                    extra.push(Row {
                        measure: format!("queue {key} (jobs/s, ours alone)"),
                        ours: format!("{v:.0}"),
                        reference: "-".to_owned(),
                        ratio: "-".to_owned(),
                    });
                }
                json.push(format!("\"queue\": {}", queue.trim()));
            }
            other => bail!("--only {other:?}: give claims, stages, stages-split or drain"),
        }
    }
    rows.append(&mut extra);
    Ok(Suite {
        durable,
        json: format!(
            "    {{\"postgres_durable\": {durable}, \"only\": \"{only}\", {}}}",
            json.join(", ")
        ),
        rows,
    })
}

/// Runs `cmd`; its stdout, or an error with its stderr.
/// A failed command's error in one line: its first line (the command and its exit
/// status) and, if it printed anything, the last line it printed (most often why).
fn error_summary(e: &str) -> String {
    let lines: Vec<&str> = e.lines().collect();
    let first = lines.first().copied().unwrap_or("");
    match lines.iter().skip(1).rev().find(|l| !l.trim().is_empty()) {
        Some(last) => format!("{first} {}", last.trim()),
        None => first.to_owned(),
    }
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("failed to run {:?}", cmd.get_program()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{:?} failed ({}):\n{stdout}\n{}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Our tools print the JSON object last.
    Ok(stdout)
}

pub(crate) fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| {
            args.iter()
                .find_map(|a| a.strip_prefix(&format!("{name}=")).map(str::to_owned))
        })
}

/// `args` without the flags with a value (and their values) that `extra` gives.
fn without_flags(args: &[String], extra: &[&str]) -> Vec<String> {
    let own: Vec<&str> = extra
        .windows(2)
        .filter(|w| w[0].starts_with("--") && !w[1].starts_with("--"))
        .map(|w| w[0])
        .collect();
    let mut kept = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let name = a.split('=').next().unwrap_or(a);
        if own.contains(&name) {
            if !a.contains('=') {
                it.next();
            }
        } else {
            kept.push(a.clone());
        }
    }
    kept
}

/// Ours against pgbench (per second) with the server and the clients on
/// separate CPUs.
struct Split {
    insert: (f64, f64),
    skip: (f64, f64),
    stages: (f64, f64),
    /// Ours, and pgbench with each statement in a round trip of its own.
    stages_sequential: (f64, f64),
}

/// `program`, on `cpus` (a taskset list) if given.
fn command_on(cpus: Option<&str>, program: &Path) -> Command {
    match cpus {
        Some(cpus) => {
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", cpus]).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// The CPUs this process may run on, split in two halves (server, client) as
/// taskset lists; `None` with fewer than two, or without taskset.
fn split_cpus() -> Option<(String, String)> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
        .trim();
    let mut cpus = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?),
            None => cpus.push(part.parse::<u32>().ok()?),
        }
    }
    let has_taskset = Command::new("taskset")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if cpus.len() < 2 || !has_taskset {
        return None;
    }
    let (server, client) = cpus.split_at(cpus.len() / 2);
    let join = |c: &[u32]| c.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    Some((join(server), join(client)))
}

/// The server's processes held to some CPUs (the postmaster, whose new backends
/// inherit it, and its running children) until dropped, which gives them back
/// `restore`.
struct Pinned {
    /// The postmaster first.
    pids: Vec<String>,
    restore: String,
}

impl Pinned {
    fn server(url: &str, cpus: &str, restore: &str) -> Result<Pinned> {
        let data_dir = psql(url, "SHOW data_directory")?;
        let pid_file = Path::new(data_dir.trim()).join("postmaster.pid");
        let postmaster = fs::read_to_string(&pid_file)
            .with_context(|| format!("read {}", pid_file.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        let children = output(Command::new("pgrep").args(["-P", &postmaster]))?;
        let pids: Vec<String> = std::iter::once(postmaster)
            .chain(children.split_whitespace().map(str::to_owned))
            .collect();
        let pinned = Pinned {
            pids,
            restore: restore.to_owned(),
        };
        pinned.set(cpus)?;
        Ok(pinned)
    }

    fn set(&self, cpus: &str) -> Result<()> {
        let taskset = |pid: &str| {
            let mut cmd = Command::new("taskset");
            cmd.args(["-a", "-p", "-c", cpus, pid]);
            cmd
        };
        let (postmaster, children) = self.pids.split_first().context("no postmaster pid")?;
        output(&mut taskset(postmaster))?;
        for pid in children {
            // A child may have ended since it was listed.
            let _ = taskset(pid).output();
        }
        Ok(())
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Err(e) = self.set(&self.restore) {
            eprintln!("xtask bench: could not give the server its CPUs back: {e:#}");
        }
    }
}

/// Rounds of the worker against the statements with the job, each mode.
const PAIR_ROUNDS: usize = 3;

/// The middle value (of an odd count; the upper middle of an even one).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// stage.sql's `-D` for the stage's statements alone.
const STAGE_ONLY: [(&str, &str); 3] = [("job", "0"), ("batch", "1"), ("k", "0")];

/// The stage worker's batch in `bench pipeline` (its flag, else the default
/// there), the jobs it leases per fetch, and so pgbench's `batch`.
fn pipeline_batch(args: &[String]) -> String {
    flag(args, "--pipeline-batch").unwrap_or_else(|| "32".into())
}

/// What stage.sql wrote: one fenced run and next job per transaction (beside
/// `seeded` jobs sent before), and each stage's audit entries (its kind is the
/// digit after the run's stage name's `s`: intake 2, extract 1, feasibility none,
/// calculate 1).
fn check_stage(
    check: &dyn Fn(&str, &str, &str, u64) -> Result<()>,
    n: u64,
    seeded: u64,
) -> Result<()> {
    for (what, sql, expected) in [
        (
            "stage executions fenced",
            "SELECT count(*) FROM stage_runs WHERE worker_id = 'pgbench' AND status = 'success'",
            n,
        ),
        (
            "audit entries beyond the stages' own",
            "SELECT (SELECT count(*) FROM audit_log) - coalesce(sum(CASE substr(stage, 2, 1) \
             WHEN '1' THEN 2 WHEN '2' THEN 1 WHEN '3' THEN 0 ELSE 1 END), 0) \
             FROM stage_runs WHERE worker_id = 'pgbench' AND status = 'success'",
            0,
        ),
        (
            "next jobs sent",
            "SELECT count(*) FROM jobs WHERE queue = 'feasibility'",
            n + seeded,
        ),
    ] {
        check("stage.sql", what, sql, expected)?;
    }
    Ok(())
}

/// The ready jobs stage.sql's job mode fetches: clients x batch x 4 in
/// `feasibility`, of the fixtures' tenant, so that every fetch fills its batch.
fn seed_stage_jobs(url: &str, clients: &str, batch: &str) -> Result<u64> {
    let n = clients.parse::<u64>().context("--concurrency")?
        * batch.parse::<u64>().context("--pipeline-batch")?.max(1)
        * 4;
    let sql = format!(
        "INSERT INTO jobs (id, queue, payload, tenant_id) \
         SELECT lpad(g::text, 26, '0'), 'feasibility', '{{}}'::jsonb, 'bench' \
           FROM generate_series(1, {n}) g; ANALYZE jobs"
    );
    psql(url, &sql)?;
    Ok(n)
}

/// The values `-D` gives the pgbench scripts: the binds that are the same in every
/// execution (see the scripts' headers; the input hash is the fixtures' input text's,
/// `cli::bench::INPUT`).
const PGBENCH_VARIABLES: [(&str, &str); 8] = [
    // The scripts' statements in the round trips the library takes
    // (`\startpipeline`); stage.sql's sequential run passes 0.
    ("pipeline", "1"),
    ("tenant", "bench"),
    ("worker", "pgbench"),
    ("idle_ms", "10000"),
    ("done_stage", "done"),
    ("next_queue", "feasibility"),
    ("queues", "{intake,extract,feasibility,calculate}"),
    (
        "input_hash",
        "63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042",
    ),
];

/// What psql prints for `sql` (unaligned, tuples only, stopping at the first
/// error).
pub(crate) fn psql(url: &str, sql: &str) -> Result<String> {
    output(
        Command::new("psql")
            .args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"])
            .arg(url)
            .arg("-c")
            .arg(sql),
    )
}

/// The number `sql` returns (one row, one column), read with psql.
fn psql_number(url: &str, sql: &str) -> Result<u64> {
    let out = psql(url, sql)?;
    out.trim()
        .parse()
        .with_context(|| format!("psql `{sql}` returned {out:?}"))
}

fn find_pgbench() -> Result<PathBuf> {
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("pgbench");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    let mut found: Vec<PathBuf> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin").join("pgbench"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found
        .pop()
        .context("pgbench not found on PATH or under /usr/lib/postgresql/*/bin")
}

/// The number after `"key":` in a flat JSON object.
fn number(json: &str, key: &str) -> Option<f64> {
    let rest = &json[json.find(&format!("\"{key}\":"))? + key.len() + 3..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

/// The string after `"key":"` in a flat JSON object (no escapes expected).
fn string(json: &str, key: &str) -> Option<String> {
    let rest = &json[json.find(&format!("\"{key}\":\""))? + key.len() + 4..];
    Some(rest[..rest.find('"')?].to_owned())
}

#[cfg(test)]
mod tests {
    use super::{error_summary, number, string, without_flags};

    #[test]
    fn a_failed_peer_is_summed_up_by_its_status_and_its_last_words() {
        let e = "\"awa\" failed (exit status: 1):\n{\"partial\":1}\n\nError: pool timed out\n\n";
        assert_eq!(
            error_summary(e),
            "\"awa\" failed (exit status: 1): Error: pool timed out"
        );
        assert_eq!(
            error_summary("\"x\" failed (signal: 9):\n\n"),
            "\"x\" failed (signal: 9):"
        );
    }

    #[test]
    fn a_flag_given_again_replaces_the_callers() {
        let args: Vec<String> = [
            "--pipeline-batch",
            "64",
            "--duration-s=2",
            "--pipeline-batch=8",
            "--json",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            without_flags(&args, &["--pipeline-batch", "0", "--setup-only"]),
            ["--duration-s=2", "--json"]
        );
        assert_eq!(without_flags(&args, &["--setup-only"]), args);
    }

    #[test]
    fn picks_numbers_and_strings_by_key() {
        let j = r#"{"a_per_s":12.5,"n":-3,"version":"10.4.2","x":[]}"#;
        assert_eq!(number(j, "a_per_s"), Some(12.5));
        assert_eq!(number(j, "n"), Some(-3.0));
        assert_eq!(number(j, "missing"), None);
        assert_eq!(string(j, "version").as_deref(), Some("10.4.2"));
    }
}
