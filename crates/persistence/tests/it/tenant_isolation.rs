//! Row-level security: a transaction scoped to tenant A (`tenant::scope`, as every
//! tenant-scoped transaction of the persistence layer is) can neither read nor
//! write tenant B's rows in any tenant table, and a crafted claim naming B's
//! item under A is refused.

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::FutureExt;
use idemstage_domain::{ClaimOutcome, CompleteOutcome, RepoError, TenantId};
use idemstage_example::{ExampleTables, Extraktion};
use idemstage_persistence::tenant::{self, scope};
use idemstage_persistence::TxError;
use idemstage_testkit::TestDb;

use crate::support::*;

const TENANT_TABLES: [&str; 9] = [
    "items",
    "stage_runs",
    "stage_attempt_ends",
    "stage_run_attempts",
    "dateien",
    "anfrage_extraktionen",
    "feasibility_results",
    "calculation_results",
    "audit_log",
];

/// One completed stage for `tenant` that writes a row into every tenant table.
async fn fill(db: &TestDb, tenant: &TenantId) -> idemstage_domain::ItemId {
    let repo = repo(db, 2).await;
    let item = new_item(&mut db.conn().await, tenant).await;
    let req = request(tenant, item, "intake");
    let outcome = repo.claim(&req).await.unwrap();
    assert!(matches!(outcome, ClaimOutcome::Claimed { .. }));
    let token = token_of(&req, &outcome);
    let write = write_fn(|tx| {
        async move {
            tx.replace_extraktionen(&[Extraktion {
                position_index: 0,
                description: "x".into(),
                quantity: Some(1.0),
                unit: Some("stk".into()),
            }])
            .await?;
            tx.insert_or_get_datei(&"a".repeat(64), "k", 1).await?;
            tx.put_feasibility(true, serde_json::json!([])).await?;
            tx.put_calculation(150, serde_json::json!([])).await?;
            Ok(())
        }
        .boxed()
    });
    assert_eq!(
        repo.complete(&token, &write).await.unwrap(),
        CompleteOutcome::Committed
    );
    item
}

async fn n(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    count(conn, sql).await
}

