//! Random faults for a while, then the invariants. In the default test run it lasts
//! `IDEMSTAGE_SOAK_SECS` (default 15) seconds; `cargo xtask soak --minutes N` runs
//! it in release for N minutes. Three `idemstage worker` processes (stages re-run
//! on new input) work a stream of items (each sent twice; some sent again later
//! with another text: a rerun; some set to another text and straight back, 1 → 2
//! → 1; some re-run on a blank input that intake refuses, so the rerun dies, and
//! later set back; some cancelled right after a rerun was sent) while an operator
//! retries dead stages, a job squats on a stage's key, a queued job is deleted
//! by hand, and, at random moments, a worker is SIGKILLed and
//! replaced, a worker is SIGSTOPped past its lease and continued, worker
//! connections are terminated mid-transaction, statements are cancelled, or a
//! session holds row locks on runs and items while the database's
//! `lock_timeout` is 100 ms. Then the faults stop and the database must show every
//! item final, nothing run twice, nothing foreign, every success computed from
//! its upstream's current success.

use std::collections::BTreeMap;
use std::time::Duration;

use diesel::sql_types::{BigInt, Integer};
use diesel_async::RunQueryDsl;
use idemstage::ops::{self, Actor};
use idemstage::pipeline::first_job;
use idemstage::{ids::input_hash_of, ids::ItemId, ids::TenantId};
use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::support::{assert_quiet_and_sound, count, send_rerun, signal, text, Workers};

/// Sends (under `Rerun`), retrying what the database refused for now (a lock
/// timeout against a row the lock holder holds, say).
async fn send_retrying(
    conn: &mut diesel_async::AsyncPgConnection,
    tenant: &TenantId,
    item: ItemId,
    text: &str,
) {
    for _ in 0..100 {
        match send_rerun(conn, tenant, item, text).await {
            Ok(_) => return,
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("send failed: {e}"),
        }
    }
    panic!("send kept failing");
}

/// A rerun that dies: the item's input replaced by a blank one, which
/// `start_in` refuses and intake fails on permanently, written around the library
/// (as another tool might) in the same steps as `start_in`: the input, the intake
/// job, a live job re-pointed at it.
async fn send_blank_rerun(
    conn: &mut diesel_async::AsyncPgConnection,
    tenant: &TenantId,
    item: ItemId,
) -> Result<(), idemstage::db::RepoError> {
    use diesel::sql_types::{Jsonb, Text};
    use diesel_async::AsyncConnection;
    let blank = " ";
    let hash = input_hash_of(blank.as_bytes());
    let job = first_job(
        &crate::support::pipeline(),
        tenant.clone(),
        item,
        hash.clone(),
    );
    conn.transaction::<_, idemstage::runs::TxError, _>(async |conn| {
        diesel::sql_query(
            "UPDATE items SET input_text = $1, input_sha256 = $2 WHERE tenant_id = $3 AND id = $4",
        )
        .bind::<Text, _>(blank)
        .bind::<Text, _>(&hash)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .execute(conn)
        .await
        .map_err(|e| idemstage::runs::TxError::Repo(idemstage::db::map_diesel_error(e)))?;
        idemstage::queue::send_in(conn, &job).await?;
        diesel::sql_query(
            "UPDATE jobs SET payload = $1, retry_count = 0
              WHERE id IN (SELECT job_id FROM job_keys
                            WHERE queue = $2 AND singleton_key = $3
                              AND idemstage_key_holder_live(job_id))",
        )
        .bind::<Jsonb, _>(&job.payload)
        .bind::<Text, _>(&job.queue)
        .bind::<Text, _>(job.options.singleton_key.as_deref().unwrap_or_default())
        .execute(conn)
        .await
        .map_err(|e| idemstage::runs::TxError::Repo(idemstage::db::map_diesel_error(e)))?;
        Ok(())
    })
    .await
    .map_err(idemstage::runs::TxError::into_repo)
}

