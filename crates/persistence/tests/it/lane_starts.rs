//! A session's fetch walks each lane on from where its last fetch left it
//! (migration `2026-12-05-140000_lane_starts`), and what that start passes is
//! still fetched: a lane with nothing past it is walked from its floor, a job
//! that came due below it is found by its own index, and the walks start from
//! the floors again every second.

use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{JobId, JobToSend, SendOptions, SendResult, TenantId};
use idemstage_persistence::queue;
use idemstage_testkit::TestDb;
use serde_json::json;

use crate::support::stat_around;

async fn send(conn: &mut AsyncPgConnection, tenant: Option<&str>, options: SendOptions) -> JobId {
    let job = JobToSend {
        tenant: tenant.map(|t| TenantId::parse(t).unwrap()),
        queue: "q".to_owned(),
        payload: json!({}),
        options,
    };
    match queue::send_in(conn, &job).await.unwrap() {
        SendResult::Sent(id) => id,
        SendResult::Duplicate => panic!("a send without a key is never a duplicate"),
    }
}

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = Text)]
    id: String,
}

async fn fetch(conn: &mut AsyncPgConnection, n: i32) -> Vec<String> {
    diesel::sql_query(format!("SELECT id FROM idemstage_fetch(ARRAY['q'], {n})"))
        .load::<Id>(conn)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect()
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Entries of the ready index read by a fetch of `n`.
async fn walked(conn: &mut AsyncPgConnection, n: i32) -> i64 {
    stat_around(
        conn,
        "pg_stat_get_xact_tuples_returned('jobs_ready_idx'::regclass)",
        format!("SELECT * FROM idemstage_fetch(ARRAY['q'], {n})"),
    )
    .await
}

#[tokio::test]
async fn a_fetch_walks_on_from_where_the_sessions_last_fetch_left_the_lane() {
    const IN_FLIGHT: i32 = 100;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // One lane (the plain path), then two tenants (the fair one).
    for tenants in [&[None][..], &[Some("a"), Some("b")][..]] {
        conn.batch_execute("TRUNCATE jobs, job_claims, job_lanes")
            .await
            .unwrap();
        for tenant in tenants {
            for _ in 0..=IN_FLIGHT {
                send(&mut conn, *tenant, SendOptions::default()).await;
            }
        }
        let lanes = i32::try_from(tenants.len()).unwrap();
        assert_eq!(
            fetch(&mut conn, IN_FLIGHT * lanes).await.len(),
            100 * tenants.len()
        );
        let read = walked(&mut conn, lanes).await;
        assert!(
            read < i64::from(IN_FLIGHT / 4),
            "{tenants:?}: a fetch of {lanes} read {read} entries of the ready index, \
             past the {} its session had claimed",
            IN_FLIGHT * lanes
        );
        // Another session walks from the floors.
        let mut other = db.conn().await;
        assert!(walked(&mut other, 1).await > i64::from(IN_FLIGHT));
    }
}

#[tokio::test]
async fn a_lane_with_nothing_past_its_start_is_walked_from_its_floor() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut late = db.conn().await;
    // The lane exists (a send into a lane another's open send created waits for it).
    let warm = send(&mut conn, None, SendOptions::default()).await;
    assert_eq!(fetch(&mut conn, 5).await, vec![warm.to_string()]);
    // A job whose sender commits after the fetch has passed its number.
    late.batch_execute("BEGIN").await.unwrap();
    let late_id = send(&mut late, None, SendOptions::default()).await;
    let early = send(&mut conn, None, SendOptions::default()).await;
    assert_eq!(fetch(&mut conn, 5).await, vec![early.to_string()]);
    late.batch_execute("COMMIT").await.unwrap();
    assert_eq!(fetch(&mut conn, 5).await, vec![late_id.to_string()]);
}

#[tokio::test]
async fn a_job_that_came_due_below_the_start_is_fetched_next() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let first = send(&mut conn, None, SendOptions::default()).await;
    let deferred = send(
        &mut conn,
        None,
        SendOptions::default().with_start_after(Duration::from_secs(3600)),
    )
    .await;
    let mut after = Vec::new();
    for _ in 0..3 {
        after.push(
            send(&mut conn, None, SendOptions::default())
                .await
                .to_string(),
        );
    }
    assert_eq!(
        fetch(&mut conn, 2).await,
        vec![first.to_string(), after[0].clone()]
    );
    // Its time comes (as the clock passing it would have it).
    conn.batch_execute(&format!(
        "UPDATE jobs SET start_after = clock_timestamp() WHERE id = '{deferred}'"
    ))
    .await
    .unwrap();
    assert_eq!(fetch(&mut conn, 1).await, vec![deferred.to_string()]);
    assert_eq!(fetch(&mut conn, 5).await, after[1..].to_vec());
}

#[tokio::test]
async fn a_job_committed_late_below_the_start_of_a_busy_lane_waits_a_second_at_most() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut late = db.conn().await;
    // The lane exists (a send into a lane another's open send created waits for it).
    let warm = send(&mut conn, None, SendOptions::default()).await;
    assert_eq!(fetch(&mut conn, 5).await, vec![warm.to_string()]);
    late.batch_execute("BEGIN").await.unwrap();
    let late_id = send(&mut late, None, SendOptions::default())
        .await
        .to_string();
    send(&mut conn, None, SendOptions::default()).await;
    assert_eq!(fetch(&mut conn, 1).await.len(), 1);
    late.batch_execute("COMMIT").await.unwrap();
    let committed = Instant::now();
    // The lane stays busy: a job past the start on every fetch.
    let found = loop {
        send(&mut conn, None, SendOptions::default()).await;
        let got = fetch(&mut conn, 1).await;
        if got.contains(&late_id) {
            break committed.elapsed();
        }
        assert!(
            committed.elapsed() < Duration::from_secs(10),
            "a job committed late was not fetched in 10 s"
        );
    };
    // A second from the walk from the floors that started the session's
    // starts, which came before the commit.
    assert!(found < Duration::from_secs(5), "fetched after {found:?}");
}

#[tokio::test]
async fn a_rolled_back_fetch_takes_its_starts_back() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            send(&mut conn, None, SendOptions::default())
                .await
                .to_string(),
        );
    }
    let rolled_back: Result<(), diesel::result::Error> = conn
        .transaction(async |conn| {
            assert_eq!(fetch(conn, 2).await, ids[..2].to_vec());
            Err(diesel::result::Error::RollbackTransaction)
        })
        .await;
    assert!(rolled_back.is_err());
    let starts: N = diesel::sql_query(
        "SELECT count(*) AS n FROM (SELECT current_setting('idemstage.lane_starts', true) AS s) x \
          WHERE coalesce(s, '') <> ''",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(starts.n, 0, "the rolled-back fetch's starts outlived it");
    assert_eq!(fetch(&mut conn, 5).await, ids);
}
