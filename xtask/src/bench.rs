//! `cargo xtask bench`: our benchmarks and their references in one run, on one
//! server. Ours: `idemstage bench claim|queue|pipeline --json` (release). The
//! references: pgbench on the SQL the claim and a stage execution send
//! (bench/pgbench/), and pg-boss doing the queue tests (bench/peers/). Writes
//! `target/bench/report.json` and prints a markdown table.
//!
//! No JSON library here (xtask stays dependency-free): the inputs are flat objects
//! printed by our own tools, so numbers are picked out by key.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{cargo, project_root};

pub fn run(url: &str, args: &[String]) -> Result<i32> {
    let duration = flag(args, "--duration-s").unwrap_or_else(|| "10".into());
    let concurrency = flag(args, "--concurrency").unwrap_or_else(|| "16".into());
    let root = project_root();
    let status = cargo()
        .args([
            "build",
            "--release",
            "-p",
            "idemstage-cli",
            "--bin",
            "idemstage",
        ])
        .status()
        .context("cargo build")?;
    if !status.success() {
        bail!("release build failed");
    }
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin = target.join("release").join("idemstage");
    let ours = |scenario: &str, extra: &[&str]| -> Result<String> {
        let mut cmd = Command::new(&bin);
        cmd.args(["bench", scenario, "--json"])
            .args(extra)
            .args(args)
            .env("DATABASE_URL", url);
        eprintln!("xtask bench: idemstage bench {scenario} {}", args.join(" "));
        output(&mut cmd)
    };
    let pgbench = find_pgbench()?;
    let run_pgbench = |script: &str| -> Result<(f64, u64)> {
        let path = root.join("bench").join("pgbench").join(script);
        eprintln!("xtask bench: pgbench {script} (prepared), {concurrency} clients, {duration} s");
        let mut cmd = Command::new(&pgbench);
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

    // Claim: the references first, each from the same fixtures as our timed run.
    ours("claim", &["--setup-only"])?;
    let (pg_insert, n) = run_pgbench("claim_insert.sql")?;
    check(
        "claim_insert.sql",
        "runs it claimed",
        "SELECT count(*) FROM pipeline_runs WHERE worker_id = 'pgbench' AND status = 'running'",
        n,
    )?;
    ours("claim", &["--setup-only"])?;
    let (pg_skip, _) = run_pgbench("claim_skip.sql")?;
    check(
        "claim_skip.sql",
        "runs changed (a skip changes none)",
        "SELECT count(*) FROM pipeline_runs WHERE NOT (stage = 'done' AND status = 'success' AND attempts = 1)",
        0,
    )?;
    ours("claim", &["--setup-only"])?;
    let (pg_stage, n) = run_pgbench("stage.sql")?;
    for (what, sql) in [
        (
            "stage executions fenced",
            "SELECT count(*) FROM pipeline_runs WHERE worker_id = 'pgbench' AND status = 'success'",
        ),
        (
            "audit entries",
            "SELECT count(*) FROM audit_log WHERE action = 'anfrage.extracted'",
        ),
        (
            "next jobs sent",
            "SELECT count(*) FROM jobs WHERE queue = 'feasibility'",
        ),
    ] {
        check("stage.sql", what, sql, n)?;
    }
    let claim = ours("claim", &[])?;
    let queue = ours("queue", &[])?;
    let pipeline = ours("pipeline", &[])?;
    let pgboss = run_pgboss(&root, url, args)?;

    let num = |json: &str, key: &str| -> Result<f64> {
        number(json, key).with_context(|| format!("no number {key:?} in {json}"))
    };
    let c_ins = num(&claim, "insert_per_s")?;
    let c_skip = num(&claim, "skip_per_s")?;
    let q_enq = num(&queue, "enqueue_per_s")?;
    let q_distinct = num(&queue, "distinct_jobs_created")?;
    let q_drain = num(&queue, "drain_per_s")?;
    let q_loops = num(&queue, "drain_loops")?;
    let q_worker = num(&queue, "worker_drain_per_s")?;
    let q_p50 = num(&queue, "latency_ms_p50")?;
    let q_p99 = num(&queue, "latency_ms_p99")?;
    let b_enq = num(&pgboss, "enqueue_per_s")?;
    let b_distinct = num(&pgboss, "distinct_jobs_created")?;
    let b_drain = num(&pgboss, "drain_per_s")?;
    let b_loops = num(&pgboss, "drain_loops")?;
    let b_p50 = num(&pgboss, "latency_ms_p50")?;
    let b_p99 = num(&pgboss, "latency_ms_p99")?;
    let b_version = string(&pgboss, "version").unwrap_or_default();
    let p_stages = num(&pipeline, "stages_per_s")?;
    let p_rss = num(&pipeline, "worker_peak_rss_mb")?;
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            (a / b * 100.0).round() / 100.0
        } else {
            0.0
        }
    };
    let durable = env::var("IDEMSTAGE_PG_DURABLE").as_deref() == Ok("1");

    let report = format!(
        r#"{{
  "machine": {{"cpus": {cpus}, "postgres_durable": {durable}, "clients": {concurrency}, "duration_s": {duration}}},
  "claim": {{"insert_per_s": {c_ins}, "skip_per_s": {c_skip}, "pgbench_insert_per_s": {pg_insert:.1}, "pgbench_skip_per_s": {pg_skip:.1}, "insert_ratio": {r_ins}, "skip_ratio": {r_skip}}},
  "queue": {{"enqueue_per_s": {q_enq}, "distinct_jobs_created": {q_distinct}, "drain_per_s": {q_drain}, "drain_loops": {q_loops}, "worker_drain_per_s": {q_worker}, "latency_ms_p50": {q_p50}, "latency_ms_p99": {q_p99}, "enqueue_ratio_vs_pgboss": {r_enq}, "drain_ratio_vs_pgboss": {r_drain}}},
  "pgboss": {{"version": "{b_version}", "enqueue_policy": "short", "enqueue_per_s": {b_enq}, "distinct_jobs_created": {b_distinct}, "drain_per_s": {b_drain}, "drain_loops": {b_loops}, "latency_ms_p50": {b_p50}, "latency_ms_p99": {b_p99}}},
  "pipeline": {{"stages_per_s": {p_stages}, "pgbench_stages_per_s": {pg_stage:.1}, "ratio": {r_stage}, "worker_peak_rss_mb": {p_rss}}},
  "raw": {{"claim": {claim}, "queue": {queue}, "pipeline": {pipeline}, "pgboss": {pgboss}}}
}}
"#,
        cpus = std::thread::available_parallelism().map_or(0, |n| n.get()),
        r_ins = ratio(c_ins, pg_insert),
        r_skip = ratio(c_skip, pg_skip),
        r_enq = ratio(q_enq, b_enq),
        r_drain = ratio(q_drain, b_drain),
        r_stage = ratio(p_stages, pg_stage),
        claim = claim.trim(),
        queue = queue.trim(),
        pipeline = pipeline.trim(),
        pgboss = pgboss.trim(),
    );
    let dir = target.join("bench");
    fs::create_dir_all(&dir)?;
    let path = dir.join("report.json");
    fs::write(&path, &report)?;

    let check = |ok: bool| if ok { "met" } else { "MISSED" };
    println!("| measure | ours | reference | ratio | target |");
    println!("|---|---:|---:|---:|---|");
    println!(
        "| claim, insert path (claims/s) | {c_ins:.0} | pgbench {pg_insert:.0} | {:.2} | ≥ 0.85: {} |",
        ratio(c_ins, pg_insert),
        check(ratio(c_ins, pg_insert) >= 0.85)
    );
    println!(
        "| claim, skip path (claims/s) | {c_skip:.0} | pgbench {pg_skip:.0} | {:.2} | ≥ 0.85: {} |",
        ratio(c_skip, pg_skip),
        check(ratio(c_skip, pg_skip) >= 0.85)
    );
    println!(
        "| stage executions/s | {p_stages:.0} | pgbench {pg_stage:.0} | {:.2} | ≥ 0.7: {} |",
        ratio(p_stages, pg_stage),
        check(ratio(p_stages, pg_stage) >= 0.7)
    );
    println!(
        "| queue drain, each at its fastest loop count (jobs/s) | {q_drain:.0} ({q_loops} loops) | pg-boss {b_version} {b_drain:.0} ({b_loops} loops) | {:.2} | ≥ 2.5: {} |",
        ratio(q_drain, b_drain),
        check(ratio(q_drain, b_drain) >= 2.5)
    );
    if let (Some(q16), Some(b16)) = (
        number(&queue, "drain_per_s_loops_16"),
        number(&pgboss, "drain_per_s_loops_16"),
    ) {
        println!(
            "| queue drain, 16 loops each (jobs/s) | {q16:.0} | pg-boss {b16:.0} | {:.2} | |",
            ratio(q16, b16)
        );
    }
    println!(
        "| queue drain by a `QueueWorker`, concurrency 16, no-op handler (jobs/s) | {q_worker:.0} | | | |"
    );
    println!(
        "| enqueue, singleton keys (sends/s) | {q_enq:.0} ({q_distinct} jobs) | pg-boss {b_enq:.0} ({b_distinct} jobs) | {:.2} | ≥ 2: {} |",
        ratio(q_enq, b_enq),
        check(ratio(q_enq, b_enq) >= 2.0)
    );
    println!(
        "| pickup latency p50 / p99 (ms) | {q_p50} / {q_p99} | pg-boss {b_p50} / {b_p99} | | ≤ 1 / ≤ 3: {} |",
        check(q_p50 <= 1.0 && q_p99 <= 3.0)
    );
    println!(
        "| worker peak RSS (MB) | {p_rss} | | | ≤ 40: {} |",
        check(p_rss <= 40.0)
    );
    eprintln!("xtask bench: wrote {}", path.display());
    Ok(0)
}

