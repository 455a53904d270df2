//! The ready floors (migration `2026-12-04-000000_ready_floors`): under a held
//! snapshot the fetch, and a run of `advance_floors`, read a lane from its
//! floor, not past every job leased since; and no ready job stays below a floor
//! for long: a deferred job come due, for one run; a job whose transaction
//! outlived a run, until the next run that walks below the floors
//! (`2026-12-05-030000_floors_under_a_hold`).

use std::time::Duration;

use crate::support::stat_around;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{FailKind, JobId, JobToSend, SendOptions, SendResult};
use idemstage_persistence::queue::{self, FloorMark, WALK_BELOW_EVERY};
use idemstage_testkit::TestDb;
use serde_json::json;

const QUEUE: &str = "floors";

fn job(options: SendOptions) -> JobToSend {
    JobToSend {
        tenant: None,
        queue: QUEUE.to_owned(),
        payload: json!({}),
        options,
    }
}

async fn send(conn: &mut AsyncPgConnection, options: SendOptions) -> JobId {
    match queue::send_in(conn, &job(options)).await.unwrap() {
        SendResult::Sent(id) => id,
        SendResult::Duplicate => panic!("a job without a key is never a duplicate"),
    }
}

/// A job of another queue: the sequence moves on, the lane under test is idle.
async fn send_elsewhere(conn: &mut AsyncPgConnection) {
    let other = JobToSend {
        queue: "elsewhere".to_owned(),
        ..job(SendOptions::default())
    };
    queue::send_in(conn, &other).await.unwrap();
}

async fn fetch_ids(conn: &mut AsyncPgConnection, n: u32) -> Vec<JobId> {
    queue::fetch(conn, &[QUEUE.to_owned()], n)
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .collect()
}

/// Two runs: the first only reads the mark, the second raises the floors to it
/// (an interval of zero: no horizon, no wait between raises).
async fn advance_twice(conn: &mut AsyncPgConnection) -> FloorMark {
    let first = queue::advance_floors(conn, None, Duration::ZERO)
        .await
        .unwrap();
    queue::advance_floors(conn, first, Duration::ZERO)
        .await
        .unwrap()
        .expect("a run that holds the lock gives a mark")
}

#[derive(diesel::QueryableByName)]
struct Walked {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// What one fetch of one job did to `jobs_ready_idx` by the statistics
/// function `stat` (`pg_stat_get_xact_tuples_returned`: the entries the index
/// returned to the executor, visible or not; `pg_stat_get_xact_numscans`: the
/// scans started, one per lane read), and what it fetched; read before and
/// after the fetch in one transaction (the statistics are not sent in between).
async fn ready_index_by_a_fetch(
    conn: &mut AsyncPgConnection,
    stat: &'static str,
) -> (i64, Vec<JobId>) {
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        let read = || diesel::sql_query(format!("SELECT {stat}('jobs_ready_idx'::regclass) AS n"));
        let before: Walked = read().get_result(conn).await?;
        let ids = fetch_ids(conn, 1).await;
        let after: Walked = read().get_result(conn).await?;
        Ok((after.n - before.n, ids))
    })
    .await
    .unwrap()
}

async fn entries_walked_by_a_fetch(conn: &mut AsyncPgConnection) -> (i64, Vec<JobId>) {
    ready_index_by_a_fetch(conn, "pg_stat_get_xact_tuples_returned").await
}

/// Another session's snapshot, held (what vacuum and the index's own cleanup
/// may not remove, a reader has to pass), and `spent` jobs sent and leased
/// under it. Roll the returned connection back to let go.
async fn leased_under_a_hold(
    db: &TestDb,
    conn: &mut AsyncPgConnection,
    spent: i64,
) -> AsyncPgConnection {
    let mut hold = db.conn().await;
    hold.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM jobs")
        .await
        .unwrap();
    for _ in 0..spent {
        send(conn, SendOptions::default()).await;
    }
    let mut leased = 0;
    while leased < spent {
        leased += i64::try_from(fetch_ids(conn, 50).await.len()).unwrap();
    }
    hold
}

