//! `idemstage bench fairness`, the noisy neighbour: tenant A has a backlog of
//! `--jobs` ready jobs, nine quiet tenants each send one job every 50 ms for
//! `--quiet-s` seconds, and a `QueueWorker` at `--concurrency` works them with
//! handlers that take 2 ms. Run twice on the same server: with the jobs' tenants
//! (fair fetch) and with no tenant on any job, which the same fetch serves
//! oldest-first (FIFO). Reported per mode: the quiet tenants' pickup latency
//! (send returned to handler start; p50, p99) while A still had a backlog and
//! over the whole run, and A's throughput while its backlog lasted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use idemstage::queue::JobToSend;
use idemstage::queue::{self, LeaseCommit};
use idemstage::{ids::TenantId, queue::SendOptions, queue::SendResult};
use idemstage::{worker::handler_fn, worker::HandlerError};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::bench::{bench_worker, insert_backlog, quantile, round1, round3, Args};

const QUEUE: &str = "fair";
const QUIET_TENANTS: usize = 9;
const QUIET_GAP: Duration = Duration::from_millis(50);
const HANDLER_TIME: Duration = Duration::from_millis(2);

pub async fn fairness(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let fair = run_mode(url, args, true).await?;
    let fifo = run_mode(url, args, false).await?;
    let ratio = match (fair["noisy_per_s"].as_f64(), fifo["noisy_per_s"].as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => round3(a / b),
        _ => f64::NAN,
    };
    Ok(json!({
        "scenario": "fairness",
        "noisy_jobs": args.jobs,
        "quiet_tenants": QUIET_TENANTS,
        "quiet_gap_ms": QUIET_GAP.as_millis() as u64,
        "quiet_s": args.quiet_s,
        "handler_ms": HANDLER_TIME.as_millis() as u64,
        "concurrency": args.concurrency,
        "prefetch": args.fairness_prefetch,
        "fair": fair,
        "fifo": fifo,
        "noisy_throughput_fair_vs_fifo": ratio,
    }))
}

#[derive(Default)]
struct Seen {
    /// Handler start per quiet job (by its payload number).
    quiet_started: HashMap<u64, Instant>,
    noisy_done: u64,
    noisy_last: Option<Instant>,
}

async fn run_mode(url: &str, args: &Args, fair: bool) -> anyhow::Result<serde_json::Value> {
    let mut conn = idemstage::db::connect(url).await?;
    let tenant = |slug: &str| fair.then(|| TenantId::parse(slug).expect("a valid slug"));
    insert_backlog(
        &mut conn,
        QUEUE,
        tenant("noisy").as_ref(),
        args.jobs,
        |_| json!({ "noisy": true }),
    )
    .await?;

    let seen: Arc<Mutex<Seen>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        handler_fn(move |_job, payload: serde_json::Value| {
            let seen = seen.clone();
            async move {
                let now = Instant::now();
                if let Some(i) = payload["quiet"].as_u64() {
                    seen.lock().unwrap().quiet_started.insert(i, now);
                }
                tokio::time::sleep(HANDLER_TIME).await;
                if payload["noisy"].as_bool() == Some(true) {
                    let mut s = seen.lock().unwrap();
                    s.noisy_done += 1;
                    s.noisy_last = Some(Instant::now());
                }
                Ok::<(), HandlerError>(())
            }
        })
    };
    let worker = bench_worker(
        url,
        args,
        QUEUE,
        args.fairness_prefetch,
        LeaseCommit::default(),
        handler,
    )
    .await?;
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(worker.run(shutdown.clone()));

    // Nine quiet senders, one connection each.
    let mut senders = tokio::task::JoinSet::new();
    let rounds = (args.quiet_s * 1000.0 / QUIET_GAP.as_millis() as f64).ceil() as u64;
    for q in 0..QUIET_TENANTS as u64 {
        let mut conn = idemstage::db::connect(url).await?;
        let tenant = tenant(&format!("quiet-{q}"));
        senders.spawn(async move {
            let mut sent = Vec::new();
            let mut tick = tokio::time::interval(QUIET_GAP);
            for r in 0..rounds {
                tick.tick().await;
                let i = r * QUIET_TENANTS as u64 + q;
                let job = JobToSend {
                    queue: QUEUE.into(),
                    tenant: tenant.clone(),
                    payload: json!({ "quiet": i }),
                    options: SendOptions::default(),
                };
                match queue::send_in(&mut conn, &job).await? {
                    SendResult::Sent(_) => sent.push((i, Instant::now())),
                    SendResult::Duplicate => anyhow::bail!("a job without a key was refused"),
                }
            }
            anyhow::Ok(sent)
        });
    }
    let mut sent: Vec<(u64, Instant)> = Vec::new();
    while let Some(done) = senders.join_next().await {
        sent.extend(done.context("quiet sender")??);
    }
    // Polled on the worker's own record: every quiet job started, A drained.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (quiet, noisy) = {
            let s = seen.lock().unwrap();
            (s.quiet_started.len(), s.noisy_done)
        };
        if (quiet >= sent.len() && noisy >= args.jobs) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    running.await.context("fairness worker")?;

    let s = seen.lock().unwrap();
    let noisy_end = s.noisy_last.unwrap_or(started);
    let mut during = Vec::new();
    let mut all = Vec::new();
    for (i, at) in &sent {
        if let Some(start) = s.quiet_started.get(i) {
            let ms = start.saturating_duration_since(*at).as_secs_f64() * 1000.0;
            all.push(ms);
            if *at < noisy_end {
                during.push(ms);
            }
        }
    }
    all.sort_by(f64::total_cmp);
    during.sort_by(f64::total_cmp);
    let noisy_s = noisy_end.duration_since(started).as_secs_f64();
    Ok(json!({
        "mode": if fair { "fair" } else { "fifo" },
        "quiet_sent": sent.len(),
        "quiet_started": all.len(),
        "quiet_during_backlog": during.len(),
        "quiet_p50_ms_during_backlog": round3(quantile(&during, 0.50)),
        "quiet_p99_ms_during_backlog": round3(quantile(&during, 0.99)),
        "quiet_p50_ms": round3(quantile(&all, 0.50)),
        "quiet_p99_ms": round3(quantile(&all, 0.99)),
        "noisy_done": s.noisy_done,
        "noisy_backlog_s": round3(noisy_s),
        "noisy_per_s": round1(s.noisy_done as f64 / noisy_s.max(1e-9)),
    }))
}
