//! Queue controls enforced by the fetch: pause and resume, concurrency caps per
//! queue and per tenant (also under concurrent fetchers), rate limits as token
//! buckets, holds (a stage's 429), tenant weights, and typed refusals.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use idemstage_domain::queue::{FetchedJob, JobCompleteOutcome, JobToSend, SendOptions};
use idemstage_domain::{DomainError, JobId, RepoError, SendResult, TenantId};
use idemstage_persistence::ops::Actor;
use idemstage_persistence::queue::{
    self, ControlChangeKind, Limits, PauseOutcome, Rate, ResumeOutcome, Scope,
};
use idemstage_testkit::{count, TestDb};
use serde_json::json;
use tokio::sync::Barrier;

fn t(slug: &str) -> TenantId {
    TenantId::parse(slug).unwrap()
}

async fn send(conn: &mut AsyncPgConnection, tenant: &str, n: usize) {
    let jobs: Vec<JobToSend> = (0..n)
        .map(|i| JobToSend {
            queue: "q".into(),
            tenant: Some(t(tenant)),
            payload: json!({ "i": i }),
            options: SendOptions::default(),
        })
        .collect();
    let sent = queue::send_batch(conn, &jobs).await.unwrap();
    assert!(sent.iter().all(|r| matches!(r, SendResult::Sent(_))));
}

async fn fetch(conn: &mut AsyncPgConnection, n: u32) -> Vec<FetchedJob> {
    queue::fetch(conn, &["q".to_owned()], n).await.unwrap()
}

fn per_tenant(jobs: &[FetchedJob]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for j in jobs {
        *m.entry(j.tenant.as_ref().unwrap().as_str().to_owned())
            .or_default() += 1;
    }
    m
}

async fn complete(conn: &mut AsyncPgConnection, jobs: &[FetchedJob]) {
    let tokens: Vec<(JobId, i32)> = jobs.iter().map(|j| (j.id, j.attempt)).collect();
    let done = queue::complete_many(conn, &tokens).await.unwrap();
    assert!(done.iter().all(|o| *o == JobCompleteOutcome::Completed));
}

#[tokio::test]
async fn a_paused_queue_or_tenant_is_not_fetched_until_resumed() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    send(&mut conn, "a", 3).await;
    send(&mut conn, "b", 3).await;

    assert_eq!(
        queue::pause(&mut conn, "q", &Scope::Queue, &test_actor())
            .await
            .unwrap(),
        PauseOutcome::Paused
    );
    assert_eq!(
        queue::pause(&mut conn, "q", &Scope::Queue, &test_actor())
            .await
            .unwrap(),
        PauseOutcome::AlreadyPaused
    );
    assert!(fetch(&mut conn, 10).await.is_empty(), "a paused queue");
    assert_eq!(
        queue::resume(&mut conn, "q", &Scope::Queue, &test_actor())
            .await
            .unwrap(),
        ResumeOutcome::Resumed
    );
    assert_eq!(
        queue::resume(&mut conn, "q", &Scope::Queue, &test_actor())
            .await
            .unwrap(),
        ResumeOutcome::NotPaused
    );

    queue::pause(&mut conn, "q", &Scope::Tenant(t("a")), &test_actor())
        .await
        .unwrap();
    let got = fetch(&mut conn, 10).await;
    assert_eq!(per_tenant(&got), HashMap::from([("b".to_owned(), 3)]));
    queue::resume(&mut conn, "q", &Scope::Tenant(t("a")), &test_actor())
        .await
        .unwrap();
    let got = fetch(&mut conn, 10).await;
    assert_eq!(per_tenant(&got), HashMap::from([("a".to_owned(), 3)]));

    let controls = queue::controls(&mut conn, Some("q")).await.unwrap();
    assert_eq!(controls.len(), 2);
    assert!(controls.iter().all(|c| !c.paused));
}