#[tokio::test]
async fn under_a_held_snapshot_the_fetch_reads_its_lane_from_the_floor() {
    const SPENT: i64 = 300;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut hold = leased_under_a_hold(&db, &mut conn, SPENT).await;
    // Floors never moved: the fetch walks every entry the leases left (a
    // session of its own: the leasing session's walks start past its claims).
    let next = send(&mut conn, SendOptions::default()).await;
    let (walked, ids) = entries_walked_by_a_fetch(&mut db.conn().await).await;
    assert_eq!(ids, vec![next]);
    assert!(
        walked > SPENT,
        "{walked} entries walked: the hold is not held"
    );

    advance_twice(&mut conn).await;
    let next = send(&mut conn, SendOptions::default()).await;
    let (walked, ids) = entries_walked_by_a_fetch(&mut db.conn().await).await;
    assert_eq!(ids, vec![next]);
    assert!(walked <= 4, "{walked} entries walked from the floor");
    hold.batch_execute("ROLLBACK").await.unwrap();
}

/// The index entries one run of the floors read (of the ready jobs, the
/// leased ones and the deferred ones).
async fn entries_read_by_a_run(conn: &mut AsyncPgConnection, mark: i64, walk_below: bool) -> i64 {
    stat_around(
        conn,
        "pg_stat_get_xact_tuples_returned('jobs_ready_idx'::regclass) \
         + pg_stat_get_xact_tuples_returned('job_claims_tenant_lease_idx'::regclass) \
         + pg_stat_get_xact_tuples_returned('jobs_deferred_idx'::regclass)",
        format!("SELECT idemstage_advance_floors({mark}, 3000, 0, {walk_below})"),
    )
    .await
}

#[tokio::test]
async fn under_a_held_snapshot_a_run_reads_each_lane_from_its_floor() {
    const SPENT: i64 = 300;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // SPENT jobs leased under the hold, and one ready after them.
    let mut hold = leased_under_a_hold(&db, &mut conn, SPENT).await;
    send(&mut conn, SendOptions::default()).await;
    let mark: Walked =
        diesel::sql_query("SELECT idemstage_advance_floors(NULL, 3000, 0, true) AS n")
            .get_result(&mut conn)
            .await
            .unwrap();
    // The raise: the floor passes the leased jobs' entries.
    entries_read_by_a_run(&mut conn, mark.n, false).await;

    // A run reads from the floor: the ready job, not the leases or the spent
    // entries below (before this migration it read both, on every run).
    let read = entries_read_by_a_run(&mut conn, mark.n, false).await;
    assert!(read <= 4, "a run read {read} index entries from the floor");
    // A run that walks below the floor passes every one the hold keeps.
    let walked = entries_read_by_a_run(&mut conn, mark.n, true).await;
    assert!(
        walked > SPENT,
        "{walked} entries walked: the hold is not held"
    );
    // That walk saw every entry up to the first run's mark (no transaction that
    // wrote jobs then was still open): the next walk starts there, and passes
    // none of them (before migration 2026-12-05-210000 it walked them all
    // again, every time).
    let walked = entries_read_by_a_run(&mut conn, mark.n, true).await;
    assert!(walked <= 4, "the next walk read {walked} index entries");
    hold.batch_execute("ROLLBACK").await.unwrap();
}

#[tokio::test]
async fn under_a_held_snapshot_a_lane_with_leases_alone_is_asked_from_its_latest_lease() {
    const SPENT: i64 = 300;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // SPENT jobs leased under the hold and finished long ago (their leased
    // versions stay in the index of leases), then one leased after them: the
    // lane's only lease, with the latest deadline.
    let mut hold = leased_under_a_hold(&db, &mut conn, SPENT).await;
    diesel::sql_query(
        "UPDATE jobs SET state = 'completed', lease_expires_at = NULL, \
                completed_at = now() - interval '1 hour' WHERE queue = 'floors'",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let held = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![held]);
    let mark: Walked =
        diesel::sql_query("SELECT idemstage_advance_floors(NULL, 3000, 0, true) AS n")
            .get_result(&mut conn)
            .await
            .unwrap();
    // The raise: the floor passes the spent entries of the ready index.
    entries_read_by_a_run(&mut conn, mark.n, false).await;

    // Nothing ready, nothing finished within the window: the lane is asked for
    // a lease, and finds the one held at the first entry it reads.
    let read = entries_read_by_a_run(&mut conn, mark.n, false).await;
    assert!(read <= 4, "a run read {read} index entries for a lease");
    assert!(
        !lane_parked(&mut conn).await,
        "a lane with a lease was parked"
    );
    hold.batch_execute("ROLLBACK").await.unwrap();
}

