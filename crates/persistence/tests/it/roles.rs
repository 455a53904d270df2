//! The roles of migration `2026-11-30-000000_baseline` against a real PostgreSQL: a
//! worker login role cannot leave the tenant scope for more rights, delete runs or
//! change the schema, yet runs the whole pipeline; an operator login role reads
//! every tenant and retries and cancels; `roles::check_worker_role` tells them
//! from the superuser owner. `escalation`: roles that could get around it.

mod escalation;

use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idemstage_domain::ItemId;
use idemstage_harness::example::{
    assert_quiet_and_sound, send, start_pipeline_worker, stop_pipeline_worker, text,
};
use idemstage_persistence::ops::{self, Actor, CancelOutcome, RetryOutcome};
use idemstage_persistence::queue;
use idemstage_persistence::roles::{check_worker_role, RoleCheck};
use idemstage_testkit::{TEST_OPERATOR, TEST_WORKER};

use crate::support::*;

/// `sql` (one statement, autocommit) fails with "permission denied" or "must be owner".
async fn refused(conn: &mut AsyncPgConnection, sql: &str) {
    let e = conn
        .batch_execute(sql)
        .await
        .expect_err(&format!("{sql}: allowed to the worker role"));
    let msg = e.to_string();
    assert!(
        msg.contains("permission denied") || msg.contains("must be owner"),
        "{sql}: {msg}"
    );
}