#[tokio::test]
async fn caps_per_queue_and_per_tenant_bound_the_active_jobs() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for tenant in ["a", "b", "c"] {
        send(&mut conn, tenant, 10).await;
    }
    // At most 2 active per tenant, tenant c at most 1, at most 4 in the queue.
    let cap = |n| Limits {
        max_active: Some(n),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "q", &Scope::EveryTenant, &cap(2), &test_actor())
        .await
        .unwrap();
    queue::set_limits(
        &mut conn,
        "q",
        &Scope::Tenant(t("c")),
        &cap(1),
        &test_actor(),
    )
    .await
    .unwrap();
    let first = fetch(&mut conn, 100).await;
    assert_eq!(
        per_tenant(&first),
        HashMap::from([("a".into(), 2), ("b".into(), 2), ("c".into(), 1)])
    );
    assert!(
        fetch(&mut conn, 100).await.is_empty(),
        "every tenant is at its cap"
    );

    queue::set_limits(&mut conn, "q", &Scope::Queue, &cap(4), &test_actor())
        .await
        .unwrap();
    complete(&mut conn, &first).await;
    let second = fetch(&mut conn, 100).await;
    assert_eq!(second.len(), 4, "the queue's cap");
    assert!(per_tenant(&second).values().all(|n| *n <= 2));
    // A slot comes back when a job is done.
    complete(&mut conn, &second[..1]).await;
    assert_eq!(fetch(&mut conn, 100).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_fetchers_never_exceed_a_cap() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for tenant in ["a", "b", "c", "d"] {
        send(&mut conn, tenant, 150).await;
    }
    const CAP: i64 = 5;
    const PER_TENANT: i64 = 2;
    let limits = |n| Limits {
        max_active: Some(n),
        ..Limits::default()
    };
    queue::set_limits(
        &mut conn,
        "q",
        &Scope::Queue,
        &limits(CAP as u32),
        &test_actor(),
    )
    .await
    .unwrap();
    queue::set_limits(
        &mut conn,
        "q",
        &Scope::EveryTenant,
        &limits(PER_TENANT as u32),
        &test_actor(),
    )
    .await
    .unwrap();
    const FETCHERS: usize = 8;
    let barrier = Arc::new(Barrier::new(FETCHERS));
    let mut tasks = Vec::new();
    for _ in 0..FETCHERS {
        let mut conn = db.conn().await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let (mut done, mut max_seen, mut max_tenant) = (0usize, 0i64, 0i64);
            let mut idle = 0;
            while idle < 200 {
                let jobs = fetch(&mut conn, 3).await;
                if jobs.is_empty() {
                    idle += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                idle = 0;
                // Sampled from the database while this fetcher holds its jobs.
                max_seen = max_seen
                    .max(count(&mut conn, "SELECT 1 FROM job_states WHERE state = 'active'").await);
                max_tenant = max_tenant.max(
                    count(
                        &mut conn,
                        "SELECT 1 FROM job_states WHERE state = 'active' AND tenant_id = ( \
                           SELECT tenant_id FROM job_states WHERE state = 'active' \
                            GROUP BY tenant_id ORDER BY count(*) DESC LIMIT 1)",
                    )
                    .await,
                );
                complete(&mut conn, &jobs).await;
                done += jobs.len();
            }
            (done, max_seen, max_tenant)
        }));
    }
    let (mut done, mut max_seen, mut max_tenant) = (0, 0, 0);
    for task in tasks {
        let (d, m, mt) = task.await.unwrap();
        done += d;
        max_seen = max_seen.max(m);
        max_tenant = max_tenant.max(mt);
    }
    assert_eq!(done, 600, "every job done once");
    assert!(max_seen <= CAP, "{max_seen} active with a cap of {CAP}");
    assert!(
        max_tenant <= PER_TENANT,
        "{max_tenant} of one tenant, cap {PER_TENANT}"
    );
    assert!(max_seen >= 2, "the fetchers overlapped");
}

#[tokio::test]
async fn a_rate_limit_spends_tokens_that_refill_on_the_database_clock() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    send(&mut conn, "a", 50).await;
    let rate = Limits {
        rate: Some(Rate {
            count: 5,
            per: Duration::from_secs(60),
            burst: None,
        }),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "q", &Scope::Queue, &rate, &test_actor())
        .await
        .unwrap();
    assert_eq!(fetch(&mut conn, 100).await.len(), 5, "a full bucket");
    assert!(fetch(&mut conn, 100).await.is_empty(), "an empty bucket");
    // 24 s later (the bucket's clock moved back instead): 2 tokens.
    conn.batch_execute("UPDATE queue_buckets SET refilled_at = refilled_at - interval '24 s'")
        .await
        .unwrap();
    assert_eq!(fetch(&mut conn, 100).await.len(), 2);
    // Never more than the burst, however long it was quiet.
    conn.batch_execute("UPDATE queue_buckets SET refilled_at = refilled_at - interval '1 day'")
        .await
        .unwrap();
    assert_eq!(fetch(&mut conn, 100).await.len(), 5);
}

