//! End to end: two pipeline workers over two tenants' anfragen, every stage's
//! first attempt failing after its writes (ocr by error, translate by panic),
//! duplicate sends, then reruns with new input; at the end the database is
//! checked in plain SQL.

use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use idemstage::diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::{
    AnfrageId, CancellationToken, Counters, PipelineWorker, PipelineWorkerConfig, SendResult,
    TenantId,
};
use ocr_translate::schema::{ocr_pages, translations};
use ocr_translate::{pipeline_with, translate_text, Fault, Faults};

use crate::support::*;

const TENANTS: [&str; 2] = ["tenant-a", "tenant-b"];
const ANFRAGEN_PER_TENANT: usize = 4;

fn text(tenant: usize, i: usize, version: usize) -> String {
    // 1 to 4 pages, separated by blank lines and form feeds.
    (0..=(i + version) % 4)
        .map(|p| {
            format!(
                "{} anfrage {i} version {version}\nseite {p}",
                TENANTS[tenant]
            )
        })
        .collect::<Vec<_>>()
        .join(if i % 2 == 0 { "\n\n" } else { "\x0c" })
}

/// Every anfrage done on its stored input: ocr succeeded on it, translate on ocr's
/// current success, and no job is live.
const UNFINISHED_SQL: &str = "
SELECT a.id FROM anfragen a
 WHERE NOT EXISTS (
        SELECT 1 FROM pipeline_runs o
          JOIN pipeline_runs t ON t.tenant_id = o.tenant_id AND t.anfrage_id = o.anfrage_id
                              AND t.stage = 'translate'
         WHERE o.tenant_id = a.tenant_id AND o.anfrage_id = a.id AND o.stage = 'ocr'
           AND o.status = 'success' AND o.input_hash = a.input_sha256
           AND t.status = 'success' AND t.upstream_attempt = o.success_attempt)
UNION ALL
SELECT id FROM jobs WHERE state IN ('created', 'retry', 'active')";

/// The violations of the pipeline's invariants, in plain SQL: each query selects
/// the rows that break one, and must select none.
const VIOLATIONS: &[(&str, &str)] = &[
    (
        "a translation not written by the current successful attempt of its run",
        "SELECT t.* FROM translations t
           LEFT JOIN pipeline_runs r ON r.tenant_id = t.tenant_id AND r.id = t.run_id
          WHERE r.id IS NULL OR r.stage <> 'translate' OR r.anfrage_id <> t.anfrage_id
             OR r.status <> 'success' OR r.success_attempt IS DISTINCT FROM t.attempt",
    ),
    (
        "a translation not computed from the current ocr success (or not from the one \
         its run was claimed on)",
        "SELECT t.* FROM translations t
           JOIN pipeline_runs r ON r.tenant_id = t.tenant_id AND r.id = t.run_id
           LEFT JOIN pipeline_runs o ON o.tenant_id = t.tenant_id AND o.id = t.ocr_run_id
          WHERE o.id IS NULL OR o.stage <> 'ocr' OR o.anfrage_id <> t.anfrage_id
             OR o.status <> 'success' OR o.success_attempt IS DISTINCT FROM t.ocr_attempt
             OR r.upstream_stage IS DISTINCT FROM 'ocr'
             OR r.upstream_attempt IS DISTINCT FROM t.ocr_attempt",
    ),
    (
        "an ocr page not written by the current successful attempt of its run, or not \
         on the anfrage's stored input",
        "SELECT p.* FROM ocr_pages p
           LEFT JOIN pipeline_runs r ON r.tenant_id = p.tenant_id AND r.id = p.run_id
           LEFT JOIN anfragen a ON a.tenant_id = p.tenant_id AND a.id = p.anfrage_id
          WHERE r.id IS NULL OR r.stage <> 'ocr' OR r.anfrage_id <> p.anfrage_id
             OR r.status <> 'success' OR r.success_attempt IS DISTINCT FROM p.attempt
             OR r.input_hash IS DISTINCT FROM a.input_sha256",
    ),
    (
        "a page without its translation, or a translation without its page",
        "SELECT * FROM ocr_pages p FULL JOIN translations t USING (tenant_id, anfrage_id, page)
          WHERE p.id IS NULL OR t.run_id IS NULL",
    ),
    (
        "a successful stage without its audit entry of the same attempt",
        "SELECT r.* FROM pipeline_runs r
          WHERE r.status = 'success' AND NOT EXISTS (
                SELECT 1 FROM audit_log l
                 WHERE l.run_id = r.id AND l.attempt = r.success_attempt
                   AND l.action = r.stage || '.pages')",
    ),
    (
        "an audit entry of an attempt that did not succeed",
        "SELECT l.* FROM audit_log l WHERE l.run_id IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM pipeline_run_attempts a
                 WHERE a.run_id = l.run_id AND a.attempt = l.attempt AND a.outcome = 'success')",
    ),
    (
        "a double execution: two successes of a run on the same input and upstream",
        "SELECT * FROM (
            SELECT input_hash, upstream_attempt,
                   lag(input_hash) OVER w AS prev_hash,
                   lag(upstream_attempt) OVER w AS prev_upstream,
                   row_number() OVER w AS n
              FROM pipeline_run_attempts WHERE outcome = 'success'
            WINDOW w AS (PARTITION BY run_id ORDER BY attempt)) s
          WHERE n > 1 AND prev_hash = input_hash
            AND prev_upstream IS NOT DISTINCT FROM upstream_attempt",
    ),
    (
        "a stage that is not final",
        "SELECT * FROM pipeline_runs WHERE status <> 'success'",
    ),
];

async fn violation_counts(c: &mut AsyncPgConnection) -> Vec<i64> {
    let mut counts = Vec::new();
    for (_, sql) in VIOLATIONS {
        counts.push(count(c, sql).await);
    }
    counts
}

