//! End to end: two pipeline workers over two tenants' items, every stage's
//! first attempt failing after its writes (ocr by error, translate by panic),
//! duplicate sends, then reruns with new input; at the end the database is
//! checked in plain SQL.

use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use idemstage::diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::{
    ids::ItemId, ids::TenantId, queue::SendResult, worker::CancellationToken, worker::Counters,
    worker::PipelineWorker, worker::PipelineWorkerConfig,
};
use ocr_translate::schema::{ocr_pages, translations};
use ocr_translate::{pipeline_with, translate_text, Fault, Faults};

use crate::support::*;

const TENANTS: [&str; 2] = ["tenant-a", "tenant-b"];
const ITEMS_PER_TENANT: usize = 4;

fn text(tenant: usize, i: usize, version: usize) -> String {
    // 1 to 4 pages, separated by blank lines and form feeds.
    (0..=(i + version) % 4)
        .map(|p| format!("{} item {i} version {version}\nseite {p}", TENANTS[tenant]))
        .collect::<Vec<_>>()
        .join(if i % 2 == 0 { "\n\n" } else { "\x0c" })
}

/// Every item done on its stored input: ocr succeeded on it, translate on ocr's
/// current success, and no job is live.
const UNFINISHED_SQL: &str = "
SELECT a.id FROM items a
 WHERE NOT EXISTS (
        SELECT 1 FROM stage_runs o
          JOIN stage_runs t ON t.tenant_id = o.tenant_id AND t.item_id = o.item_id
                              AND t.stage = 'translate'
         WHERE o.tenant_id = a.tenant_id AND o.item_id = a.id AND o.stage = 'ocr'
           AND o.status = 'success' AND o.input_hash = a.input_sha256
           AND t.status = 'success' AND t.upstream_attempt = o.success_attempt)
UNION ALL
SELECT id FROM job_states WHERE state IN ('created', 'retry', 'active')";