#[tokio::test]
async fn a_job_whose_transaction_outlived_a_run_is_fetched_after_the_next_walk_below_the_floors() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut sender = db.conn().await;
    // The lane exists (committed) before the slow sender draws its number.
    let first = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![first]);

    sender.batch_execute("BEGIN").await.unwrap();
    let slow = send(&mut sender, SendOptions::default()).await;
    // Another job after it, sent and leased.
    let other = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![other]);
    // A mark read after both drew their numbers, then a raise to it: the floor
    // passes the slow job, whose transaction has not committed.
    let mark = queue::advance_floors(&mut conn, None, Duration::ZERO)
        .await
        .unwrap();
    let mut mark = queue::advance_floors(&mut conn, mark, Duration::ZERO)
        .await
        .unwrap();
    sender.batch_execute("COMMIT").await.unwrap();
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![], "below the floor");
    // The runs that read the lanes from their floors do not see it; the next
    // run that walks below them (the process's WALK_BELOW_EVERY-th) finds it
    // ready below the floor and lowers the floor.
    let mut runs = 2;
    let fetched = loop {
        mark = queue::advance_floors(&mut conn, mark, Duration::ZERO)
            .await
            .unwrap();
        runs += 1;
        let ids = fetch_ids(&mut conn, 1).await;
        if !ids.is_empty() || runs > WALK_BELOW_EVERY + 1 {
            break ids;
        }
    };
    assert_eq!(fetched, vec![slow]);
    assert_eq!(runs, WALK_BELOW_EVERY + 1, "found by the run that walks");
}

/// A run of the floors with the previous run's mark (a horizon and a wait
/// between raises of zero), walking below the floors or not; gives its mark.
async fn run_floors(conn: &mut AsyncPgConnection, mark: Option<i64>, walk_below: bool) -> i64 {
    let row: Walked = diesel::sql_query("SELECT idemstage_advance_floors($1, 0, 0, $2) AS n")
        .bind::<diesel::sql_types::Nullable<BigInt>, _>(mark)
        .bind::<diesel::sql_types::Bool, _>(walk_below)
        .get_result(conn)
        .await
        .unwrap();
    row.n
}

#[derive(diesel::QueryableByName)]
struct WalkedFrom {
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    walked_from: Option<i64>,
}

async fn walked_from(conn: &mut AsyncPgConnection) -> Option<i64> {
    let row: WalkedFrom = diesel::sql_query("SELECT walked_from FROM job_walk_mark")
        .get_result(conn)
        .await
        .unwrap();
    row.walked_from
}

#[tokio::test]
async fn a_job_whose_transaction_outlived_several_walks_is_found_by_the_walk_after_it_commits() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut sender = db.conn().await;
    let first = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![first]);

    sender.batch_execute("BEGIN").await.unwrap();
    let slow = send(&mut sender, SendOptions::default()).await;
    let other = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![other]);
    // A walk samples the sequence while the slow sender is open; the raise
    // passes the slow job's number.
    let mark = run_floors(&mut conn, None, true).await;
    run_floors(&mut conn, Some(mark), false).await;
    // Walks while it is still open: the sample does not settle (its sender
    // holds its write lock on jobs), the walks keep starting at the first entry.
    for _ in 0..3 {
        let next = send(&mut conn, SendOptions::default()).await;
        assert_eq!(fetch_ids(&mut conn, 1).await, vec![next]);
        run_floors(&mut conn, Some(mark), true).await;
        assert_eq!(
            walked_from(&mut conn).await,
            None,
            "settled with a sender open"
        );
    }
    sender.batch_execute("COMMIT").await.unwrap();
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![], "below the floor");
    // The walk after the commit finds it, and then the bound moves up.
    run_floors(&mut conn, Some(mark), true).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![slow]);
    let from = walked_from(&mut conn).await.expect("the sample settled");
    let slow_seq: Walked = diesel::sql_query("SELECT ready_seq AS n FROM jobs WHERE id = $1")
        .bind::<Text, _>(slow.to_string())
        .get_result(&mut conn)
        .await
        .unwrap();
    assert!(
        from >= slow_seq.n,
        "walks start at {from}, the slow job's number {}",
        slow_seq.n
    );
}