/// Two tenants with a finished item each, worked by an in-process worker
/// connected as the worker login role: claim, fenced commits, jobs sent, fetched
/// and completed, maintenance — all as `idemstage_worker`.
async fn worked(db: &idemstage_testkit::TestDb) {
    let mut conn = db.conn().await;
    for (i, t) in ["ta", "tb"].into_iter().enumerate() {
        send(&mut conn, &tenant(t), ItemId::new(), &text(i)).await;
    }
    let pool = idemstage_persistence::connect_pool(
        &db.worker_url(),
        idemstage_persistence::PoolConfig::default().with_max_size(6),
    )
    .await
    .unwrap();
    let worker = start_pipeline_worker(
        pool,
        &db.worker_url(),
        idemstage_harness::example::pipeline(),
        2,
        Arc::new(idemstage::worker::Counters::default()),
    );
    let check = assert_quiet_and_sound(db.url(), 120).await;
    let stats = stop_pipeline_worker(worker).await;
    assert_eq!(check.stages_succeeded, 8, "{check:?}");
    assert!(stats.completed >= 8, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_role_runs_the_pipeline_but_cannot_leave_its_scope_delete_runs_or_change_the_schema(
) {
    let db = idemstage_harness::example::db().await;
    worked(&db).await;
    let mut owner = db.conn().await;
    assert!(matches!(
        check_worker_role(&mut owner).await.unwrap(),
        RoleCheck::Superuser { .. }
    ));
    let mut w = idemstage_persistence::connect(&db.worker_url())
        .await
        .unwrap();
    assert_eq!(
        check_worker_role(&mut w).await.unwrap(),
        RoleCheck::Restricted {
            role: TEST_WORKER.into()
        }
    );

    // The floors' run is the worker's (migration ready_floors); a lane is
    // deleted by nobody.
    let mark = queue::advance_floors(&mut w, None, Duration::ZERO)
        .await
        .unwrap();
    assert!(mark.is_some());
    queue::advance_floors(&mut w, mark, Duration::ZERO)
        .await
        .unwrap();
    refused(&mut w, "DELETE FROM job_lanes").await;
    // The waits past their deadline: which and when across tenants, never what
    // a signal carried or who sent it.
    assert_eq!(
        count(
            &mut w,
            "SELECT tenant_id, run_id, attempt FROM stage_waits \
              WHERE ended_at IS NULL AND wait_until <= now() AND stage = 'approve'"
        )
        .await,
        0
    );
    refused(&mut w, "SELECT payload FROM stage_waits").await;
    refused(&mut w, "SELECT actor, signal FROM stage_waits").await;
    refused(&mut w, "SELECT * FROM stage_waits").await;

    // Without a scope: no tenant table at all, no deletes, no DDL, no owner.
    refused(&mut w, "SELECT * FROM stage_runs").await;
    refused(&mut w, "SELECT * FROM items WHERE tenant_id = 'tb'").await;
    refused(&mut w, "DELETE FROM stage_runs").await;
    refused(&mut w, "DELETE FROM stage_attempt_ends").await;
    refused(&mut w, "TRUNCATE stage_runs").await;
    refused(&mut w, "UPDATE stage_runs SET status = 'dead'").await;
    refused(&mut w, "CREATE TABLE mine (i int)").await;
    refused(&mut w, "ALTER TABLE stage_runs ADD COLUMN x int").await;
    refused(&mut w, "ALTER TABLE stage_runs DISABLE ROW LEVEL SECURITY").await;
    refused(&mut w, "DROP TABLE stage_runs").await;
    refused(&mut w, "DROP TABLE jobs").await;
    refused(&mut w, "UPDATE queue_controls SET paused = true").await;
    let e = w.batch_execute("SET ROLE postgres").await.unwrap_err();
    assert!(e.to_string().contains("permission denied"), "{e}");
    // As idemstage_app but without a tenant: nothing visible.
    let seen = w
        .transaction::<_, diesel::result::Error, _>(async |c| {
            c.batch_execute("SET LOCAL ROLE idemstage_app").await?;
            Ok(count(c, "SELECT 1 FROM stage_runs").await)
        })
        .await
        .unwrap();
    assert_eq!(seen, 0);

    // In a scope: the tenant's own rows, none of the other's, and still no delete.
    let t = tenant("ta");
    let (mine, theirs) = idemstage_persistence::tenant::transaction::<_, diesel::result::Error, _>(
        &mut w,
        &t,
        async |c| {
            Ok((
                count(c, "SELECT 1 FROM stage_runs").await,
                count(c, "SELECT 1 FROM stage_runs WHERE tenant_id = 'tb'").await,
            ))
        },
    )
    .await
    .unwrap();
    assert_eq!((mine, theirs), (4, 0));
    for sql in [
        "DELETE FROM stage_runs",
        "DELETE FROM stage_attempt_ends",
        "UPDATE stage_attempt_ends SET error = 'x'",
    ] {
        let e = idemstage_persistence::tenant::transaction::<(), diesel::result::Error, _>(
            &mut w,
            &t,
            async |c| c.batch_execute(sql).await,
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("permission denied"), "{sql}: {e}");
    }
    // A body that RESETs the role inside its scope is back to the worker role's
    // rights: no tenant table.
    let e = idemstage_persistence::tenant::transaction::<(), diesel::result::Error, _>(
        &mut w,
        &t,
        async |c| {
            c.batch_execute("RESET ROLE").await?;
            c.batch_execute(
                "INSERT INTO audit_log (id, tenant_id, entity_id, action) \
                 VALUES ('01JDQ3W5AAAAAAAAAAAAAAAAAA', 'tb', 'x', 'forged')",
            )
            .await
        },
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("permission denied"), "{e}");
    assert_eq!(
        count(
            &mut owner,
            "SELECT 1 FROM audit_log WHERE action = 'forged'"
        )
        .await,
        0
    );
}

#[tokio::test]
async fn an_operator_role_reads_every_tenant_and_retries_and_cancels() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 2).await;
    let mut conn = db.conn().await;
    // A dead intake of t1 (one attempt, failed), and a fresh item of t2.
    let item = new_item(&mut conn, &tenant("t1")).await;
    let mut req = request(&tenant("t1"), item, "intake");
    req.policy.max_attempts = 1;
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.fail(&token, "the scanner is on fire", false)
        .await
        .unwrap();
    let other = new_item(&mut conn, &tenant("t2")).await;
    let req2 = request(&tenant("t2"), other, "intake");
    repo.claim(&req2).await.unwrap();

    let mut op = idemstage_persistence::connect(&db.operator_url())
        .await
        .unwrap();
    assert_eq!(
        check_worker_role(&mut op).await.unwrap(),
        RoleCheck::Restricted {
            role: TEST_OPERATOR.into()
        }
    );
    // Cross-tenant reads, without a scope.
    let counts = idemstage_persistence::report::stage_status_counts(&mut op, None)
        .await
        .unwrap();
    let total: i64 = counts.iter().map(|c| c.count).sum();
    assert_eq!(total, 2, "{counts:?}");
    assert_eq!(count(&mut op, "SELECT 1 FROM items").await, 2);
    // ... but no write outside a scope, no delete, no DDL.
    refused(&mut op, "UPDATE stage_runs SET status = 'dead'").await;
    refused(&mut op, "DELETE FROM stage_runs").await;
    refused(&mut op, "DROP TABLE stage_runs").await;

    let actor = Actor::parse("alice").unwrap();
    let pipeline = idemstage_example::pipeline(idemstage_example::Chaos::default());
    let retried = ops::retry(&mut op, &tenant("t1"), &item, None, &actor, &pipeline)
        .await
        .unwrap();
    assert!(
        matches!(retried, RetryOutcome::Retried { .. }),
        "{retried:?}"
    );
    let cancelled = ops::cancel(&mut op, &tenant("t2"), &other, &actor)
        .await
        .unwrap();
    assert!(
        matches!(cancelled, CancelOutcome::Cancelled { .. }),
        "{cancelled:?}"
    );
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT 1 FROM stage_runs WHERE item_id = '{}' AND status = 'cancelled'",
                other
            )
        )
        .await,
        1
    );
    // Pause, across tenants.
    idemstage_persistence::queue::pause(
        &mut op,
        "intake",
        &idemstage_persistence::queue::Scope::Queue,
        &crate::controls::test_actor(),
    )
    .await
    .unwrap();
    // The change is recorded, as the operator's login role, and the operator
    // reads the record but cannot write, change or remove any of it.
    let changes = idemstage_persistence::queue::control_changes(&mut op, Some("intake"), 10)
        .await
        .unwrap();
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(changes[0].db_user, TEST_OPERATOR);
    assert_eq!(changes[0].actor.as_deref(), Some("test"));
    for sql in [
        "INSERT INTO queue_control_changes (queue, scope, change, db_user) \
         VALUES ('intake', '', 'resume', 'forged')",
        "UPDATE queue_control_changes SET actor = 'someone else'",
        "DELETE FROM queue_control_changes",
        "TRUNCATE queue_control_changes",
    ] {
        refused(&mut op, sql).await;
    }
}