#[tokio::test]
async fn a_transaction_scoped_to_one_tenant_cannot_read_or_write_another_tenants_rows() {
    let db = idemstage_harness::example::db().await;
    let (a, b) = (tenant("ta"), tenant("tb"));
    fill(&db, &a).await;
    let b_item = fill(&db, &b).await;
    let mut conn = db.conn().await;
    // The connecting (owner/superuser) role sees both tenants: reports need that.
    for table in TENANT_TABLES {
        assert!(
            n(
                &mut conn,
                &format!("SELECT 1 FROM {table} WHERE tenant_id = 'tb'")
            )
            .await
                > 0
        );
    }
    // `tenant::transaction` is `scope` first in a transaction of its own.
    tenant::transaction::<_, diesel::result::Error, _>(&mut conn, &a, async |conn| {
        for table in TENANT_TABLES {
            let mine = n(conn, &format!("SELECT 1 FROM {table}")).await;
            let theirs = n(
                conn,
                &format!("SELECT 1 FROM {table} WHERE tenant_id = 'tb'"),
            )
            .await;
            assert!(mine > 0, "{table}: tenant A sees its own rows");
            assert_eq!(theirs, 0, "{table}: tenant A sees tenant B's rows");
            // The audit trail is append-only (the baseline migration; roles::…),
            // the attempt history a view.
            if matches!(table, "audit_log" | "stage_run_attempts") {
                continue;
            }
            // An attempt's end may only be named `fenced` (its outcome).
            let column = if table == "stage_attempt_ends" {
                "outcome"
            } else {
                "tenant_id"
            };
            let touched = diesel::sql_query(format!(
                "UPDATE {table} SET {column} = {column} WHERE tenant_id = 'tb'"
            ))
            .execute(conn)
            .await?;
            assert_eq!(touched, 0, "{table}: tenant A updated B's rows");
            // Runs and their history are never deleted, not even one's own
            // (migration the baseline migration took DELETE from idemstage_app; roles::…).
            if matches!(table, "stage_runs" | "stage_attempt_ends") {
                continue;
            }
            let deleted = diesel::sql_query(format!("DELETE FROM {table} WHERE tenant_id = 'tb'"))
                .execute(conn)
                .await?;
            assert_eq!(deleted, 0, "{table}: tenant A deleted B's rows");
        }
        Ok(())
    })
    .await
    .unwrap();
    // Writing a row for B from A's scope is refused by the policy's WITH CHECK.
    for insert in [
        "INSERT INTO audit_log (id, tenant_id, entity_id, action) \
         VALUES ('01JDQ3W5AAAAAAAAAAAAAAAAAA', 'tb', 'x', 'forged')",
        "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key) \
         VALUES ('tb', '01JDQ3W5AAAAAAAAAAAAAAAAAB', 'x', repeat('a', 64), 'k')",
    ] {
        let err = conn
            .transaction::<_, diesel::result::Error, _>(async |conn| {
                scope(conn, &a).await?;
                diesel::sql_query(insert).execute(conn).await?;
                Ok(())
            })
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("row-level security"),
            "{insert}: {err}"
        );
    }
    // Moving A's row to B is refused too.
    let err = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            scope(conn, &a).await?;
            diesel::sql_query("UPDATE items SET tenant_id = 'tb'")
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("row-level security"), "{err}");
    // The role alone, without a tenant, sees nothing.
    conn.batch_execute("BEGIN; SET LOCAL ROLE idemstage_app")
        .await
        .unwrap();
    for table in TENANT_TABLES {
        assert_eq!(n(&mut conn, &format!("SELECT 1 FROM {table}")).await, 0);
    }
    conn.batch_execute("ROLLBACK").await.unwrap();

    // A crafted job (claim) for tenant A naming B's item: refused, nothing written.
    let repo = repo(&db, 2).await;
    let before = n(&mut conn, "SELECT 1 FROM stage_runs").await;
    let err = repo
        .claim(&request(&a, b_item, "extract"))
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::ItemNotFound { .. }), "{err:?}");
    assert_eq!(n(&mut conn, "SELECT 1 FROM stage_runs").await, before);
    // And registering B's item id under A says it belongs to someone else.
    let err = idemstage_persistence::items::register_item(&mut conn, &a, &b_item, "x")
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::TenantMismatch { .. }), "{err:?}");
    // The role cannot bypass RLS.
    #[derive(diesel::QueryableByName)]
    struct Role {
        #[diesel(sql_type = Text)]
        flags: String,
    }
    let role: Role = diesel::sql_query(
        "SELECT rolsuper::text || rolbypassrls::text || rolcanlogin::text AS flags \
         FROM pg_roles WHERE rolname = 'idemstage_app'",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(role.flags, "falsefalsefalse");
}