#[tokio::test]
async fn a_job_sent_after_the_mark_was_read_is_fetched_at_once() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut sender = db.conn().await;
    let first = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![first]);

    let mark = queue::advance_floors(&mut conn, None, Duration::ZERO)
        .await
        .unwrap();
    // Drawn after the mark, committed after the raise: above the floor.
    sender.batch_execute("BEGIN").await.unwrap();
    let late = send(&mut sender, SendOptions::default()).await;
    queue::advance_floors(&mut conn, mark, Duration::ZERO)
        .await
        .unwrap();
    sender.batch_execute("COMMIT").await.unwrap();
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![late]);
}

#[tokio::test]
async fn a_job_deferred_past_the_horizon_is_fetched_once_due_after_the_next_run() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let later = send(
        &mut conn,
        SendOptions::default().with_start_after(Duration::from_secs(3600)),
    )
    .await;
    let now = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![now]);
    // Not due within the horizon: the floor passes it.
    let mark = advance_twice(&mut conn).await;
    // It comes due (the clock moved, as far as the job can tell).
    diesel::sql_query("UPDATE jobs SET start_after = now() WHERE id = $1")
        .bind::<Text, _>(later.to_string())
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![], "below the floor");
    // The next run, one that does not walk below the floors, finds it among
    // the jobs that were not due when they became ready.
    let mark = queue::advance_floors(&mut conn, Some(mark), Duration::ZERO)
        .await
        .unwrap();
    assert!(mark.is_some());
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![later]);
}

#[tokio::test]
async fn a_job_ready_again_goes_to_the_back_of_its_lane_above_the_floor() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let a = send(&mut conn, SendOptions::default()).await;
    let b = send(&mut conn, SendOptions::default()).await;
    let fetched = queue::fetch(&mut conn, &[QUEUE.to_owned()], 1)
        .await
        .unwrap();
    assert_eq!(fetched[0].id, a);
    // Every lane's floor is raised past b, then a is given back.
    advance_twice(&mut conn).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![b]);
    advance_twice(&mut conn).await;
    queue::retry_now(&mut conn, a, fetched[0].attempt)
        .await
        .unwrap();
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![a]);
}

#[derive(diesel::QueryableByName)]
struct Floor {
    #[diesel(sql_type = BigInt)]
    floor: i64,
}

async fn floor_of_the_lane(conn: &mut AsyncPgConnection) -> i64 {
    let row: Floor = diesel::sql_query("SELECT floor FROM job_lanes WHERE queue = $1")
        .bind::<Text, _>(QUEUE)
        .get_result(conn)
        .await
        .unwrap();
    row.floor
}

#[tokio::test]
async fn a_run_with_an_older_mark_leaves_a_higher_floor_where_it_is() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let first = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![first]);
    // Worker B's run: its mark, then it loses the lock for a while.
    let older = queue::advance_floors(&mut conn, None, Duration::ZERO)
        .await
        .unwrap();
    let second = send(&mut conn, SendOptions::default()).await;
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![second]);
    // Worker A raises the floor past both.
    advance_twice(&mut conn).await;
    let raised = floor_of_the_lane(&mut conn).await;
    // B's next run, with its older mark: nothing is ready below the floor, so
    // the floor stays (before: pulled down to B's mark, and back up by A).
    queue::advance_floors(&mut conn, older, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(floor_of_the_lane(&mut conn).await, raised);
}

