//! Through PgBouncer in transaction mode (`Pooler::Transaction`): every function
//! that takes a caller's connection runs its statements inside a transaction, so
//! that a statement is prepared and executed on one server session. The test
//! pgbouncer resets each session after every transaction (`DEALLOCATE ALL`), so a
//! statement that is not is refused at once.

use std::time::Duration;

use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{FailKind, JobToSend, SendOptions, SendResult, TenantId};
use idemstage_harness::PgBouncer;
use idemstage_persistence::queue::{self, Limits, Rate, Scope};
use idemstage_persistence::{connect_with, Pooler};
use idemstage_testkit::TestDb;
use serde_json::json;

fn job(queue: &str, tenant: &TenantId) -> JobToSend {
    JobToSend {
        tenant: Some(tenant.clone()),
        queue: queue.into(),
        payload: json!({"n": 1}),
        options: SendOptions::default(),
    }
}

#[derive(QueryableByName)]
struct Backend {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pid: i32,
}

async fn backend_pid(conn: &mut AsyncPgConnection) -> i32 {
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        diesel::sql_query("SELECT pg_backend_pid() AS pid")
            .get_result::<Backend>(conn)
            .await
    })
    .await
    .unwrap()
    .pid
}

#[tokio::test]
async fn the_queue_the_role_check_and_the_reports_work_through_a_transaction_pooler() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(db.url(), 2);
    let url = bouncer.url(db.url());
    let mut conn = connect_with(&url, Pooler::Transaction).await.unwrap();
    assert!(idemstage_persistence::db::through_transaction_pooler(
        &mut conn
    ));
    // A second client, so that the pooler hands both server sessions around.
    let mut other = connect_with(&url, Pooler::Transaction).await.unwrap();
    let tenant = TenantId::parse("acme").unwrap();
    let queues = vec!["q".to_owned()];

    // Sends, outside and inside a transaction of the caller's.
    let sent = queue::send_batch(&mut conn, &[job("q", &tenant), job("q", &tenant)])
        .await
        .unwrap();
    assert!(
        sent.iter().all(|s| matches!(s, SendResult::Sent(_))),
        "{sent:?}"
    );
    conn.transaction::<_, idemstage_persistence::TxError, _>(async |conn| {
        queue::send_in(conn, &job("q", &tenant)).await?;
        queue::send_in_waking(conn, &job("q", &tenant), queue::Wake::AfterCommit).await?;
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(
        queue::queue_depths(&mut other, &queues).await.unwrap()[0].ready,
        4
    );

    // Fetch, renew, complete, fail, give back: the worker's whole cycle.
    let jobs = queue::fetch(&mut conn, &queues, 4).await.unwrap();
    assert_eq!(jobs.len(), 4);
    let (a, b, c, d) = (&jobs[0], &jobs[1], &jobs[2], &jobs[3]);
    assert!(matches!(
        queue::renew_lease(&mut other, a.id, a.attempt)
            .await
            .unwrap(),
        queue::RenewLeaseOutcome::Renewed { .. }
    ));
    queue::complete(&mut conn, a.id, a.attempt, None)
        .await
        .unwrap();
    queue::fail(&mut other, b.id, b.attempt, "boom", FailKind::Permanent)
        .await
        .unwrap();
    queue::retry_at(&mut conn, c.id, c.attempt, None)
        .await
        .unwrap();
    let renewed = queue::renew_leases(&mut other, &[(d.id, d.attempt)])
        .await
        .unwrap();
    assert_eq!(renewed.len(), 1);
    let done = queue::complete_many(&mut conn, &[(d.id, d.attempt)])
        .await
        .unwrap();
    assert_eq!(done.len(), 1);
    let stats = queue::queue_stats(&mut other).await.unwrap();
    assert!(!format!("{stats:?}").is_empty());

    // Controls: pause, limits, their record, a hold, and the fetch's wait.
    let actor = crate::controls::test_actor();
    queue::pause(&mut conn, "q", &Scope::Queue, &actor)
        .await
        .unwrap();
    assert!(queue::fetch(&mut other, &queues, 4)
        .await
        .unwrap()
        .is_empty());
    queue::resume(&mut conn, "q", &Scope::Queue, &actor)
        .await
        .unwrap();
    queue::set_limits(
        &mut other,
        "q",
        &Scope::EveryTenant,
        &Limits {
            max_active: Some(2),
            rate: Some(Rate {
                count: 10,
                per: Duration::from_secs(1),
                burst: None,
            }),
            weight: None,
        },
        &actor,
    )
    .await
    .unwrap();
    assert_eq!(
        queue::controls(&mut conn, Some("q")).await.unwrap().len(),
        2
    );
    let changes = queue::control_changes(&mut other, Some("q"), 10)
        .await
        .unwrap();
    assert_eq!(changes.len(), 3, "{changes:?}");
    assert!(changes.iter().all(|c| c.actor.as_deref() == Some("test")));
    queue::hold(&mut other, "q", Some(&tenant), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(queue::held_until(&mut conn, "q", Some(&tenant))
        .await
        .unwrap()
        .is_some());
    assert!(queue::fetch_wait(&mut other, &queues)
        .await
        .unwrap()
        .is_some());

    // What the worker checks at start, and what status and the console read.
    let role = idemstage_persistence::roles::check_worker_role(&mut conn)
        .await
        .unwrap();
    assert!(!role.is_restricted(), "postgres is a superuser: {role}");
    idemstage_persistence::report::stage_status_counts(&mut other, None)
        .await
        .unwrap();
    assert!(
        !idemstage_persistence::report::tenant_exists(&mut conn, &tenant)
            .await
            .unwrap()
    );

    // Both clients' transactions really ran on shared server sessions.
    let mut pids = std::collections::HashSet::new();
    for _ in 0..20 {
        pids.insert(backend_pid(&mut conn).await);
        pids.insert(backend_pid(&mut other).await);
    }
    assert!(pids.len() <= 2, "{pids:?}");
}

#[tokio::test]
async fn a_direct_connection_fails_through_the_same_pooler() {
    // The control: without `Pooler::Transaction` the very setup of a connection
    // (diesel-async prepares two SETs outside a transaction) or its first
    // statement is refused, so the test above could fail.
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(db.url(), 2);
    let url = bouncer.url(db.url());
    let failed = match connect_with(&url, Pooler::None).await {
        Err(e) => e.to_string(),
        Ok(mut conn) => queue::fetch(&mut conn, &["q".to_owned()], 1)
            .await
            .expect_err("a cached, unpinned statement through the pooler")
            .to_string(),
    };
    assert!(failed.contains("prepared statement"), "{failed}");
}

/// `cargo xtask test` against a `DATABASE_URL` of another user with a password
/// (README, "Your own server"): the test pgbouncer lets that user through and
/// logs in to the server with its password. Before, it knew only `postgres` and
/// the test roles, and refused this user itself ("trust" authentication failed),
/// which failed every PgBouncer test on such a URL.
#[tokio::test]
async fn the_test_pgbouncer_lets_the_urls_own_user_and_password_through() {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    // A login role of this test's (roles are per server: created once, its
    // password set again each run), with a password a URL must percent-encode.
    let role = "idemstage_test_pooled";
    db.conn()
        .await
        .batch_execute(&format!(
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                     CREATE ROLE {role} LOGIN;
                 END IF;
             EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
             END $$;
             ALTER ROLE {role} PASSWORD 'p@ss:w\"rd/%';"
        ))
        .await
        .unwrap();
    let url = idemstage_testkit::url_with_user(db.url(), role).replacen(
        &format!("{role}:{role}@"),
        &format!("{role}:p%40ss%3Aw%22rd%2F%25@"),
        1,
    );
    let bouncer = PgBouncer::start(&url, 1);
    let mut conn = connect_with(&bouncer.url(&url), Pooler::Transaction)
        .await
        .unwrap_or_else(|e| panic!("{e}\npgbouncer: {}", bouncer.log()));
    #[derive(QueryableByName)]
    struct User {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    let user = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            diesel::sql_query("SELECT current_user::text AS name")
                .get_result::<User>(conn)
                .await
        })
        .await
        .unwrap();
    assert_eq!(user.name, role);
}
