//! Bad input reaching a running worker: job rows written by hand with malformed,
//! oversized or hostile payloads, an input above the limit, a queue the pipeline
//! does not know, a stage body that panics and one that never returns. Each ends
//! in a clear error on a failed job (or run); the worker keeps running and the
//! good work next to it is unaffected. (Bad CLI input is in `cli.rs`.)

use idemstage::fenced::FencedTx;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use diesel::sql_types::{Integer, Jsonb, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::items::register_item;
use idemstage::worker::Counters;
use idemstage::{
    ids::input_hash_of, ids::ItemId, ids::JobId, ids::TenantId, queue::SendOptions,
    stage::StageError, stage::StagePolicy,
};
use idemstage::{
    pipeline::first_job, pipeline::Pipeline, stage::Done, stage::PrepareContext, stage::Stage,
};
use serde_json::{json, Value};

use crate::support::{self, count, start_pipeline_worker, stop_pipeline_worker};

#[derive(diesel::QueryableByName, Debug)]
struct JobRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Integer)]
    retry_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

/// Labelled with the tenant its payload names, if that is a slug: the database
/// refuses a job labelled otherwise (the baseline migration).
async fn insert_job(conn: &mut AsyncPgConnection, queue: &str, payload: Value) -> JobId {
    let id = JobId::new();
    diesel::sql_query(
        "INSERT INTO jobs (id, queue, payload, retry_limit, tenant_id)
         VALUES ($1, $2, $3, 3,
                 CASE WHEN jsonb_typeof($3 -> 'tenant_id') = 'string'
                       AND ($3 ->> 'tenant_id') ~ '^[a-z0-9][a-z0-9_-]*$'
                       AND length($3 ->> 'tenant_id') <= 63
                      THEN $3 ->> 'tenant_id' ELSE '' END)",
    )
    .bind::<Text, _>(id.to_string())
    .bind::<Text, _>(queue)
    .bind::<Jsonb, _>(payload)
    .execute(conn)
    .await
    .unwrap();
    id
}

async fn job(conn: &mut AsyncPgConnection, id: JobId) -> JobRow {
    diesel::sql_query("SELECT state, retry_count, last_error FROM job_states WHERE id = $1")
        .bind::<Text, _>(id.to_string())
        .get_result(conn)
        .await
        .unwrap()
}