/// pg-boss from bench/peers (`npm ci` first if node_modules is missing).
fn run_pgboss(root: &Path, url: &str, args: &[String]) -> Result<String> {
    let peers = root.join("bench").join("peers");
    if !peers.join("node_modules").exists() {
        eprintln!("xtask bench: npm ci in {}", peers.display());
        output(
            Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund"])
                .current_dir(&peers),
        )?;
    }
    let mut cmd = Command::new("node");
    cmd.arg("pgboss.mjs")
        .current_dir(&peers)
        .env("DATABASE_URL", url);
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
    eprintln!("xtask bench: pg-boss (node bench/peers/pgboss.mjs)");
    let out = output(&mut cmd)?;
    out.lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .map(str::to_owned)
        .context("pg-boss printed no JSON")
}

/// Runs `cmd`; its stdout, or an error with its stderr.
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

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| {
            args.iter()
                .find_map(|a| a.strip_prefix(&format!("{name}=")).map(str::to_owned))
        })
}

/// The values `-D` gives the pgbench scripts: the binds that are the same in every
/// execution (see the scripts' headers; the input hash is the fixtures' input text's,
/// `cli::bench::INPUT`).
const PGBENCH_VARIABLES: [(&str, &str); 6] = [
    ("tenant", "bench"),
    ("worker", "pgbench"),
    ("idle_ms", "10000"),
    ("done_stage", "done"),
    ("next_queue", "feasibility"),
    (
        "input_hash",
        "63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042",
    ),
];

/// The number `sql` returns (one row, one column), read with psql.
fn psql_number(url: &str, sql: &str) -> Result<u64> {
    let out = output(
        Command::new("psql")
            .args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"])
            .arg(url)
            .arg("-c")
            .arg(sql),
    )?;
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
    use super::{number, string};

    #[test]
    fn picks_numbers_and_strings_by_key() {
        let j = r#"{"a_per_s":12.5,"n":-3,"version":"10.4.2","x":[]}"#;
        assert_eq!(number(j, "a_per_s"), Some(12.5));
        assert_eq!(number(j, "n"), Some(-3.0));
        assert_eq!(number(j, "missing"), None);
        assert_eq!(string(j, "version").as_deref(), Some("10.4.2"));
    }
}