/// `tenant::transaction` commits the body's writes when it returns `Ok` and rolls
/// them back on `Err`; a write for another tenant inside it is refused.
#[tokio::test]
async fn a_tenant_transaction_commits_on_ok_and_rolls_back_on_err() {
    let db = TestDb::new().await;
    let a = tenant("ta");
    let mut conn = db.conn().await;
    let audit = |id: &str, tenant: &str| {
        format!(
            "INSERT INTO audit_log (id, tenant_id, entity_id, action) \
             VALUES ('{id}', '{tenant}', 'x', 'test')"
        )
    };
    let kept = audit("01JDQ3W5AAAAAAAAAAAAAAAAA1", "ta");
    tenant::transaction::<_, diesel::result::Error, _>(&mut conn, &a, async |conn| {
        diesel::sql_query(&kept).execute(conn).await?;
        Ok(())
    })
    .await
    .unwrap();
    let dropped = audit("01JDQ3W5AAAAAAAAAAAAAAAAA2", "ta");
    let err = tenant::transaction::<(), TxError, _>(&mut conn, &a, async |conn| {
        diesel::sql_query(&dropped).execute(conn).await?;
        Err(RepoError::Database("the body gives up".into()).into())
    })
    .await
    .unwrap_err();
    assert!(format!("{err:?}").contains("the body gives up"), "{err:?}");
    let foreign = audit("01JDQ3W5AAAAAAAAAAAAAAAAA3", "tb");
    let err = tenant::transaction::<_, diesel::result::Error, _>(&mut conn, &a, async |conn| {
        diesel::sql_query(&foreign).execute(conn).await?;
        Ok(())
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("row-level security"), "{err}");
    assert_eq!(
        n(&mut conn, "SELECT 1 FROM audit_log WHERE action = 'test'").await,
        1,
        "only the Ok body's row is committed"
    );
}

/// BEGIN and the scope go in one message: when the scope fails after the BEGIN
/// ran (a login role that may not take `idemstage_app`), the transaction is
/// closed and the connection works on, instead of staying in an aborted
/// transaction that diesel's transaction manager does not know of.
#[tokio::test]
async fn a_scope_that_fails_leaves_no_transaction_open() {
    let db = TestDb::new().await;
    let mut owner = db.conn().await;
    let role = format!("no_app_{}", ulid::Ulid::new().to_string().to_lowercase());
    owner
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD '{role}'; \
             GRANT CONNECT ON DATABASE \"{}\" TO {role}",
            db.name()
        ))
        .await
        .unwrap();
    let mut conn = AsyncPgConnection::establish(&idemstage_testkit::url_with_user(db.url(), &role))
        .await
        .unwrap();
    let a = tenant("ta");
    let err = tenant::transaction::<(), diesel::result::Error, _>(&mut conn, &a, async |_| Ok(()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    let open: String = diesel::sql_query("SELECT current_setting('transaction_isolation') AS s")
        .get_result::<Setting>(&mut conn)
        .await
        .map(|r| r.s)
        .expect("the connection is not left in an aborted transaction");
    assert!(!open.is_empty());
    // The manager is not broken either: a transaction of diesel's own works.
    conn.transaction::<_, diesel::result::Error, _>(async |c| c.batch_execute("SELECT 1").await)
        .await
        .unwrap();
    drop(conn);
    owner
        .batch_execute(&format!(
            "REVOKE CONNECT ON DATABASE \"{}\" FROM {role}; DROP ROLE {role}",
            db.name()
        ))
        .await
        .unwrap();
}

#[derive(diesel::QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    s: String,
}

fn job_of(tenant: Option<&TenantId>) -> idemstage_domain::JobToSend {
    idemstage_domain::JobToSend {
        queue: "intake".into(),
        tenant: tenant.cloned(),
        payload: serde_json::json!({ "tenant": tenant.map(|t| t.as_str()) }),
        options: idemstage_domain::SendOptions::default(),
    }
}