#[tokio::test]
async fn an_idle_lane_keeps_its_floor_and_a_lane_worked_lately_is_raised() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let a = send(&mut conn, SendOptions::default()).await;
    let fetched = queue::fetch(&mut conn, &[QUEUE.to_owned()], 1)
        .await
        .unwrap();
    assert_eq!(fetched[0].id, a);
    queue::complete(&mut conn, a, fetched[0].attempt, None)
        .await
        .unwrap();
    // The last raise long ago; a is finished within the window of a 10 s
    // interval: the lane was worked lately, so the runs raise it.
    diesel::sql_query("UPDATE job_lanes SET floor_at = now() - interval '1 hour'")
        .execute(&mut conn)
        .await
        .unwrap();
    let every = Duration::from_secs(10);
    let mark = queue::advance_floors(&mut conn, None, every).await.unwrap();
    // The sequence moves on elsewhere.
    send_elsewhere(&mut conn).await;
    let mark = queue::advance_floors(&mut conn, mark, every).await.unwrap();
    let raised = floor_of_the_lane(&mut conn).await;
    assert!(raised > 0, "the lane worked lately was not raised");

    // Nothing of the lane leased or finished within the window, nothing ready:
    // the runs leave its row alone however far the sequence moves.
    long_ago(&mut conn).await;
    diesel::sql_query("UPDATE job_lanes SET floor_at = now() - interval '1 hour'")
        .execute(&mut conn)
        .await
        .unwrap();
    let mut mark = mark;
    for _ in 0..2 {
        send_elsewhere(&mut conn).await;
        mark = queue::advance_floors(&mut conn, mark, every).await.unwrap();
    }
    assert_eq!(floor_of_the_lane(&mut conn).await, raised);
}

#[derive(diesel::QueryableByName)]
struct Parked {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    parked: bool,
}

async fn lane_parked(conn: &mut AsyncPgConnection) -> bool {
    let row: Parked = diesel::sql_query("SELECT parked FROM job_lanes WHERE queue = $1")
        .bind::<Text, _>(QUEUE)
        .get_result(conn)
        .await
        .unwrap();
    row.parked
}

async fn lane_reads_of_a_fetch(conn: &mut AsyncPgConnection) -> (i64, Vec<JobId>) {
    ready_index_by_a_fetch(conn, "pg_stat_get_xact_numscans").await
}

/// The transaction that wrote the lane's row last.
async fn lane_version(conn: &mut AsyncPgConnection) -> i64 {
    let row: Walked =
        diesel::sql_query("SELECT xmin::text::bigint AS n FROM job_lanes WHERE queue = $1")
            .bind::<Text, _>(QUEUE)
            .get_result(conn)
            .await
            .unwrap();
    row.n
}

/// Makes every finished job of the lane finished long ago: the lane was not
/// worked lately.
async fn long_ago(conn: &mut AsyncPgConnection) {
    diesel::sql_query(
        "UPDATE jobs SET completed_at = now() - interval '1 hour' WHERE queue = 'floors'",
    )
    .execute(conn)
    .await
    .unwrap();
    // A job without a singleton key is completed by its closure.
    diesel::sql_query(
        "UPDATE job_closures SET closed_at = now() - interval '1 hour' WHERE queue = 'floors'",
    )
    .execute(conn)
    .await
    .unwrap();
}