fn worker(
    f: &Fixture,
    counters: &Arc<Counters>,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let mut config = PipelineWorkerConfig::default().with_concurrency(4);
    config.queue.poll_interval = Duration::from_millis(200);
    config.queue.maintenance_interval = Duration::from_millis(1000);
    let faults = Faults {
        ocr: Some(Fault::error().through_attempt(1)),
        translate: Some(Fault::panic().through_attempt(1)),
    };
    let worker = PipelineWorker::new(
        f.pool.clone(),
        f.db.url(),
        pipeline_with(faults),
        config,
        counters.clone(),
    )
    .unwrap();
    let stop = CancellationToken::new();
    let handle = tokio::spawn({
        let stop = stop.clone();
        async move {
            worker.run(stop).await;
        }
    });
    (stop, handle)
}

async fn wait_until_done(conn: &mut AsyncPgConnection, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let open = count(conn, UNFINISHED_SQL).await;
        if open == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {open} anfragen or jobs still open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_over_two_tenants_leave_only_current_lineage() {
    let mut f = fixture().await;
    let pipeline = pipeline_with(Faults::default());
    let mut anfragen: Vec<(TenantId, AnfrageId, usize)> = Vec::new();
    for (t, slug) in TENANTS.iter().enumerate() {
        for i in 0..ANFRAGEN_PER_TENANT {
            anfragen.push((tenant(slug), AnfrageId::new(), t * 100 + i));
        }
    }
    let text_of = |n: usize, version: usize| text(n / 100, n % 100, version);
    // Each anfrage sent twice: the second send is a duplicate at the queue.
    for (tenant, anfrage, n) in &anfragen {
        for send in 0..2 {
            let started = idemstage::start(&f.pool, &pipeline, tenant, anfrage, &text_of(*n, 0))
                .await
                .unwrap();
            assert_eq!(
                matches!(started.sent, SendResult::Duplicate),
                send == 1,
                "{started:?}"
            );
        }
    }

    let counters = Arc::new(Counters::tracking_successes());
    let workers = [worker(&f, &counters), worker(&f, &counters)];
    wait_until_done(&mut f.conn, "first inputs").await;
    assert_eq!(counters.double_successes(), 0, "a stage succeeded twice");

    // New input for one anfrage of each tenant: ocr re-runs, translate after it.
    let rerun: Vec<_> = anfragen
        .iter()
        .filter(|(_, _, n)| n % 100 == 1)
        .cloned()
        .collect();
    for (tenant, anfrage, n) in &rerun {
        let started = idemstage::start(&f.pool, &pipeline, tenant, anfrage, &text_of(*n, 1))
            .await
            .unwrap();
        assert!(
            matches!(
                started.registered,
                idemstage::RegisterOutcome::Replaced { .. }
            ),
            "{started:?}"
        );
    }
    wait_until_done(&mut f.conn, "new inputs").await;
    for (stop, handle) in workers {
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(60), handle)
            .await
            .expect("worker stops")
            .unwrap();
    }

    let c = &mut f.conn;
    for (what, sql) in VIOLATIONS {
        assert_eq!(count(c, sql).await, 0, "{what}:\n{sql}");
    }
    // The reruns' stages succeeded a second time (on new input), no others.
    assert_eq!(counters.double_successes(), 2 * rerun.len() as u64);
    // Every stage's first attempt failed after its writes, and was retried.
    let stages = 2 * anfragen.len() as i64;
    assert_eq!(
        count(
            c,
            "SELECT 1 FROM pipeline_run_attempts WHERE outcome = 'failed'"
        )
        .await,
        stages
    );
    assert_eq!(
        count(c, "SELECT 1 FROM pipeline_runs WHERE status = 'success'").await,
        stages
    );
    // The pages are those of each anfrage's current text, and each translation
    // is its page translated.
    for (tenant, anfrage, n) in &anfragen {
        let version = usize::from(rerun.iter().any(|(_, a, _)| a == anfrage));
        let expected = ocr_translate::split_pages(&text_of(*n, version));
        let rows: Vec<(i32, String, String)> = ocr_pages::table
            .inner_join(
                translations::table.on(translations::tenant_id
                    .eq(ocr_pages::tenant_id)
                    .and(translations::anfrage_id.eq(ocr_pages::anfrage_id))
                    .and(translations::page.eq(ocr_pages::page))),
            )
            .filter(ocr_pages::tenant_id.eq(tenant.as_str()))
            .filter(ocr_pages::anfrage_id.eq(anfrage.to_string()))
            .order(ocr_pages::page)
            .select((ocr_pages::page, ocr_pages::text, translations::text))
            .load(c)
            .await
            .unwrap();
        assert_eq!(rows.len(), expected.len(), "{tenant} {anfrage}");
        for ((page, text, translated), want) in rows.iter().zip(&expected) {
            assert_eq!(text, want, "{tenant} {anfrage} page {page}");
            assert_eq!(translated, &translate_text(text));
        }
    }

    // The checks are not vacuous: a translation that claims another attempt, and
    // a page whose translation is gone, are each caught.
    let (tenant, anfrage) = (anfragen[0].0.as_str(), anfragen[0].1.to_string());
    let one = translations::table
        .filter(translations::tenant_id.eq(tenant))
        .filter(translations::anfrage_id.eq(&anfrage))
        .filter(translations::page.eq(1));
    diesel::update(one)
        .set(translations::attempt.eq(translations::attempt + 1))
        .execute(c)
        .await
        .unwrap();
    assert_eq!(violation_counts(c).await[..4], [1, 0, 0, 0]);
    diesel::delete(one).execute(c).await.unwrap();
    assert_eq!(violation_counts(c).await[..4], [0, 0, 0, 1]);
}