/// Issue 29, item 8: the queue's tables under the tenant scope. Inside a
/// transaction scoped to tenant A (a stage body's fenced transaction, as the
/// worker's login role) only A's jobs are visible and changeable, a job sent
/// there is A's (another tenant's label, or none, is refused), and the buckets are
/// out of reach; outside the scope the same login role's fetch still sees every
/// tenant. Before, the scope read B's payloads and sent jobs under B's label.
#[tokio::test]
async fn a_transaction_scoped_to_one_tenant_reaches_only_its_tenants_jobs_and_no_bucket() {
    use idemstage_domain::SendResult;
    use idemstage_persistence::queue;
    let db = TestDb::new().await;
    let (a, b) = (tenant("ta"), tenant("tb"));
    let mut owner = db.conn().await;
    for t in [&a, &b] {
        queue::send_in(&mut owner, &job_of(Some(t))).await.unwrap();
    }
    queue::hold(
        &mut owner,
        "other",
        Some(&b),
        std::time::Duration::from_secs(60),
    )
    .await
    .unwrap();
    let mut w = idemstage_persistence::connect(&db.worker_url())
        .await
        .unwrap();

    let (all, theirs, changed, sent) =
        tenant::transaction::<_, TxError, _>(&mut w, &a, async |c| {
            let all = n(c, "SELECT 1 FROM jobs").await;
            let theirs = n(c, "SELECT 1 FROM jobs WHERE tenant_id = 'tb'").await;
            let changed = diesel::sql_query("UPDATE jobs SET priority = 9 WHERE tenant_id = 'tb'")
                .execute(c)
                .await
                .map_err(idemstage_persistence::map_diesel_error)?;
            // A stage body's send of its next job, through the library.
            let sent = queue::send_in(c, &job_of(Some(&a))).await?;
            Ok((all, theirs, changed, sent))
        })
        .await
        .unwrap();
    assert_eq!((all, theirs, changed), (1, 0, 0));
    assert!(matches!(sent, SendResult::Sent(_)), "{sent:?}");

    // Refused in the scope: a job under B's label or none (library or by hand),
    // and every bucket.
    for job in [job_of(Some(&b)), job_of(None)] {
        let e = tenant::transaction::<_, TxError, _>(&mut w, &a, async |c| {
            Ok(queue::send_in(c, &job).await?)
        })
        .await
        .expect_err("a job of another tenant sent in the scope");
        assert!(format!("{e:?}").contains("row-level security"), "{e:?}");
    }
    for sql in [
        "INSERT INTO jobs (id, queue, payload, tenant_id) \
         VALUES ('01JDQ3W5AAAAAAAAAAAAAAAAAA', 'intake', '{}', 'tb')",
        "SELECT * FROM queue_buckets",
        "UPDATE queue_buckets SET held_until = NULL",
    ] {
        let e = tenant::transaction::<(), diesel::result::Error, _>(&mut w, &a, async |c| {
            c.batch_execute(sql).await
        })
        .await
        .expect_err(sql);
        let msg = e.to_string();
        assert!(
            msg.contains("row-level security") || msg.contains("permission denied"),
            "{sql}: {msg}"
        );
    }

    // Outside the scope the worker's fetch works every tenant's jobs.
    let fetched = queue::fetch(&mut w, &["intake".to_string()], 10)
        .await
        .unwrap();
    let mut tenants: Vec<&str> = fetched
        .iter()
        .map(|j| j.tenant.as_ref().map_or("", |t| t.as_str()))
        .collect();
    tenants.sort();
    assert_eq!(tenants, ["ta", "ta", "tb"]);
}

/// The reconciler's list of open items (`items_open`, the baseline migration)
/// had no row-level security: a stage body in tenant A's scope read B's item
/// ids and could delete B's rows, so that B's lost stages were never sent again.
/// In the scope the list is its tenant's; outside, the worker reads it all.
#[tokio::test]
async fn a_transaction_scoped_to_one_tenant_reaches_only_its_tenants_open_items() {
    let db = TestDb::new().await;
    let (a, b) = (tenant("ta"), tenant("tb"));
    let mut owner = db.conn().await;
    for t in [&a, &b] {
        idemstage_persistence::items::register_item(
            &mut owner,
            t,
            &idemstage_domain::ItemId::new(),
            "10 Stk Schrauben",
        )
        .await
        .unwrap();
    }
    let mut w = idemstage_persistence::connect(&db.worker_url())
        .await
        .unwrap();
    let (seen, theirs) = tenant::transaction::<_, TxError, _>(&mut w, &a, async |c| {
        let seen = n(c, "SELECT 1 FROM items_open").await;
        let theirs = n(c, "SELECT 1 FROM items_open WHERE tenant_id = 'tb'").await;
        Ok((seen, theirs))
    })
    .await
    .unwrap();
    assert_eq!((seen, theirs), (1, 0));
    // Nothing removes an open item but the reconciler's truncate of a slot it
    // passed (the ring, migration 2026-12-06-020000_open_items_ring): not a
    // delete, not a slot read or truncated past the parent's policies.
    for sql in [
        "DELETE FROM items_open WHERE tenant_id = 'tb'",
        "SELECT 1 FROM items_open_0",
        "TRUNCATE items_open_0",
        "SELECT idemstage_items_open_truncate(0::smallint)",
    ] {
        let e = tenant::transaction::<(), diesel::result::Error, _>(&mut w, &a, async |c| {
            c.batch_execute(sql).await
        })
        .await
        .unwrap_err();
        assert!(e.to_string().contains("permission denied"), "{sql}: {e}");
    }
    // Outside the scope the worker (the reconciler's batch) reads every tenant's.
    assert_eq!(n(&mut w, "SELECT 1 FROM items_open").await, 2);
}

#[derive(diesel::QueryableByName)]
struct Entry {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    ready_seq: i64,
    #[diesel(sql_type = Text)]
    id: String,
}