#[tokio::test]
async fn a_role_that_owns_the_tables_is_told_apart() {
    let db = idemstage_testkit::TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute(&format!(
        "DO $$ BEGIN
             IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idemstage_test_owner') THEN
                 CREATE ROLE idemstage_test_owner NOLOGIN;
             END IF;
         EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
         END $$;
         ALTER TABLE jobs OWNER TO idemstage_test_owner;
         GRANT idemstage_test_owner TO {TEST_WORKER};"
    ))
    .await
    .unwrap();
    let mut w = idemstage_persistence::connect(&db.worker_url())
        .await
        .unwrap();
    let check = check_worker_role(&mut w).await.unwrap();
    conn.batch_execute(&format!(
        "REVOKE idemstage_test_owner FROM {TEST_WORKER}; ALTER TABLE jobs OWNER TO CURRENT_USER"
    ))
    .await
    .unwrap();
    assert_eq!(
        check,
        RoleCheck::OwnsTables {
            role: TEST_WORKER.into(),
            tables: vec!["jobs".into()]
        }
    );
    assert!(check.to_string().contains("owns"), "{check}");
}

/// Issue 29, item 7: `audit_log` is append-only for the worker's and the
/// operator's login roles, as `queue_control_changes` is: inside the tenant scope
/// (as `idemstage_app`, where both write their entries) and outside it, UPDATE,
/// DELETE and TRUNCATE are refused, while the library's INSERT still works.
/// Before, both rewrote and deleted their tenant's entries inside the scope.
#[tokio::test]
async fn the_audit_log_is_append_only_for_the_worker_and_the_operator() {
    let db = idemstage_testkit::TestDb::new().await;
    let mut owner = db.conn().await;
    let t = tenant("ta");
    let item = new_item(&mut owner, &t).await.to_string();
    for url in [db.worker_url(), db.operator_url()] {
        let mut conn = idemstage_persistence::connect(&url).await.unwrap();
        idemstage_persistence::tenant::transaction::<_, idemstage_persistence::TxError, _>(
            &mut conn,
            &t,
            async |c| {
                idemstage_persistence::fenced::audit(
                    c,
                    &t,
                    &item,
                    "test.entry",
                    None,
                    serde_json::json!({}),
                )
                .await
                .map_err(Into::into)
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{url}: the library's audit entry: {e:?}"));
        for sql in [
            "UPDATE audit_log SET action = 'forged'",
            "DELETE FROM audit_log",
            "TRUNCATE audit_log",
        ] {
            let scoped =
                idemstage_persistence::tenant::transaction::<(), diesel::result::Error, _>(
                    &mut conn,
                    &t,
                    async |c| c.batch_execute(sql).await,
                )
                .await
                .expect_err(&format!("{url}: {sql} allowed in the scope"));
            assert!(
                scoped.to_string().contains("permission denied"),
                "{sql}: {scoped}"
            );
            refused(&mut conn, sql).await;
        }
    }
    assert_eq!(
        count(
            &mut owner,
            "SELECT 1 FROM audit_log WHERE action = 'test.entry'"
        )
        .await,
        2
    );
}
