//! `idemstage worker --metrics-listen`: a worker process serves Prometheus
//! metrics, and what it counts is what the database holds afterwards. (Its own
//! process: the metrics recorder is process-wide.)

use std::collections::BTreeMap;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use idemstage::ops::Actor;
use idemstage::queue::{self, Scope};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{assert_quiet_and_sound, count, enqueue, signal, wait_exit, STAGE_LEASE_MS};

const STAGES: [&str; 4] = ["intake", "extract", "feasibility", "calculate"];

/// One `idemstage worker --metrics-listen 127.0.0.1:0`, its metrics address (read
/// from its stderr) and every line it wrote there; killed when dropped.
struct MetricsWorker {
    child: Child,
    addr: SocketAddr,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl MetricsWorker {
    fn spawn(url: &str, extra: &[&str]) -> MetricsWorker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemstage"))
            .args([
                "worker",
                "--concurrency",
                "4",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            .args(["--stage-lease-ms", &STAGE_LEASE_MS.to_string()])
            // Long job leases: no job may come back through maintenance while this
            // worker holds it (that would be a fetch this worker did not count).
            .args(["--job-lease-ms", "20000"])
            .args(extra)
            .env("DATABASE_URL", idemstage_testkit::worker_url(url))
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start idemstage worker");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        {
            let lines = stderr.clone();
            let pipe = child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    if let Some(rest) = line.split("metrics on http://").nth(1) {
                        let addr = rest.trim_end_matches("/metrics").parse::<SocketAddr>();
                        let _ = tx.send(addr.expect("a socket address"));
                    }
                    lines.lock().unwrap().push(line);
                }
            });
        }
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the worker printed no metrics address");
        MetricsWorker {
            child,
            addr,
            stderr,
        }
    }
}

impl Drop for MetricsWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One sample of the text exposition: metric name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// `GET /metrics` with a plain HTTP/1.1 request; the samples of a 200 response.
async fn scrape(addr: SocketAddr) -> Vec<Sample> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain"),
        "{head}"
    );
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(parse_sample)
        .collect()
}

/// `name{a="x",b="y"} 12` (label values here never hold quotes or commas).
fn parse_sample(line: &str) -> Sample {
    let (series, value) = line.rsplit_once(' ').expect("name and value");
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (
            name,
            rest.trim_end_matches('}')
                .split(',')
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once('=').expect("label=value");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect(),
        ),
        None => (series, BTreeMap::new()),
    };
    Sample {
        name: name.to_owned(),
        labels,
        value: value.parse().unwrap_or_else(|_| panic!("value of {line}")),
    }
}

/// The sum of the samples of `name` whose labels include `labels`.
fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> i64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum::<f64>() as i64
}