fn soak_secs() -> u64 {
    std::env::var("IDEMSTAGE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_random_faults_lose_nothing_and_run_nothing_twice() {
    let secs = soak_secs();
    let db = idemstage_harness::example::db().await;
    // Every connection made from now on waits at most 100 ms for a row lock: the
    // lock holders below make the workers' statements time out (55P03).
    {
        use diesel_async::SimpleAsyncConnection;
        db.conn()
            .await
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" SET lock_timeout = '100ms'",
                db.name()
            ))
            .await
            .unwrap();
    }
    let mut workers = Workers::start(
        db.url(),
        3,
        &[
            "--stage-delay-ms",
            "200",
            "--crash-rate",
            "0.02",
            "--rerun-on-new-input",
            // A lost job's stage is sent again within seconds, not the default 30.
            "--reconcile-interval-s",
            "3",
        ],
    );
    let stop = CancellationToken::new();
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    // A steady stream of items, each sent twice, kept to a backlog the workers
    // can follow.
    let sender = {
        let (url, stop) = (db.url().to_owned(), stop.clone());
        tokio::spawn(async move {
            #[derive(diesel::QueryableByName)]
            struct Pid {
                #[diesel(sql_type = Integer)]
                pid: i32,
            }
            let mut conn = idemstage::db::connect(&url).await.unwrap();
            let mut keys = Vec::new();
            let pid: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
                .get_result(&mut conn)
                .await
                .unwrap();
            pid_tx.send(pid.pid).unwrap();
            let (mut sent, mut reruns) = (0usize, 0usize);
            let mut edges: BTreeMap<&str, u32> = BTreeMap::new();
            // Items whose rerun on a blank input died (or will), to set back later.
            let mut blanked: Vec<(TenantId, ItemId, usize)> = Vec::new();
            let operator = Actor::parse("soak-operator").unwrap();
            while !stop.is_cancelled() {
                let live = count(
                    &mut conn,
                    "SELECT 1 FROM job_states WHERE state IN ('created', 'retry', 'active')",
                )
                .await;
                if live < 40 {
                    for _ in 0..5 {
                        let tenant = TenantId::parse(&format!("t{}", sent % 4)).unwrap();
                        let item = ItemId::new();
                        for _ in 0..2 {
                            send_retrying(&mut conn, &tenant, item, &text(sent)).await;
                        }
                        keys.push((tenant, item, sent));
                        sent += 1;
                    }
                    // A rerun: an earlier item sent again with another text.
                    let pick = |keys: &Vec<(TenantId, ItemId, usize)>| {
                        keys[rand::rng().random_range(0..keys.len())].clone()
                    };
                    let (tenant, item, _) = pick(&keys);
                    send_retrying(&mut conn, &tenant, item, &text(10_000 + reruns)).await;
                    reruns += 1;
                    // An input set back: another text, then the first one again at once.
                    let (tenant, item, first) = pick(&keys);
                    send_retrying(&mut conn, &tenant, item, &text(20_000 + reruns)).await;
                    send_retrying(&mut conn, &tenant, item, &text(first)).await;
                    *edges.entry("inputs set back").or_default() += 1;
                    let edge = rand::rng().random_range(0..3);
                    match edge {
                        0 => {
                            // A rerun that dies; a later round sets it back.
                            let (tenant, item, first) = pick(&keys);
                            if send_blank_rerun(&mut conn, &tenant, item).await.is_ok() {
                                blanked.push((tenant, item, first));
                                *edges.entry("dead reruns").or_default() += 1;
                            }
                        }
                        1 => {
                            // A cancel right after a rerun was sent.
                            let (tenant, item, _) = pick(&keys);
                            send_retrying(&mut conn, &tenant, item, &text(30_000 + reruns)).await;
                            if ops::cancel(&mut conn, &tenant, &item, &operator)
                                .await
                                .is_ok()
                            {
                                *edges.entry("cancels during reruns").or_default() += 1;
                            }
                        }
                        _ if !blanked.is_empty() => {
                            let (tenant, item, first) = blanked.swap_remove(0);
                            send_retrying(&mut conn, &tenant, item, &text(first)).await;
                            *edges.entry("dead reruns set back").or_default() += 1;
                        }
                        _ => {}
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (sent, reruns, edges)
        })
    };
    // The sender's own connection is spared, so that it sends every item it counts.
    let sender_pid = pid_rx.await.unwrap();

    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut faults: BTreeMap<&str, u32> = BTreeMap::new();
    let mut conn = db.conn().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        let pause = rand::rng().random_range(300..1500);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let victim = rand::rng().random_range(0..workers.children.len());
        match rand::rng().random_range(0..7) {
            6 => {
                // A job squatting on a stage's singleton key with a payload that is
                // not that stage's (refused by the database by the baseline migration), and a
                // queued job deleted by hand (its stage found by the reconciler).
                let squat = diesel::sql_query(format!(
                    "INSERT INTO jobs (id, queue, payload, singleton_key, tenant_id)
                     SELECT '{}', 'extract', '{{\"squat\": true}}',
                            'extract:' || tenant_id || ':' || id, tenant_id
                       FROM items ORDER BY created_at DESC LIMIT 1",
                    ItemId::new()
                ))
                .execute(&mut conn)
                .await;
                *faults
                    .entry(if squat.is_ok() {
                        "squatters"
                    } else {
                        "squatters refused"
                    })
                    .or_default() += 1;
                let deleted = diesel::sql_query(
                    "DELETE FROM jobs WHERE id IN (
                         SELECT id FROM jobs WHERE state IN ('created', 'retry')
                          ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED)",
                )
                .execute(&mut conn)
                .await;
                if let Ok(n) = deleted {
                    *faults.entry("jobs deleted by hand").or_default() += n as u32;
                }
            }
            2 => {
                // The operator retries dead stages (a dead rerun among them, maybe
                // on an input set back since).
                #[derive(diesel::QueryableByName)]
                struct Dead {
                    #[diesel(sql_type = diesel::sql_types::Text)]
                    tenant_id: String,
                    #[diesel(sql_type = diesel::sql_types::Text)]
                    item_id: String,
                }
                let dead: Vec<Dead> = diesel::sql_query(
                    "SELECT DISTINCT tenant_id::text, item_id::text FROM stage_runs
                      WHERE status = 'dead' LIMIT 3",
                )
                .load(&mut conn)
                .await
                .unwrap_or_default();
                let planner = crate::support::pipeline();
                let actor = Actor::parse("soak-operator").unwrap();
                for d in dead {
                    let tenant = TenantId::parse(&d.tenant_id).unwrap();
                    let item = ItemId::parse(&d.item_id).unwrap();
                    if ops::retry(&mut conn, &tenant, &item, None, &actor, &planner)
                        .await
                        .is_ok()
                    {
                        *faults.entry("operator retries").or_default() += 1;
                    }
                }
            }
            0 => {
                workers.kill_and_replace(victim);
                *faults.entry("sigkill").or_default() += 1;
            }
            1 => {
                // Past its stage lease (1.5 s) and often past its job lease (3 s).
                signal(&workers.children[victim], "-STOP");
                let stopped = rand::rng().random_range(2000..5000);
                tokio::time::sleep(Duration::from_millis(stopped)).await;
                signal(&workers.children[victim], "-CONT");
                *faults.entry("sigstop").or_default() += 1;
            }
            3 => {
                // Row locks on a few runs and items, held past the workers'
                // lock_timeout; a lock the holder cannot get in time is skipped.
                let held = rand::rng().random_range(300..1200);
                let locked = diesel::sql_query(format!(
                    "WITH r AS (SELECT id FROM stage_runs ORDER BY random() LIMIT 3 FOR UPDATE SKIP LOCKED),
                          a AS (SELECT id FROM items ORDER BY random() LIMIT 2 FOR UPDATE SKIP LOCKED)
                     SELECT count(*) AS n, pg_sleep({held} / 1000.0) IS NULL AS slept
                       FROM (SELECT id FROM r UNION ALL SELECT id FROM a) x"
                ))
                .execute(&mut conn)
                .await;
                if locked.is_ok() {
                    *faults.entry("row locks held").or_default() += 1;
                }
            }
            4 => {
                let n: N = diesel::sql_query(format!(
                    "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) AS n FROM (
                         SELECT pid FROM pg_stat_activity
                          WHERE datname = current_database() AND pid <> pg_backend_pid()
                            AND pid <> {sender_pid} AND backend_type = 'client backend'
                            AND state = 'active'
                          ORDER BY random() LIMIT 3) p"
                ))
                .get_result(&mut conn)
                .await
                .unwrap();
                *faults.entry("cancelled statements").or_default() += n.n as u32;
            }
            _ => {
                let n: N = diesel::sql_query(format!(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS n FROM (
                         SELECT pid FROM pg_stat_activity
                          WHERE datname = current_database() AND pid <> pg_backend_pid()
                            AND pid <> {sender_pid} AND backend_type = 'client backend'
                            AND state IN ('idle in transaction', 'active')
                          ORDER BY random() LIMIT 3) p"
                ))
                .get_result(&mut conn)
                .await
                .unwrap();
                *faults.entry("terminated connections").or_default() += n.n as u32;
            }
        }
    }
    stop.cancel();
    let (sent, reruns, edges) = sender.await.unwrap();
    faults.extend(edges);
    let check = assert_quiet_and_sound(db.url(), 300).await;
    workers.assert_all_alive();
    workers.stop_all();
    eprintln!(
        "soak: {secs} s of faults {faults:?}; {sent} items sent twice each, {reruns} reruns with new input; {check:?}"
    );
    assert_eq!(check.stale_lineage, 0, "{check:?}");
    assert_eq!(check.items, sent as i64);
    assert!(sent > 0);
    assert!(!faults.is_empty(), "no fault was injected");
}