/// The violations of the pipeline's invariants, in plain SQL: each query selects
/// the rows that break one, and must select none.
const VIOLATIONS: &[(&str, &str)] = &[
    (
        "an ocr page that is not in the output of ocr's current success, or an ocr \
         success not on the item's stored input",
        "SELECT p.* FROM ocr_pages p
           LEFT JOIN stage_runs r ON r.tenant_id = p.tenant_id AND r.item_id = p.item_id
                                    AND r.stage = 'ocr'
           LEFT JOIN items a ON a.tenant_id = p.tenant_id AND a.id = p.item_id
          WHERE r.id IS NULL OR r.status <> 'success'
             OR r.output ->> (p.page - 1) IS DISTINCT FROM p.text
             OR jsonb_array_length(r.output) <> (
                    SELECT count(*) FROM ocr_pages q
                     WHERE q.tenant_id = p.tenant_id AND q.item_id = p.item_id)
             OR r.input_hash IS DISTINCT FROM a.input_sha256",
    ),
    (
        "a translate success not computed from ocr's current success (its bound \
         upstream attempt), or not of all of its pages",
        "SELECT t.* FROM stage_runs t
           LEFT JOIN stage_runs o ON o.tenant_id = t.tenant_id AND o.item_id = t.item_id
                                    AND o.stage = 'ocr'
          WHERE t.stage = 'translate' AND t.status = 'success'
            AND (o.status IS DISTINCT FROM 'success'
                 OR t.upstream_stage IS DISTINCT FROM 'ocr'
                 OR t.upstream_attempt IS DISTINCT FROM o.success_attempt
                 OR (t.output #>> '{}')::int IS DISTINCT FROM jsonb_array_length(o.output))",
    ),
    (
        "a translation of an item whose translate has not succeeded, or past the \
         pages it translated",
        "SELECT tr.* FROM translations tr
           LEFT JOIN stage_runs r ON r.tenant_id = tr.tenant_id AND r.item_id = tr.item_id
                                    AND r.stage = 'translate'
          WHERE r.id IS NULL OR r.status <> 'success' OR tr.page > (r.output #>> '{}')::int",
    ),
    (
        "a page without its translation, or a translation without its page",
        "SELECT * FROM ocr_pages p FULL JOIN translations t USING (tenant_id, item_id, page)
          WHERE p.id IS NULL OR t.text IS NULL",
    ),
    (
        "a successful stage without its audit entry of the same attempt",
        "SELECT r.* FROM stage_runs r
          WHERE r.status = 'success' AND NOT EXISTS (
                SELECT 1 FROM audit_log l
                 WHERE l.run_id = r.id AND l.attempt = r.success_attempt
                   AND l.action = r.stage || '.pages')",
    ),
    (
        "an audit entry of an attempt that did not succeed",
        "SELECT l.* FROM audit_log l WHERE l.run_id IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM stage_run_attempts a
                 WHERE a.run_id = l.run_id AND a.attempt = l.attempt AND a.outcome = 'success')",
    ),
    (
        "a double execution: two successes of a run on the same input and upstream",
        "SELECT * FROM (
            SELECT input_hash, upstream_attempt,
                   lag(input_hash) OVER w AS prev_hash,
                   lag(upstream_attempt) OVER w AS prev_upstream,
                   row_number() OVER w AS n
              FROM stage_run_attempts WHERE outcome = 'success'
            WINDOW w AS (PARTITION BY run_id ORDER BY attempt)) s
          WHERE n > 1 AND prev_hash = input_hash
            AND prev_upstream IS NOT DISTINCT FROM upstream_attempt",
    ),
    (
        "a stage that is not final",
        "SELECT * FROM stage_runs WHERE status <> 'success'",
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
            "{what}: {open} items or jobs still open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_over_two_tenants_leave_only_current_lineage() {
    let mut f = fixture().await;
    let pipeline = pipeline_with(Faults::default());
    let mut items: Vec<(TenantId, ItemId, usize)> = Vec::new();
    for (t, slug) in TENANTS.iter().enumerate() {
        for i in 0..ITEMS_PER_TENANT {
            items.push((tenant(slug), ItemId::new(), t * 100 + i));
        }
    }
    let text_of = |n: usize, version: usize| text(n / 100, n % 100, version);
    // Each item sent twice: the second send is a duplicate at the queue.
    for (tenant, item, n) in &items {
        for send in 0..2 {
            let started =
                idemstage::pipeline::start(&f.pool, &pipeline, tenant, item, &text_of(*n, 0))
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

    // New input for one item of each tenant: ocr re-runs, translate after it.
    let rerun: Vec<_> = items
        .iter()
        .filter(|(_, _, n)| n % 100 == 1)
        .cloned()
        .collect();
    for (tenant, item, n) in &rerun {
        let started = idemstage::pipeline::start(&f.pool, &pipeline, tenant, item, &text_of(*n, 1))
            .await
            .unwrap();
        assert!(
            matches!(
                started.registered,
                idemstage::items::RegisterOutcome::Replaced { .. }
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
    let stages = 2 * items.len() as i64;
    assert_eq!(
        count(
            c,
            "SELECT 1 FROM stage_run_attempts WHERE outcome = 'failed'"
        )
        .await,
        stages
    );
    assert_eq!(
        count(c, "SELECT 1 FROM stage_runs WHERE status = 'success'").await,
        stages
    );
    // The pages are those of each item's current text, and each translation
    // is its page translated.
    for (tenant, item, n) in &items {
        let version = usize::from(rerun.iter().any(|(_, a, _)| a == item));
        let expected = ocr_translate::split_pages(&text_of(*n, version));
        let rows: Vec<(i32, String, String)> = ocr_pages::table
            .inner_join(
                translations::table.on(translations::tenant_id
                    .eq(ocr_pages::tenant_id)
                    .and(translations::item_id.eq(ocr_pages::item_id))
                    .and(translations::page.eq(ocr_pages::page))),
            )
            .filter(ocr_pages::tenant_id.eq(tenant.as_str()))
            .filter(ocr_pages::item_id.eq(item.to_string()))
            .order(ocr_pages::page)
            .select((ocr_pages::page, ocr_pages::text, translations::text))
            .load(c)
            .await
            .unwrap();
        assert_eq!(rows.len(), expected.len(), "{tenant} {item}");
        for ((page, text, translated), want) in rows.iter().zip(&expected) {
            assert_eq!(text, want, "{tenant} {item} page {page}");
            assert_eq!(translated, &translate_text(text));
        }
    }

    // The checks are not vacuous: a page that is not what ocr's success handed on,
    // and a page whose translation is gone, are each caught.
    let (tenant, item) = (items[0].0.as_str(), items[0].1.to_string());
    let page = ocr_pages::table
        .filter(ocr_pages::tenant_id.eq(tenant))
        .filter(ocr_pages::item_id.eq(&item))
        .filter(ocr_pages::page.eq(1));
    diesel::update(page)
        .set(ocr_pages::text.eq("tampered"))
        .execute(c)
        .await
        .unwrap();
    assert_eq!(violation_counts(c).await[..4], [1, 0, 0, 0]);
    let one = translations::table
        .filter(translations::tenant_id.eq(tenant))
        .filter(translations::item_id.eq(&item))
        .filter(translations::page.eq(1));
    diesel::delete(one).execute(c).await.unwrap();
    assert_eq!(violation_counts(c).await[..4], [1, 0, 0, 1]);
}