/// The refill while a fetch leases its jobs is not lost: the bucket's refilled_at
/// is the instant its tokens were counted, not the end of the fetch. (It was the
/// end: a queue limited to 100/s fetched 78/s.) A test-only trigger makes each
/// lease take 200 ms, for the queue's bucket and for a tenant's: the fetch ends
/// a second after it began, far from the start even on a loaded machine (with
/// 50 ms leases, a server slow to begin the fetch passed the bound).
#[tokio::test]
async fn a_slow_fetch_does_not_lose_the_refill_of_its_own_duration() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute(
        "CREATE FUNCTION slow_lease() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(0.2); RETURN NEW; END $$;
         CREATE TRIGGER slow_lease BEFORE INSERT ON job_claims FOR EACH ROW
             EXECUTE FUNCTION slow_lease();",
    )
    .await
    .unwrap();
    let rate = Limits {
        rate: Some(Rate {
            count: 10,
            per: Duration::from_secs(1),
            burst: None,
        }),
        ..Limits::default()
    };
    for (scope, bucket) in [(Scope::Queue, ""), (Scope::EveryTenant, "a")] {
        conn.batch_execute(
            "DELETE FROM jobs; DELETE FROM queue_controls; DELETE FROM queue_buckets",
        )
        .await
        .unwrap();
        send(&mut conn, "a", 20).await;
        queue::set_limits(&mut conn, "q", &scope, &rate, &test_actor())
            .await
            .unwrap();
        conn.batch_execute(
            "CREATE TEMP TABLE IF NOT EXISTS t0 (at timestamptz); DELETE FROM t0;
                            INSERT INTO t0 SELECT clock_timestamp()",
        )
        .await
        .unwrap();
        // Five leases of 200 ms each: the fetch ends at least 1 s after it began.
        assert_eq!(fetch(&mut conn, 5).await.len(), 5);
        #[derive(diesel::QueryableByName)]
        struct Lag {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            ms: i64,
        }
        let lag = diesel_async::RunQueryDsl::get_result::<Lag>(
            diesel::sql_query(
                "SELECT (extract(epoch FROM b.refilled_at - t0.at) * 1000)::bigint AS ms
                   FROM queue_buckets b, t0 WHERE b.queue = 'q' AND b.tenant_id = $1",
            )
            .bind::<diesel::sql_types::Text, _>(bucket),
            &mut conn,
        )
        .await
        .unwrap()
        .ms;
        assert!(
            (0..200).contains(&lag),
            "{scope:?}: the bucket was refilled as of {lag} ms after the fetch began, \
             so the refill during its leases was lost"
        );
    }
}

#[tokio::test]
async fn a_hold_stops_the_tenants_bucket_or_else_the_queues() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    send(&mut conn, "a", 3).await;
    send(&mut conn, "b", 3).await;
    // No per-tenant rate: a 429 holds the queue.
    queue::hold(&mut conn, "q", Some(&t("a")), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(queue::held_until(&mut conn, "q", None)
        .await
        .unwrap()
        .is_some());
    assert!(fetch(&mut conn, 10).await.is_empty());
    conn.batch_execute("DELETE FROM queue_buckets")
        .await
        .unwrap();

    // A per-tenant rate: the 429 holds that tenant's bucket only.
    let rate = Limits {
        rate: Some(Rate {
            count: 100,
            per: Duration::from_secs(1),
            burst: None,
        }),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "q", &Scope::EveryTenant, &rate, &test_actor())
        .await
        .unwrap();
    queue::hold(&mut conn, "q", Some(&t("a")), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(queue::held_until(&mut conn, "q", Some(&t("a")))
        .await
        .unwrap()
        .is_some());
    let got = fetch(&mut conn, 10).await;
    assert_eq!(per_tenant(&got), HashMap::from([("b".to_owned(), 3)]));
    // Once the hold is over, a's jobs come.
    conn.batch_execute(
        "UPDATE queue_buckets SET held_until = clock_timestamp() - interval '1 ms', \
                refilled_at = refilled_at - interval '61 s'",
    )
    .await
    .unwrap();
    assert_eq!(
        per_tenant(&fetch(&mut conn, 10).await),
        HashMap::from([("a".to_owned(), 3)])
    );
}

#[tokio::test]
async fn weights_give_tenants_proportional_shares() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    send(&mut conn, "a", 20).await;
    send(&mut conn, "b", 20).await;
    let weight = |w| Limits {
        weight: Some(w),
        ..Limits::default()
    };
    queue::set_limits(
        &mut conn,
        "q",
        &Scope::Tenant(t("a")),
        &weight(3),
        &test_actor(),
    )
    .await
    .unwrap();
    let got = fetch(&mut conn, 8).await;
    assert_eq!(
        per_tenant(&got),
        HashMap::from([("a".into(), 6), ("b".into(), 2)])
    );
}