/// The value of a gauge of `name` with exactly these `labels`, if present.
fn gauge(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && s.labels.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// The counters the test compares, from the metrics and from the database, per
/// stage (queue).
async fn compare(
    conn: &mut diesel_async::AsyncPgConnection,
    samples: &[Sample],
) -> Vec<(String, i64, i64)> {
    let mut rows = Vec::new();
    for stage in STAGES {
        let q = [("queue", stage)];
        let db = [
            (
                "success outcomes = success runs",
                sum(
                    samples,
                    "idemstage_stage_outcomes_total",
                    &[("stage", stage), ("outcome", "success")],
                ),
                format!("SELECT 1 FROM stage_runs WHERE stage = '{stage}' AND status = 'success'"),
            ),
            (
                "success durations = success runs",
                sum(
                    samples,
                    "idemstage_stage_duration_seconds_count",
                    &[("stage", stage), ("outcome", "success")],
                ),
                format!("SELECT 1 FROM stage_runs WHERE stage = '{stage}' AND status = 'success'"),
            ),
            (
                "dead outcomes = dead runs",
                sum(
                    samples,
                    "idemstage_stage_outcomes_total",
                    &[("stage", stage), ("outcome", "dead")],
                ),
                format!("SELECT 1 FROM stage_runs WHERE stage = '{stage}' AND status = 'dead'"),
            ),
            (
                "jobs completed = completed jobs",
                sum(samples, "idemstage_jobs_completed_total", &q),
                format!("SELECT 1 FROM job_states WHERE queue = '{stage}' AND state = 'completed'"),
            ),
            (
                "jobs failed = failed jobs",
                sum(samples, "idemstage_jobs_failed_total", &q),
                format!("SELECT 1 FROM job_states WHERE queue = '{stage}' AND state = 'failed'"),
            ),
            (
                // Every fetch increments a job's attempt; this worker was the only one.
                "jobs fetched = sum of attempts",
                sum(samples, "idemstage_jobs_fetched_total", &q),
                format!(
                    "SELECT generate_series(1, attempt) FROM job_states WHERE queue = '{stage}'"
                ),
            ),
            (
                "jobs retried = sum of retry counts",
                sum(samples, "idemstage_jobs_retried_total", &q),
                format!("SELECT generate_series(1, retry_count) FROM jobs WHERE queue = '{stage}'"),
            ),
        ];
        for (what, metric, sql) in db {
            rows.push((format!("{stage}: {what}"), metric, count(conn, &sql).await));
        }
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serves_prometheus_metrics_that_match_the_database() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    // Extract's jobs pile up while it is paused: the queue gauges must show them.
    let actor = Actor::parse("metrics test").unwrap();
    queue::pause(&mut conn, "extract", &Scope::Queue, &actor)
        .await
        .unwrap();
    enqueue(db.url(), 20).await;
    let mut w = MetricsWorker::spawn(
        db.url(),
        // Failures (retried) show in the outcomes and the spans' log lines; stages
        // that outlast a heartbeat renew their leases.
        &["--crash-rate", "0.2", "--stage-delay-ms", "1200"],
    );

    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let intake_final =
        "SELECT 1 FROM stage_runs WHERE stage = 'intake' AND status IN ('success', 'dead')";
    while count(&mut conn, intake_final).await < 20 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "intake did not finish"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waiting = count(
        &mut conn,
        "SELECT 1 FROM job_states WHERE queue = 'extract' AND state IN ('created', 'retry') AND start_after <= now()",
    )
    .await;
    assert!(waiting > 0);
    // The sampler (every second) catches up with the database.
    loop {
        let samples = scrape(w.addr).await;
        let ready = gauge(
            &samples,
            "idemstage_queue_depth",
            &[("queue", "extract"), ("state", "ready")],
        );
        let age = gauge(
            &samples,
            "idemstage_queue_oldest_ready_age_seconds",
            &[("queue", "extract")],
        );
        if ready == Some(waiting as f64) && age.is_some_and(|a| a > 0.0) {
            assert_eq!(
                gauge(
                    &samples,
                    "idemstage_queue_depth",
                    &[("queue", "extract"), ("state", "active")]
                ),
                Some(0.0),
                "a paused queue has no active job"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "queue gauges never showed {waiting} ready extract jobs: ready {ready:?}, age {age:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    queue::resume(&mut conn, "extract", &Scope::Queue, &actor)
        .await
        .unwrap();
    let check = assert_quiet_and_sound(db.url(), 180).await;
    assert_eq!(check.items, 20);

    // The database is final; the worker counts each event just after its commit,
    // so poll until both agree (or show the difference at the deadline).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let samples = loop {
        let samples = scrape(w.addr).await;
        let rows = compare(&mut conn, &samples).await;
        if rows.iter().all(|(_, metric, db)| metric == db) {
            break samples;
        }
        if tokio::time::Instant::now() >= deadline {
            let differ: Vec<_> = rows.iter().filter(|(_, m, d)| m != d).collect();
            panic!("metrics and database differ (what, metric, database): {differ:#?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let success: i64 = sum(
        &samples,
        "idemstage_stage_outcomes_total",
        &[("outcome", "success")],
    );
    assert_eq!(success, check.stages_succeeded);
    assert!(success > 0);
    assert!(
        sum(
            &samples,
            "idemstage_stage_outcomes_total",
            &[("outcome", "failed")]
        ) > 0,
        "a crash rate of 0.2 over {success} stages failed none"
    );
    assert!(
        sum(
            &samples,
            "idemstage_stage_lease_renewals_total",
            &[("outcome", "renewed")]
        ) > 0,
        "no stage lease was renewed"
    );
    assert_eq!(
        sum(
            &samples,
            "idemstage_stage_lease_renewals_total",
            &[("outcome", "lost")]
        ),
        0
    );
    // Every stage's queue, never a tenant or an item, among the labels.
    for s in &samples {
        assert!(
            !s.labels.contains_key("tenant") && !s.labels.contains_key("item"),
            "{s:?}"
        );
    }
    // Once quiet, the gauges come back to zero.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let samples = scrape(w.addr).await;
        let live: f64 = STAGES
            .iter()
            .flat_map(|q| ["ready", "delayed", "active"].map(|st| (q, st)))
            .map(|(q, st)| {
                gauge(
                    &samples,
                    "idemstage_queue_depth",
                    &[("queue", q), ("state", st)],
                )
                .unwrap_or(-1.0)
            })
            .sum();
        if live == 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "queue gauges stayed at {live}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    signal(&w.child, "-TERM");
    assert!(wait_exit(&mut w.child, 60).success());
    // The log lines of a failed attempt carry the execution's span: tenant,
    // item, stage and attempt, inside the job's.
    let lines = w.stderr.lock().unwrap();
    let failed = lines
        .iter()
        .find(|l| l.contains("stage attempt failed") || l.contains("stage body panicked"))
        .unwrap_or_else(|| panic!("no failed attempt logged: {lines:#?}"));
    for field in [
        "job{job=",
        "queue=",
        "stage{tenant=t",
        "item=",
        "stage=",
        "attempt=",
    ] {
        assert!(failed.contains(field), "{field} missing in {failed}");
    }
}