async fn wait_job_state(conn: &mut AsyncPgConnection, id: JobId, state: &str) -> JobRow {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let row = job(conn, id).await;
        if row.state == state {
            return row;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {id} never reached {state}: {row:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_hostile_job_payloads_fail_clearly_and_harm_nothing() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let t1 = TenantId::parse("t1").unwrap();
    // Another tenant's item, that a crafted payload names.
    let foreign = ItemId::new();
    register_item(&mut conn, &t1, &foreign, "1 Stk Foreign")
        .await
        .unwrap();
    let hash = input_hash_of(b"1 Stk Foreign");
    let good = |tenant: Value, item: Value, hash: Value| json!({ "tenant_id": tenant, "item_id": item, "input_hash": hash });
    let mut nested = json!("t1");
    for _ in 0..300 {
        nested = json!([nested]);
    }
    let long = "a".repeat(100_000);
    let cases: Vec<(&str, Value, &str)> = vec![
        ("a string", json!("just a string"), "invalid job payload"),
        ("null", Value::Null, "invalid job payload"),
        ("an array", json!([1, 2, 3]), "invalid job payload"),
        ("empty object", json!({}), "missing field"),
        (
            "unknown field",
            json!({ "tenant_id": "t1", "item_id": foreign.to_string(), "input_hash": hash, "stage": "calculate" }),
            "unknown field",
        ),
        (
            "id not a ULID",
            good(json!("t1"), json!("not-a-ulid"), json!(hash)),
            "invalid item id",
        ),
        (
            "SQL in the item id",
            good(json!("t1"), json!("'; DROP TABLE jobs;--"), json!(hash)),
            "invalid item id",
        ),
        (
            "SQL in the tenant id",
            good(
                json!("t1' OR '1'='1"),
                json!(foreign.to_string()),
                json!(hash),
            ),
            "invalid tenant id",
        ),
        (
            "very long tenant id",
            good(json!(long), json!(foreign.to_string()), json!(hash)),
            "invalid tenant id",
        ),
        (
            "very long item id",
            good(json!("t1"), json!(long), json!(hash)),
            "invalid item id",
        ),
        (
            "oversized payload (2 MiB hash)",
            good(
                json!("t1"),
                json!(foreign.to_string()),
                json!("f".repeat(2 << 20)),
            ),
            "input_hash must be 64 lower-case hex characters",
        ),
        (
            "deeply nested",
            good(nested, json!(foreign.to_string()), json!(hash)),
            "job payload cannot be decoded",
        ),
        (
            "unknown item",
            good(json!("t1"), json!(ItemId::new().to_string()), json!(hash)),
            "not found for tenant t1",
        ),
        (
            "another tenant's item",
            good(json!("t2"), json!(foreign.to_string()), json!(hash)),
            "not found for tenant t2",
        ),
    ];
    let mut ids = Vec::new();
    for (what, payload, _) in &cases {
        ids.push((
            *what,
            insert_job(&mut conn, "intake", payload.clone()).await,
        ));
    }
    // A job on a queue that no stage of the pipeline has.
    let stray = insert_job(&mut conn, "nosuch", json!({})).await;

    let counters = Arc::new(Counters::default());
    let worker = start_pipeline_worker(
        db.pool(10).await,
        db.url(),
        support::pipeline(),
        4,
        counters.clone(),
    );
    for ((what, id), (_, _, message)) in ids.iter().zip(&cases) {
        let row = wait_job_state(&mut conn, *id, "failed").await;
        let error = row.last_error.unwrap_or_default();
        assert!(error.contains(message), "{what}: {error}");
        assert_eq!(row.retry_count, 0, "{what}: a permanent error was retried");
        assert!(
            error.len() <= 5_000,
            "{what}: error of {} bytes is not a clear message",
            error.len()
        );
    }
    // The worker is still running and good work goes through.
    let mut keys = support::enqueue(db.url(), 3).await;
    support::send(&mut conn, &t1, foreign, "1 Stk Foreign").await;
    keys.push((t1.clone(), foreign));
    let check = support::wait_until(db.url(), "good work done", 60, |c| {
        c.stages_succeeded == 4 * 4 && c.live_jobs == 1
    })
    .await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(job(&mut conn, stray).await.state, "created");
    // No run exists for anything but the good items: no crafted job got as far
    // as a claim.
    assert_eq!(count(&mut conn, "SELECT 1 FROM stage_runs").await, 16);
    assert_eq!(check.failed_jobs, cases.len() as i64);
    for (tenant, item) in &keys {
        assert_eq!(
            count(
                &mut conn,
                &format!(
                    "SELECT 1 FROM stage_runs WHERE tenant_id = '{tenant}' \
                     AND item_id = '{item}' AND status = 'success'"
                )
            )
            .await,
            4
        );
    }
    stop_pipeline_worker(worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_above_the_limit_written_by_hand_fails_its_stage_permanently() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    let text = "1 Stk x\n".repeat(200_000); // 1.6 MB, past the 1 MiB limit
    let hash = input_hash_of(text.as_bytes());
    diesel::sql_query(
        "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
         VALUES ($1, $2, $3, $4, 'by-hand')",
    )
    .bind::<Text, _>(tenant.as_str())
    .bind::<Text, _>(item.to_string())
    .bind::<Text, _>(&text)
    .bind::<Text, _>(&hash)
    .execute(&mut conn)
    .await
    .unwrap();
    let job = first_job(&support::pipeline(), tenant.clone(), item, hash);
    idemstage::queue::send_in(&mut conn, &job).await.unwrap();
    let worker = start_pipeline_worker(
        db.pool(10).await,
        db.url(),
        support::pipeline(),
        2,
        Arc::new(Counters::default()),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(&mut conn, "SELECT 1 FROM job_states WHERE state = 'failed'").await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the job never failed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    #[derive(diesel::QueryableByName)]
    struct Run {
        #[diesel(sql_type = Text)]
        status: String,
        #[diesel(sql_type = Nullable<Text>)]
        last_error: Option<String>,
    }
    let run: Run = diesel::sql_query("SELECT status, last_error FROM stage_runs")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(run.status, "dead");
    assert!(
        run.last_error
            .unwrap_or_default()
            .contains("more than the limit"),
        "no clear error"
    );
    assert_eq!(count(&mut conn, "SELECT 1 FROM dateien").await, 0);
    // Good work still goes through.
    support::enqueue(db.url(), 1).await;
    support::wait_until(db.url(), "good item done", 60, |c| c.stages_succeeded == 4).await;
    stop_pipeline_worker(worker).await;
}

/// A stage whose body misbehaves depending on the item's text: `boom` panics
/// (inside the fenced transaction, after a write), `hang` never returns from
/// `prepare`, `hangtx` never returns inside the fenced transaction after a write;
/// anything else succeeds with an audit entry.
struct Probe {
    policy: StagePolicy,
}

#[async_trait]
impl Stage for Probe {
    const NAME: &'static str = "probe";
    type Input = String;
    type Prepared = ();
    type Output = ();
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<(), StageError> {
        if ctx.attempt().input_hash == input_hash_of(b"hang") {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        text: &String,
        _: &(),
    ) -> Result<Done<()>, StageError> {
        let item = tx.token().item.to_string();
        tx.audit(&item, "probe.started", json!({})).await?;
        match text.as_str() {
            "boom" => panic!("probe body exploded"),
            "hangtx" => std::future::pending::<()>().await,
            _ => {}
        }
        tx.audit(&item, "probe.done", json!({})).await?;
        Ok(Done::next(()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_bodies_that_panic_or_never_return_fail_their_run_and_nothing_else() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let policy = StagePolicy::default()
        .with_max_attempts(2)
        .with_lease(Duration::from_millis(600))
        .with_heartbeat(Duration::from_millis(150))
        .with_timeout(Duration::from_millis(800));
    let pipeline = Pipeline::builder(Probe { policy })
        .build()
        .unwrap()
        .with_send_options(
            SendOptions::default()
                .with_retry_limit(5)
                .with_retry_delay(Duration::from_millis(10))
                .with_expire_in(Duration::from_secs(3)),
        )
        .unwrap();
    let tenant = TenantId::parse("t1").unwrap();
    let mut items = Vec::new();
    for text in ["boom", "hang", "hangtx", "fine"] {
        let item = ItemId::new();
        register_item(&mut conn, &tenant, &item, text)
            .await
            .unwrap();
        let job = first_job(
            &pipeline,
            tenant.clone(),
            item,
            input_hash_of(text.as_bytes()),
        );
        idemstage::queue::send_in(&mut conn, &job).await.unwrap();
        items.push((text, item));
    }
    let worker = start_pipeline_worker(
        db.pool(6).await,
        db.url(),
        pipeline.clone(),
        4,
        Arc::new(Counters::default()),
    );
    #[derive(diesel::QueryableByName, Debug)]
    struct Run {
        #[diesel(sql_type = Text)]
        status: String,
        #[diesel(sql_type = Integer)]
        attempts: i32,
        #[diesel(sql_type = Nullable<Text>)]
        last_error: Option<String>,
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    for (text, item) in &items {
        let want = if *text == "fine" { "success" } else { "dead" };
        let run = loop {
            let run: Option<Run> = diesel::sql_query(
                "SELECT status, attempts, last_error FROM stage_runs WHERE item_id = $1",
            )
            .bind::<Text, _>(item.to_string())
            .get_result(&mut conn)
            .await
            .ok();
            if let Some(run) = run.filter(|r| r.status == want) {
                break run;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{text} never {want}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let error = run.last_error.clone().unwrap_or_default();
        match *text {
            "boom" => assert!(error.contains("panicked: probe body exploded"), "{run:?}"),
            "hang" | "hangtx" => assert!(error.contains("exceeded its deadline"), "{run:?}"),
            _ => {}
        }
        if want == "dead" {
            assert_eq!(run.attempts, 2, "{text}: {run:?}");
        }
    }
    // The failed attempts wrote nothing: only the fine item's two entries exist.
    assert_eq!(count(&mut conn, "SELECT 1 FROM audit_log").await, 2);
    // The dead runs' jobs failed for good; the worker still works.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(&mut conn, "SELECT 1 FROM job_states WHERE state = 'failed'").await < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "dead runs' jobs not failed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every transaction of the hanging bodies began before this moment.
    let hung_before: String = diesel::select(diesel::dsl::sql::<Text>("clock_timestamp()::text"))
        .get_result(&mut conn)
        .await
        .unwrap();
    let item = ItemId::new();
    register_item(&mut conn, &tenant, &item, "fine again")
        .await
        .unwrap();
    let job = first_job(
        &pipeline,
        tenant.clone(),
        item,
        input_hash_of(b"fine again"),
    );
    idemstage::queue::send_in(&mut conn, &job).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(
        &mut conn,
        &format!("SELECT 1 FROM stage_runs WHERE item_id = '{item}' AND status = 'success'"),
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker stopped working"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // No connection was left inside an aborted transaction holding locks. (Only
    // transactions from before: the worker's maintenance is idle in its own
    // transaction between two statements now and then.)
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() \
                 AND state = 'idle in transaction' AND xact_start < '{hung_before}'"
            )
        )
        .await,
        0
    );
    stop_pipeline_worker(worker).await;
}

#[test]
fn a_worker_for_a_queue_the_pipeline_does_not_know_refuses_to_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["worker", "--queues", "intake,nosuch"])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unknown stage \"nosuch\""), "{stderr}");
}

#[test]
fn a_fan_out_worker_asked_to_wait_for_an_items_review_refuses_to_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["worker", "--fan-out", "--review-infeasible-s", "60"])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("feasibility runs per position"), "{stderr}");
}

#[tokio::test]
async fn a_worker_asked_to_hold_too_many_jobs_refuses_to_start() {
    let db = idemstage_harness::example::db().await;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["worker", "--prefetch", "200000"])
        .env("DATABASE_URL", db.url())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("prefetch 200000"), "{stderr}");
}

