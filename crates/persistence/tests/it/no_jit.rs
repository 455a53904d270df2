//! The periodic statements whose estimated cost grows with the tables run
//! without JIT: past `jit_above_cost` the server compiles such a statement on
//! every call (0.4-2.8 s a call of the reconciler's plan in the idle_in_tx
//! pressure cell, for a statement that runs in milliseconds).

use diesel::sql_types::Text;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{RepoError, StageName};
use idemstage_persistence::{reconcile, tenant};
use idemstage_testkit::TestDb;

use crate::support::*;

#[derive(diesel::QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    value: String,
}

async fn jit(conn: &mut AsyncPgConnection) -> Result<String, diesel::result::Error> {
    let row: Setting = diesel::sql_query("SELECT current_setting('jit') AS value")
        .get_result(conn)
        .await?;
    Ok(row.value)
}

#[tokio::test]
async fn the_reconcilers_plan_runs_without_jit() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let item = new_item(&mut conn, &t).await;
    let stages = reconcile::ReconciledStages::line(
        vec![
            StageName::parse("first").unwrap(),
            StageName::parse("second").unwrap(),
        ],
        false,
    );
    assert_eq!(jit(&mut conn).await.unwrap(), "on", "the server's default");
    let (plan, inside) = tenant::transaction(&mut conn, &t, async |conn| {
        let plan = reconcile::plan(conn, &stages, &t, &[item]).await?;
        let inside = jit(conn).await?;
        Ok::<_, RepoError>((plan, inside))
    })
    .await
    .unwrap();
    assert_eq!(plan.lost.len(), 1, "the first stage has no job: sent again");
    assert_eq!(inside, "off");
    assert_eq!(
        jit(&mut conn).await.unwrap(),
        "on",
        "for its transaction only"
    );
}

/// Whether the function `name` of `arguments` arguments is set `jit=off`, and
/// its settings.
async fn set_without_jit(
    conn: &mut AsyncPgConnection,
    name: &str,
    arguments: i32,
) -> (bool, String) {
    let row: Setting = diesel::sql_query(format!(
        "SELECT coalesce(array_to_string(proconfig, ','), '') AS value FROM pg_proc \
          WHERE proname = '{name}' AND pronargs = {arguments}"
    ))
    .get_result(conn)
    .await
    .unwrap();
    (row.value.split(',').any(|s| s == "jit=off"), row.value)
}

#[tokio::test]
async fn the_floors_run_runs_without_jit() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let (off, settings) = set_without_jit(&mut conn, "idemstage_advance_floors", 4).await;
    assert!(off, "the floors' run is set {settings:?}");
}

/// The fetch's functions: each entry's probe of `job_claims` (migration
/// `2026-12-05-090000_job_claims`) raises their estimated cost past
/// `jit_above_cost`, and a prototype's fetch was compiled on every call (230 ms).
#[tokio::test]
async fn the_fetch_runs_without_jit() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for function in [
        "idemstage_fetch",
        "idemstage_fetch_queues",
        "idemstage_fetch_plain",
        "idemstage_fetch_controlled",
    ] {
        let (off, settings) = set_without_jit(&mut conn, function, 2).await;
        assert!(off, "{function} is set {settings:?}");
    }
}