#[tokio::test]
async fn an_idle_lane_is_parked_the_fetch_skips_it_and_what_makes_a_job_ready_wakes_it() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let every = Duration::from_secs(10);
    let a = send(&mut conn, SendOptions::default()).await;
    let fetched = queue::fetch(&mut conn, &[QUEUE.to_owned()], 1)
        .await
        .unwrap();
    queue::complete(&mut conn, a, fetched[0].attempt, None)
        .await
        .unwrap();
    // Worked lately: the run leaves the lane awake, and a fetch reads it.
    let mark = queue::advance_floors(&mut conn, None, every).await.unwrap();
    assert!(
        !lane_parked(&mut conn).await,
        "a lane worked lately was parked"
    );
    // (A session of its own: one that fetched from the lane reads it from
    // where it left it, and then from its floor.)
    assert_eq!(
        lane_reads_of_a_fetch(&mut db.conn().await).await,
        (1, vec![])
    );

    // Nothing ready, nothing leased, nothing finished within the window: parked,
    // and a fetch of its queue reads no lane.
    long_ago(&mut conn).await;
    let mark = queue::advance_floors(&mut conn, mark, every).await.unwrap();
    assert!(lane_parked(&mut conn).await, "an idle lane was not parked");
    assert_eq!(
        lane_reads_of_a_fetch(&mut db.conn().await).await,
        (0, vec![])
    );
    // Parked once, not again on every run.
    let parked_by = lane_version(&mut conn).await;
    send_elsewhere(&mut conn).await;
    let mark = queue::advance_floors(&mut conn, mark, every).await.unwrap();
    assert_eq!(
        lane_version(&mut conn).await,
        parked_by,
        "a parked lane was written again"
    );

    // A send wakes its lane: the job is fetched at once, with no run between.
    // (b fails for good: a failure writes its row, which the operator's UPDATE
    // below sets back; a completion writes only a closure.)
    let b = send(&mut conn, SendOptions::default().with_retry_limit(0)).await;
    assert!(!lane_parked(&mut conn).await, "a send left its lane parked");
    let fetched = queue::fetch(&mut conn, &[QUEUE.to_owned()], 1)
        .await
        .unwrap();
    assert_eq!(fetched[0].id, b);
    queue::fail(
        &mut conn,
        b,
        fetched[0].attempt,
        "for good",
        FailKind::Transient,
    )
    .await
    .unwrap();

    // A job ready again (here an operator's UPDATE of a finished job) wakes it.
    long_ago(&mut conn).await;
    let mark = queue::advance_floors(&mut conn, mark, every).await.unwrap();
    assert!(lane_parked(&mut conn).await);
    diesel::sql_query(
        "UPDATE jobs SET state = 'retry', start_after = now(), completed_at = NULL WHERE id = $1",
    )
    .bind::<Text, _>(b.to_string())
    .execute(&mut conn)
    .await
    .unwrap();
    let fetched = queue::fetch(&mut conn, &[QUEUE.to_owned()], 1)
        .await
        .unwrap();
    assert_eq!(
        fetched[0].id, b,
        "the job ready again was not fetched at once"
    );
    queue::complete(&mut conn, b, fetched[0].attempt, None)
        .await
        .unwrap();

    // A job scheduled an hour ahead: its send wakes the lane, the next run parks
    // it again (nothing due within the horizon); once due, the run after wakes it.
    long_ago(&mut conn).await;
    let later = send(
        &mut conn,
        SendOptions::default().with_start_after(Duration::from_secs(3600)),
    )
    .await;
    let mark = queue::advance_floors(&mut conn, mark, every).await.unwrap();
    assert!(
        lane_parked(&mut conn).await,
        "a lane with nothing due stayed awake"
    );
    diesel::sql_query("UPDATE jobs SET start_after = now() WHERE id = $1")
        .bind::<Text, _>(later.to_string())
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        fetch_ids(&mut conn, 1).await,
        vec![],
        "parked until the next run"
    );
    queue::advance_floors(&mut conn, mark, every).await.unwrap();
    assert!(!lane_parked(&mut conn).await);
    assert_eq!(fetch_ids(&mut conn, 1).await, vec![later]);
}

/// Scans one run of the floors started of `jobs` itself (sequential) and of
/// the indexes of leased and of finished jobs.
async fn scans_of_jobs_by_a_run(conn: &mut AsyncPgConnection) -> i64 {
    stat_around(
        conn,
        "pg_stat_get_xact_numscans('jobs'::regclass) \
         + pg_stat_get_xact_numscans('job_claims_tenant_lease_idx'::regclass) \
         + pg_stat_get_xact_numscans('jobs_completed_idx'::regclass)",
        "SELECT idemstage_advance_floors(NULL, 3000, 2000)".to_owned(),
    )
    .await
}