#[test]
fn a_worker_whose_metrics_address_is_taken_refuses_to_start_before_connecting() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["worker", "--metrics-listen", &addr])
        // No server there: the address is refused first (exit 2, not 3).
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("--metrics-listen {addr}")),
        "{stderr}"
    );
}

/// Runs `idemstage worker` on `url` with `extra`; true once it says it started
/// (then killed), false if it exited first. Its stderr is returned too.
fn worker_starts(url: &str, extra: &[&str]) -> (bool, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .arg("worker")
        .args(extra)
        .env("DATABASE_URL", url)
        .env_remove("IDEMSTAGE_ALLOW_OWNER")
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut seen = String::new();
    let started = loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => {
                seen.push_str(&line);
                seen.push('\n');
                if line.contains("started;") {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let status = child.wait().unwrap();
    if !started {
        seen.push_str(&format!("exit: {:?}", status.code()));
    }
    (started, seen)
}

#[tokio::test]
async fn a_worker_connected_as_a_role_rls_does_not_restrict_refuses_to_start() {
    let db = idemstage_harness::example::db().await;
    // The superuser owner: refused, exit 2, with what to do instead.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .arg("worker")
        .env("DATABASE_URL", db.url())
        .env_remove("IDEMSTAGE_ALLOW_OWNER")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("refuses to start: role postgres is a superuser")
            || stderr.contains("is a superuser"),
        "{stderr}"
    );
    assert!(stderr.contains("IN ROLE idemstage_worker"), "{stderr}");
    assert!(stderr.contains("--allow-owner"), "{stderr}");
    // --allow-owner: it starts, and says as what.
    let (started, stderr) = worker_starts(db.url(), &["--allow-owner"]);
    assert!(started, "{stderr}");
    assert!(stderr.contains("--allow-owner: role"), "{stderr}");
    // A login role in idemstage_worker: it starts, without a word about it.
    let (started, stderr) = worker_starts(&db.worker_url(), &[]);
    assert!(started, "{stderr}");
    assert!(!stderr.contains("allow-owner"), "{stderr}");
}

/// Issue 29, item 6: a login role in idemstage_worker that can make itself the
/// tables' owner (CREATEROLE), or that owns the database (and so may replace what
/// is in its schema public), is refused like the owner: exit 2, saying why.
/// Before, both started.
#[tokio::test]
async fn a_worker_on_a_role_that_can_make_itself_the_owner_refuses_to_start() {
    use diesel_async::SimpleAsyncConnection;
    let db = idemstage_harness::example::db().await;
    let mut admin = db.conn().await;
    let suffix = idemstage::ids::ItemId::new().to_string().to_lowercase();
    let (createrole, db_owner) = (
        format!("idemstage_t_cr_{suffix}"),
        format!("idemstage_t_do_{suffix}"),
    );
    admin
        .batch_execute(&format!(
            "CREATE ROLE {createrole} LOGIN PASSWORD '{createrole}' CREATEROLE IN ROLE idemstage_worker;
             CREATE ROLE {db_owner} LOGIN PASSWORD '{db_owner}' IN ROLE idemstage_worker;
             DO $$ BEGIN
                 EXECUTE format('ALTER DATABASE %I OWNER TO {db_owner}', current_database());
             END $$;"
        ))
        .await
        .unwrap();
    // Each in a process of its own, killed if it starts (as it did before).
    let outcomes: Vec<_> = [
        (&createrole, "has CREATEROLE"),
        (&db_owner, "owns (or may become the owner of) database"),
    ]
    .into_iter()
    .map(|(role, why)| {
        let (started, stderr) =
            worker_starts(&idemstage_testkit::url_with_user(db.url(), role), &[]);
        (started, stderr, why)
    })
    .collect();
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN
                 EXECUTE format('ALTER DATABASE %I OWNER TO CURRENT_USER', current_database());
             END $$;
             DROP ROLE {createrole}; DROP ROLE {db_owner};"
        ))
        .await
        .unwrap();
    for (started, stderr, why) in outcomes {
        assert!(!started && stderr.contains("exit: Some(2)"), "{stderr}");
        assert!(
            stderr.contains("refuses to start") && stderr.contains(why),
            "{stderr}"
        );
        assert!(stderr.contains("--allow-owner"), "{stderr}");
    }
}
