//! The fetch keeps one generic plan per session, made on its first call: made
//! while `jobs` was empty, it must still read a lane by its index once the
//! table has grown (migration `2026-12-05-070000_fetch_plans_by_index`).

use diesel::sql_types::BigInt;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_testkit::TestDb;

use crate::support::stat_around;

#[derive(diesel::QueryableByName, Debug)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn run(conn: &mut AsyncPgConnection, sql: &str) {
    diesel::sql_query(sql).execute(conn).await.unwrap();
}

#[tokio::test]
async fn a_fetch_planned_on_an_empty_table_reads_a_grown_lane_by_its_index() {
    const GROWN: i64 = 3_000;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // Statistics of an empty table, as after a new install or an emptied one.
    run(&mut conn, "VACUUM ANALYZE jobs").await;
    run(&mut conn, "VACUUM ANALYZE job_lanes").await;
    // The first fetch of this session makes its plans: one job in the lane.
    run(
        &mut conn,
        "INSERT INTO jobs (id, queue, payload) VALUES ('00000000000000000000000001', 'q', '{}')",
    )
    .await;
    run(&mut conn, "SELECT * FROM idemstage_fetch(ARRAY['q'], 1)").await;
    // The lane grows; no ANALYZE comes.
    run(
        &mut conn,
        &format!(
            "INSERT INTO jobs (id, queue, payload) \
             SELECT lpad(g::text, 26, '0'), 'q', '{{}}' FROM generate_series(2, {GROWN} + 1) g"
        ),
    )
    .await;
    // Rows of `jobs` read by sequential scans.
    let scanned = stat_around(
        &mut conn,
        "pg_stat_get_xact_tuples_returned('jobs'::regclass)",
        "SELECT * FROM idemstage_fetch(ARRAY['q'], 1)".to_owned(),
    )
    .await;
    assert!(
        scanned < 100,
        "a fetch read {scanned} rows of jobs by sequential scans (of {GROWN} in its lane)"
    );
    let fetched: N =
        diesel::sql_query("SELECT count(*) AS n FROM job_states WHERE state = 'active'")
            .get_result(&mut conn)
            .await
            .unwrap();
    assert_eq!(fetched.n, 2, "both fetches leased a job");
}