#[tokio::test]
async fn bad_limits_are_refused_with_a_typed_error_and_write_nothing() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let refused = [
        (
            Scope::Queue,
            Limits {
                weight: Some(2),
                ..Limits::default()
            },
        ),
        (
            Scope::EveryTenant,
            Limits {
                weight: Some(0),
                ..Limits::default()
            },
        ),
        (
            Scope::Queue,
            Limits {
                rate: Some(Rate {
                    count: 0,
                    per: Duration::from_secs(1),
                    burst: None,
                }),
                ..Limits::default()
            },
        ),
        (
            Scope::Queue,
            Limits {
                rate: Some(Rate {
                    count: 1,
                    per: Duration::ZERO,
                    burst: None,
                }),
                ..Limits::default()
            },
        ),
    ];
    for (scope, limits) in refused {
        let err = queue::set_limits(&mut conn, "q", &scope, &limits, &test_actor())
            .await
            .unwrap_err();
        assert!(
            matches!(err, RepoError::Invalid(DomainError::InvalidOption(_))),
            "{scope} {limits:?}: {err:?}"
        );
    }
    let err = queue::pause(&mut conn, "bad queue!", &Scope::Queue, &test_actor())
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::Invalid(_)), "{err:?}");
    assert_eq!(count(&mut conn, "SELECT 1 FROM queue_controls").await, 0);
}

/// After a short fetch, `fetch_wait` says when a control may let more through:
/// nothing for an empty or paused queue, the refill of one token for an empty
/// bucket, a short re-check for a full cap.
#[tokio::test]
async fn fetch_wait_names_the_time_until_a_control_lets_a_ready_job_through() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let q = ["q".to_owned()];
    assert_eq!(
        queue::fetch_wait(&mut conn, &q).await.unwrap(),
        None,
        "no jobs"
    );

    send(&mut conn, "a", 10).await;
    let rate = Limits {
        rate: Some(Rate {
            count: 2,
            per: Duration::from_secs(1),
            burst: None,
        }),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "q", &Scope::Queue, &rate, &test_actor())
        .await
        .unwrap();
    assert_eq!(
        queue::fetch_wait(&mut conn, &q).await.unwrap(),
        None,
        "a full bucket"
    );
    assert_eq!(fetch(&mut conn, 10).await.len(), 2);
    let wait = queue::fetch_wait(&mut conn, &q)
        .await
        .unwrap()
        .expect("an empty bucket");
    // One token of 2 per second: 500 ms, less the time since the fetch.
    assert!(
        wait > Duration::from_millis(300) && wait <= Duration::from_millis(500),
        "{wait:?}"
    );

    queue::pause(&mut conn, "q", &Scope::Queue, &test_actor())
        .await
        .unwrap();
    assert_eq!(
        queue::fetch_wait(&mut conn, &q).await.unwrap(),
        None,
        "paused"
    );
    queue::resume(&mut conn, "q", &Scope::Queue, &test_actor())
        .await
        .unwrap();

    let cap = Limits {
        max_active: Some(2),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "q", &Scope::Queue, &cap, &test_actor())
        .await
        .unwrap();
    assert_eq!(
        queue::fetch_wait(&mut conn, &q).await.unwrap(),
        Some(Duration::from_millis(20)),
        "a full cap is re-checked shortly"
    );
}

/// Who these tests' control changes are recorded as made by.
pub(crate) fn test_actor() -> idemstage_persistence::ops::Actor {
    idemstage_persistence::ops::Actor::parse("test").unwrap()
}

