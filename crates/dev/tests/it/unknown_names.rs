//! Commands that name a stage or a tenant nobody has: `pause`, `resume`, `limit`
//! and `dead` refuse them (exit 2, one clear line) and change nothing, as the
//! console refuses them with 404. A stage is known if the pipeline has it; a
//! tenant once it has registered an item (the console's rule).

use std::process::{Command, Output};

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::{ids::ItemId, ids::TenantId};

fn idemstage(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "error")
        .output()
        .expect("run idemstage")
}

/// Every row of the tables a control, a send or an operator command writes.
async fn snapshot(conn: &mut AsyncPgConnection) -> String {
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    diesel::sql_query(
        "SELECT concat_ws(' # ',
             (SELECT string_agg(c::text, '|' ORDER BY queue, scope) FROM queue_controls c),
             (SELECT string_agg(h::text, '|' ORDER BY id) FROM queue_control_changes h),
             (SELECT string_agg(b::text, '|' ORDER BY queue) FROM queue_buckets b),
             (SELECT string_agg(a::text, '|' ORDER BY id) FROM items a),
             (SELECT string_agg(j::text, '|' ORDER BY id) FROM job_states j),
             (SELECT string_agg(l::text, '|' ORDER BY id) FROM audit_log l)) AS s",
    )
    .get_result::<S>(conn)
    .await
    .unwrap()
    .s
}

/// Item 10 of issue 29: `pause --stage extrakt` (a typo) exited 0 and wrote a
/// control row that paused nothing; `limit` on an unknown stage, `pause`,
/// `resume` and `limit` of an unknown tenant, and `dead --stage/--tenant` with
/// unknown values exited 0 too.
#[tokio::test]
async fn unknown_stages_and_tenants_are_refused_with_exit_2_and_change_nothing() {
    let db = idemstage_harness::example::db().await;
    let url = db.url();
    let mut conn = db.conn().await;
    // t1 is known: it has an item. nobody has none.
    let t1 = TenantId::parse("t1").unwrap();
    idemstage_harness::example::send(&mut conn, &t1, ItemId::new(), "1 Stk").await;

    let before = snapshot(&mut conn).await;
    let stage = "unknown stage \"extrakt\"";
    let tenant = "unknown tenant nobody";
    for (args, message) in [
        (&["pause", "--stage", "extrakt"][..], stage),
        (
            &["pause", "--stage", "extrakt", "--tenant", "t1"][..],
            stage,
        ),
        (&["resume", "--stage", "extrakt"][..], stage),
        (
            &["limit", "--stage", "extrakt", "--max-active", "2"][..],
            stage,
        ),
        (
            &["limit", "--stage", "extrakt", "--every-tenant"][..],
            stage,
        ),
        (&["limit", "--stage", "extrakt", "--show"][..], stage),
        (&["dead", "--stage", "extrakt"][..], stage),
        (
            &["pause", "--stage", "extract", "--tenant", "nobody"][..],
            tenant,
        ),
        (
            &["resume", "--stage", "extract", "--tenant", "nobody"][..],
            tenant,
        ),
        (
            &[
                "limit",
                "--stage",
                "extract",
                "--tenant",
                "nobody",
                "--max-active",
                "1",
            ][..],
            tenant,
        ),
        (&["dead", "--tenant", "nobody"][..], tenant),
        (
            &["dead", "--tenant", "nobody", "--stage", "extract"][..],
            tenant,
        ),
    ] {
        let out = idemstage(url, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(stderr.contains("nothing was changed"), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
    }
    // The stage's list is named, so that a typo is easy to mend.
    let out = idemstage(url, &["pause", "--stage", "extrakt"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("intake, extract, feasibility, calculate"),
        "{stderr}"
    );
    assert_eq!(snapshot(&mut conn).await, before, "a refused command wrote");

    // The same commands on a known stage and tenant work.
    for args in [
        &["pause", "--stage", "extract", "--tenant", "t1"][..],
        &["resume", "--stage", "extract", "--tenant", "t1"][..],
        &[
            "limit",
            "--stage",
            "extract",
            "--tenant",
            "t1",
            "--max-active",
            "1",
        ][..],
        &["limit", "--stage", "extract", "--show"][..],
        &["dead", "--tenant", "t1", "--stage", "extract"][..],
        &["pause", "--stage", "calculate"][..],
    ] {
        let out = idemstage(url, args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let controls = idemstage_testkit::count(&mut conn, "SELECT 1 FROM queue_controls").await;
    assert_eq!(controls, 2, "extract for t1, calculate");
}