#[tokio::test]
async fn a_run_reads_the_busy_lanes_once_however_many_lanes_are_idle() {
    const LANES: i64 = 40;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // LANES idle lanes (one job each, finished an hour ago) and one busy lane
    // (a job finished now).
    diesel::sql_query(format!(
        "INSERT INTO jobs (id, queue, payload, tenant_id, state, completed_at) \
         SELECT lpad(g::text, 26, '0'), 'floors', '{{}}'::jsonb, 't' || g, 'completed', \
                CASE WHEN g = 0 THEN now() ELSE now() - interval '1 hour' END \
           FROM generate_series(0, {LANES}) g"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    // The busy lanes read once: two scans (the leases, the finished jobs),
    // plus one per lane if the planner probes a lane for its first ready job
    // by a sequential scan. Before, each lane without a ready job read every
    // lease and every job finished within the window again.
    let scans = scans_of_jobs_by_a_run(&mut conn).await;
    assert!(
        scans <= LANES + 1 + 2,
        "one run of the floors over {} lanes scanned jobs {scans} times",
        LANES + 1
    );
    let parked: Walked = diesel::sql_query("SELECT count(*) AS n FROM job_lanes WHERE parked")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        parked.n, LANES,
        "the idle lanes are parked, the busy one is not"
    );
}

/// A completed job's entry stays in the ready index until the retention (it
/// ends by a closure), so a run must not read a lane's entries below its
/// floor to find the deferred jobs that came due there: those are in
/// `jobs_deferred_idx`. The run read every completed entry of the lane, with
/// the planner's generic plan of `min(ready_seq)` walking the ready index
/// (over a second a run, every second, after twenty minutes at 200 jobs/s).
#[tokio::test]
async fn a_run_reads_no_completed_entry_below_the_floor() {
    const DONE: usize = 3000;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // Jobs deferred past the horizon (the deferred index is not empty, as in a
    // service with retries), then jobs worked to their end.
    let later = SendOptions::default().with_start_after(Duration::from_secs(3600));
    let deferred: Vec<JobToSend> = (0..DONE).map(|_| job(later.clone())).collect();
    queue::send_batch(&mut conn, &deferred).await.unwrap();
    let jobs: Vec<JobToSend> = (0..DONE).map(|_| job(SendOptions::default())).collect();
    queue::send_batch(&mut conn, &jobs).await.unwrap();
    let fetched = queue::fetch(&mut conn, &[QUEUE.to_owned()], DONE as u32)
        .await
        .unwrap();
    assert_eq!(fetched.len(), DONE);
    let tokens: Vec<(JobId, i32)> = fetched.iter().map(|j| (j.id, j.attempt)).collect();
    queue::complete_many(&mut conn, &tokens).await.unwrap();
    conn.batch_execute("ANALYZE jobs; ANALYZE job_claims; ANALYZE job_closures")
        .await
        .unwrap();
    let mark: Walked =
        diesel::sql_query("SELECT idemstage_advance_floors(NULL, 3000, 0, true) AS n")
            .get_result(&mut conn)
            .await
            .unwrap();
    send_elsewhere(&mut conn).await;
    // The raise: the floor passes the completed entries. Then the plan a
    // worker's session keeps after a few runs: a generic one.
    entries_read_by_a_run(&mut conn, mark.n, false).await;
    conn.batch_execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
    let read = entries_read_by_a_run(&mut conn, mark.n, false).await;
    assert!(read <= 4, "a run read {read} index entries");
}

#[tokio::test]
async fn a_lane_gone_idle_is_asked_for_a_lease_among_its_latest_claims_only() {
    const DONE: usize = 300;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // A lane worked to its end: every claim closed, each deadline still ahead
    // (a completion writes a closure, not the claim), the floor raised past
    // them while the lane was busy.
    let jobs: Vec<JobToSend> = (0..DONE).map(|_| job(SendOptions::default())).collect();
    queue::send_batch(&mut conn, &jobs).await.unwrap();
    let fetched = queue::fetch(&mut conn, &[QUEUE.to_owned()], DONE as u32)
        .await
        .unwrap();
    let tokens: Vec<(JobId, i32)> = fetched.iter().map(|j| (j.id, j.attempt)).collect();
    queue::complete_many(&mut conn, &tokens).await.unwrap();
    let mark: Walked =
        diesel::sql_query("SELECT idemstage_advance_floors(NULL, 3000, 0, true) AS n")
            .get_result(&mut conn)
            .await
            .unwrap();
    send_elsewhere(&mut conn).await;
    entries_read_by_a_run(&mut conn, mark.n, false).await;
    // Nothing finished within the window any more: the run asks the lane for
    // an open claim, from its latest deadline back, and finds none. It reads
    // the latest few, not every claim whose deadline is still ahead (before
    // migration 2026-12-05-220000 it read all 300, on every run while the
    // lane was idle: up to a lease's length of the lane's claims).
    long_ago(&mut conn).await;
    let claims_read = stat_around(
        &mut conn,
        "pg_stat_get_xact_tuples_returned('job_claims_tenant_lease_idx'::regclass) \
         + pg_stat_get_xact_tuples_returned('job_claims_lease_idx'::regclass)",
        format!(
            "SELECT idemstage_advance_floors({}, 3000, 0, false)",
            mark.n
        ),
    )
    .await;
    assert!(
        claims_read <= 70,
        "a run read {claims_read} claims of the idle lane"
    );
    assert!(lane_parked(&mut conn).await, "an idle lane was not parked");
}