/// Every change of a control is recorded by the database, newest first, with the
/// actor the library was given and the login role; a setting that changes
/// nothing is no change; plain SQL is recorded too, without an actor.
#[tokio::test]
async fn every_control_change_is_recorded_with_who_made_it() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let actor = |name: &str| Actor::parse(name).unwrap();
    let cap = |m: u32| Limits {
        max_active: Some(m),
        ..Limits::default()
    };
    let tenant = Scope::Tenant(t("a"));
    queue::pause(&mut conn, "q", &Scope::Queue, &actor("alice"))
        .await
        .unwrap();
    // Already paused, then the same limits twice: one change, not three.
    queue::pause(&mut conn, "q", &Scope::Queue, &actor("mallory"))
        .await
        .unwrap();
    queue::set_limits(&mut conn, "q", &tenant, &cap(3), &actor("carol"))
        .await
        .unwrap();
    queue::set_limits(&mut conn, "q", &tenant, &cap(3), &actor("mallory"))
        .await
        .unwrap();
    queue::resume(&mut conn, "q", &Scope::Queue, &actor("bob"))
        .await
        .unwrap();
    queue::resume(&mut conn, "q", &Scope::Queue, &actor("mallory"))
        .await
        .unwrap();
    // Another queue's change is not this queue's.
    queue::pause(&mut conn, "other", &Scope::Queue, &actor("alice"))
        .await
        .unwrap();
    conn.batch_execute(
        "UPDATE queue_controls SET max_active = 5 WHERE queue = 'q' AND scope = 'a';
         DELETE FROM queue_controls WHERE queue = 'q' AND scope = '';",
    )
    .await
    .unwrap();

    let changes = queue::control_changes(&mut conn, Some("q"), 10)
        .await
        .unwrap();
    let seen: Vec<_> = changes
        .iter()
        .map(|c| {
            (
                c.kind,
                c.scope.as_key().to_owned(),
                c.limits.max_active,
                c.paused,
                c.actor.clone(),
            )
        })
        .collect();
    let some = |s: &str| Some(s.to_owned());
    assert_eq!(
        seen,
        vec![
            (ControlChangeKind::Remove, "".into(), None, None, None),
            (
                ControlChangeKind::Limits,
                "a".into(),
                Some(5),
                Some(false),
                None
            ),
            (
                ControlChangeKind::Resume,
                "".into(),
                None,
                Some(false),
                some("bob")
            ),
            (
                ControlChangeKind::Limits,
                "a".into(),
                Some(3),
                Some(false),
                some("carol")
            ),
            (
                ControlChangeKind::Pause,
                "".into(),
                None,
                Some(true),
                some("alice")
            ),
        ]
    );
    let user: String = {
        #[derive(diesel::QueryableByName)]
        struct U {
            #[diesel(sql_type = diesel::sql_types::Text)]
            u: String,
        }
        use diesel_async::RunQueryDsl;
        diesel::sql_query("SELECT session_user::text AS u")
            .get_result::<U>(&mut conn)
            .await
            .unwrap()
            .u
    };
    assert!(changes.iter().all(|c| c.db_user == user), "{changes:?}");
    assert!(
        changes
            .windows(2)
            .all(|w| w[0].id > w[1].id && w[0].changed_at >= w[1].changed_at),
        "newest first: {changes:?}"
    );
    assert_eq!(
        queue::control_changes(&mut conn, None, 10)
            .await
            .unwrap()
            .len(),
        6
    );
    assert_eq!(
        queue::control_changes(&mut conn, Some("q"), 2)
            .await
            .unwrap()
            .len(),
        2
    );
}

/// The actor a library call names is that call's alone: a change made by hand
/// later in the same transaction is recorded without one, also after a call that
/// changed nothing (a second pause).
#[tokio::test]
async fn an_actor_names_its_own_statement_not_the_rest_of_the_transaction() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let alice = Actor::parse("alice").unwrap();
    conn.batch_execute("BEGIN").await.unwrap();
    queue::pause(&mut conn, "q", &Scope::Queue, &alice)
        .await
        .unwrap();
    conn.batch_execute("UPDATE queue_controls SET max_active = 5 WHERE queue = 'q'")
        .await
        .unwrap();
    // Already paused: this call changes nothing, and names nobody for what follows.
    queue::pause(&mut conn, "q", &Scope::Queue, &alice)
        .await
        .unwrap();
    conn.batch_execute("UPDATE queue_controls SET paused = false WHERE queue = 'q'")
        .await
        .unwrap();
    conn.batch_execute("COMMIT").await.unwrap();

    let changes = queue::control_changes(&mut conn, Some("q"), 10)
        .await
        .unwrap();
    let seen: Vec<_> = changes.iter().map(|c| (c.kind, c.actor.clone())).collect();
    assert_eq!(
        seen,
        vec![
            (ControlChangeKind::Resume, None),
            (ControlChangeKind::Limits, None),
            (ControlChangeKind::Pause, Some("alice".to_owned())),
        ]
    );
}