async fn entry_of(conn: &mut AsyncPgConnection, tenant: &str) -> Entry {
    diesel::sql_query("SELECT ready_seq, id FROM jobs WHERE tenant_id = $1")
        .bind::<Text, _>(tenant)
        .get_result(conn)
        .await
        .unwrap()
}

/// A claim or a closure is keyed by the job's ready entry (`ready_seq`), and
/// the tenant scope's policy checked only the row's own tenant label: in A's
/// scope a crafted claim or closure naming B's entry (under A's label, with A's
/// job id or B's) was accepted, and B's job was then never fetched (its entry
/// claimed) or never ended (every end meets the closure's key). In the scope a
/// claim or a closure must name one of the scope's own jobs at its current
/// entry; the library's fetch and completion there are unchanged.
#[tokio::test]
async fn a_transaction_scoped_to_one_tenant_cannot_claim_or_close_another_tenants_job() {
    use idemstage_domain::JobCompleteOutcome;
    use idemstage_persistence::queue;
    let db = TestDb::new().await;
    let (a, b) = (tenant("ta"), tenant("tb"));
    let mut owner = db.conn().await;
    for t in [&a, &b] {
        queue::send_in(&mut owner, &job_of(Some(t))).await.unwrap();
    }
    let mine = entry_of(&mut owner, "ta").await;
    let theirs = entry_of(&mut owner, "tb").await;
    let mut w = idemstage_persistence::connect(&db.worker_url())
        .await
        .unwrap();

    let mut crafted = Vec::new();
    for job_id in [&mine.id, &theirs.id] {
        crafted.push(format!(
            "INSERT INTO job_claims (ready_seq, job_id, attempt, queue, tenant_id, priority, \
             claim_xid, claimed_at, lease_expires_at) \
             VALUES ({}, '{job_id}', 1, 'intake', 'ta', 0, 1, now(), now() + interval '1 hour')",
            theirs.ready_seq
        ));
        crafted.push(format!(
            "INSERT INTO job_closures (ready_seq, job_id, attempt, queue, tenant_id, priority, \
             outcome) VALUES ({}, '{job_id}', 1, 'intake', 'ta', 0, 'completed')",
            theirs.ready_seq
        ));
    }
    // A's own job at an entry that is not its current one.
    crafted.push(format!(
        "INSERT INTO job_closures (ready_seq, job_id, attempt, queue, tenant_id, priority, \
         outcome) VALUES ({}, '{}', 1, 'intake', 'ta', 0, 'completed')",
        mine.ready_seq + 1_000_000,
        mine.id
    ));
    for sql in &crafted {
        let e = tenant::transaction::<(), diesel::result::Error, _>(&mut w, &a, async |c| {
            c.batch_execute(sql).await
        })
        .await
        .expect_err(sql);
        assert!(e.to_string().contains("row-level security"), "{sql}: {e}");
    }
    let left = n(
        &mut owner,
        "SELECT 1 FROM job_claims UNION ALL SELECT 1 FROM job_closures",
    )
    .await;
    assert_eq!(left, 0, "a crafted claim or closure was written");

    // The worker fetches both jobs; A's is completed in A's scope (its closure
    // names A's own entry), B's outside any scope, as before.
    let mut jobs = queue::fetch(&mut w, &["intake".to_string()], 10)
        .await
        .unwrap();
    jobs.sort_by_key(|j| j.tenant.as_ref().map(|t| t.as_str().to_owned()));
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    assert_eq!(jobs[1].id.to_string(), theirs.id);
    let (job_a, attempt_a) = (jobs[0].id, jobs[0].attempt);
    let done = tenant::transaction::<_, TxError, _>(&mut w, &a, async |c| {
        Ok(queue::complete(c, job_a, attempt_a, None).await?)
    })
    .await
    .unwrap();
    assert_eq!(done, JobCompleteOutcome::Completed);
    let done = queue::complete(&mut w, jobs[1].id, jobs[1].attempt, None)
        .await
        .unwrap();
    assert_eq!(done, JobCompleteOutcome::Completed);
    assert_eq!(
        n(
            &mut owner,
            "SELECT 1 FROM job_states WHERE state = 'completed'"
        )
        .await,
        2
    );
}