/// Priority aging (issue 32, item 4): within a tenant's share a priority-0 job
/// waits behind priority-10 ones until it has waited 10 aging intervals; then it
/// is taken before the newer priority-10 jobs. Its wait is its `start_after`,
/// set back here instead of waited for. Without aging, or after it is turned
/// off, the order is by priority alone; a bad interval is refused with nothing
/// written; the change is recorded, and limits set later keep it.
#[tokio::test]
async fn with_priority_aging_a_long_waiting_low_priority_job_is_taken_before_newer_high_ones() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let actor = Actor::parse("ops-bot").unwrap();
    // A low job first (the oldest), then a stream of high ones; the low one's id.
    let send_lane = async |conn: &mut AsyncPgConnection| -> JobId {
        let send_one = |priority: i32| JobToSend {
            queue: "q".into(),
            tenant: Some(t("a")),
            payload: json!({ "priority": priority }),
            options: SendOptions::default().with_priority(priority),
        };
        let mut jobs = vec![send_one(0)];
        jobs.extend((0..3).map(|_| send_one(10)));
        let sent = queue::send_batch(conn, &jobs).await.unwrap();
        let SendResult::Sent(low) = sent[0] else {
            panic!("{sent:?}")
        };
        low
    };
    let waited = async |conn: &mut AsyncPgConnection, low: JobId, minutes: i32| {
        conn.batch_execute(&format!(
            "UPDATE jobs SET start_after = now() - interval '{minutes} minutes' WHERE id = '{low}'"
        ))
        .await
        .unwrap();
    };
    let next = async |conn: &mut AsyncPgConnection, n: u32| -> Vec<FetchedJob> {
        let got = fetch(conn, n).await;
        complete(conn, &got).await;
        got
    };

    // No aging: priority first, however long the low job waited.
    let low = send_lane(&mut conn).await;
    waited(&mut conn, low, 60).await;
    assert_eq!(next(&mut conn, 1).await[0].priority, 10);

    // A bad interval: refused, nothing written.
    for bad in [
        Duration::ZERO,
        queue::MAX_PRIORITY_AGING + Duration::from_millis(1),
    ] {
        let err = queue::set_priority_aging(&mut conn, "q", Some(bad), &actor)
            .await
            .unwrap_err();
        assert!(
            matches!(err, RepoError::Invalid(DomainError::InvalidOption(_))),
            "{err:?}"
        );
    }
    assert_eq!(count(&mut conn, "SELECT 1 FROM queue_controls").await, 0);

    // Aging every minute: 5 minutes waited make it 5, below 10.
    queue::set_priority_aging(&mut conn, "q", Some(Duration::from_secs(60)), &actor)
        .await
        .unwrap();
    waited(&mut conn, low, 5).await;
    assert_eq!(next(&mut conn, 1).await[0].priority, 10);
    // 10 minutes make it 10 (never more): the oldest of the tenth priority.
    waited(&mut conn, low, 10).await;
    let got = next(&mut conn, 2).await;
    assert_eq!(got[0].id, low, "{got:?}");
    assert_eq!(got[1].priority, 10, "{got:?}");

    let controls = queue::controls(&mut conn, Some("q")).await.unwrap();
    assert_eq!(controls.len(), 1);
    assert_eq!(controls[0].priority_aging, Some(Duration::from_secs(60)));
    assert_eq!(controls[0].limits, Limits::default());
    let changes = queue::control_changes(&mut conn, Some("q"), 10)
        .await
        .unwrap();
    assert_eq!(changes[0].kind, ControlChangeKind::Limits);
    assert_eq!(changes[0].priority_aging, Some(Duration::from_secs(60)));
    assert_eq!(changes[0].actor.as_deref(), Some("ops-bot"));

    // Limits set afterwards keep the aging.
    let capped = Limits {
        max_active: Some(100),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "q", &Scope::Queue, &capped, &actor)
        .await
        .unwrap();
    let low = send_lane(&mut conn).await;
    waited(&mut conn, low, 10).await;
    assert_eq!(next(&mut conn, 1).await[0].id, low);
    next(&mut conn, 3).await;

    // Turned off: priority first again.
    queue::set_priority_aging(&mut conn, "q", None, &actor)
        .await
        .unwrap();
    let low = send_lane(&mut conn).await;
    waited(&mut conn, low, 60).await;
    assert_eq!(next(&mut conn, 1).await[0].priority, 10);
    let controls = queue::controls(&mut conn, Some("q")).await.unwrap();
    assert_eq!(controls[0].priority_aging, None);
    assert_eq!(controls[0].limits, capped);
}
