//! `idemstage signal` with worker processes: an infeasible item waits for a
//! person's review (`worker --review-infeasible-s`), holding no job; the review
//! is delivered once (a second delivery is reported, nothing changed), to its
//! tenant only; a waiting item can be cancelled, and a signal after that is
//! refused.

use std::process::Output;

use crate::support::{count, send, stdout_json, wait_until, Workers};
use idemstage::{ids::ItemId, ids::TenantId};

fn idemstage(url: &str, args: &[&str]) -> Output {
    crate::support::idemstage_as(url, "reviewer-anna", args)
}

#[tokio::test]
async fn an_infeasible_item_waits_for_its_review_which_is_delivered_once_to_its_tenant_only() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let t1 = TenantId::parse("t1").unwrap();
    let (fine, rejected, cancelled) = (ItemId::new(), ItemId::new(), ItemId::new());
    send(&mut conn, &t1, fine, "3 Stk Schrauben").await;
    send(&mut conn, &t1, rejected, "5 Kisten Bier").await;
    send(&mut conn, &t1, cancelled, "2 Fass Wein").await;
    let mut workers = Workers::start(db.url(), 2, &["--review-infeasible-s", "3600"]);
    let check = wait_until(db.url(), "two items waiting for review", 120, |c| {
        c.is_quiet() && c.waiting == 2
    })
    .await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    // Waiting holds no job and no lease.
    let waiting = "SELECT 1 FROM stage_runs WHERE stage = 'feasibility' AND status = 'waiting' \
                    AND lease_expires_at <= clock_timestamp()";
    assert_eq!(count(&mut conn, waiting).await, 2);
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM job_states WHERE state IN ('created', 'retry', 'active')"
        )
        .await,
        0
    );

    let (rejected_s, cancelled_s) = (rejected.to_string(), cancelled.to_string());
    // inspect says what it waits for.
    let timeline = stdout_json(&idemstage(
        db.url(),
        &["inspect", "--tenant", "t1", "--item", &rejected_s, "--json"],
    ));
    let feasibility = timeline["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "feasibility")
        .unwrap();
    assert_eq!(feasibility["status"], "waiting", "{timeline}");
    assert_eq!(feasibility["wait"]["signal"], "review", "{timeline}");
    assert_eq!(feasibility["wait"]["on_timeout"], "resume", "{timeline}");
    let review = |tenant: &str, item: &str, signal: &str, payload: &str| {
        idemstage(
            db.url(),
            &[
                "signal",
                "--tenant",
                tenant,
                "--item",
                item,
                "--stage",
                "feasibility",
                "--signal",
                signal,
                "--payload",
                payload,
                "--json",
            ],
        )
    };
    // Bad input and the wrong tenant or signal: exit 2, nothing changed.
    let audit = "SELECT 1 FROM audit_log WHERE action LIKE 'operator.%'";
    for (out, message) in [
        (
            review("t2", &rejected_s, "review", "{}"),
            "not found for tenant t2",
        ),
        (
            review("t1", &rejected_s, "payment", "{}"),
            "waits for signal review",
        ),
        (review("t1", &rejected_s, "review", "{not json"), "not JSON"),
        (
            review("t1", &rejected_s, "Review!", "{}"),
            "invalid signal name",
        ),
    ] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(message), "{stderr}");
    }
    // A retry or a rerun of the waiting stage changes nothing and says why.
    for command in ["retry", "rerun"] {
        let out = idemstage(
            db.url(),
            &[
                command,
                "--tenant",
                "t1",
                "--item",
                &rejected_s,
                "--stage",
                "feasibility",
            ],
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        assert!(
            stdout.contains("is waiting (its signal or its deadline runs it again)"),
            "{command}: {stdout}"
        );
    }
    assert_eq!(count(&mut conn, audit).await, 0);
    assert_eq!(count(&mut conn, waiting).await, 2);

    // The review: rejected. Delivered once; the second is reported.
    let first = stdout_json(&review(
        "t1",
        &rejected_s,
        "review",
        r#"{"approve": false, "note": "we sell no beer"}"#,
    ));
    assert_eq!(first["outcome"], "delivered", "{first}");
    let second = stdout_json(&review("t1", &rejected_s, "review", r#"{"approve": true}"#));
    assert_eq!(second["outcome"], "already_delivered", "{second}");
    assert_eq!(second["actor"], "reviewer-anna", "{second}");
    let check = wait_until(db.url(), "the reviewed item stopped", 60, |c| {
        c.is_quiet() && c.waiting == 1
    })
    .await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    let reviewed = format!(
        "SELECT 1 FROM feasibility_results f WHERE f.item_id = '{rejected}' AND NOT f.feasible \
           AND f.reasons::text LIKE '%rejected by reviewer-anna we sell no beer%'"
    );
    assert_eq!(count(&mut conn, &reviewed).await, 1, "{reviewed}");
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM audit_log WHERE action = 'operator.signal'"
        )
        .await,
        1
    );

    // A waiting item cancelled: its wait ends unanswered; a signal is refused.
    let out = idemstage(
        db.url(),
        &["cancel", "--tenant", "t1", "--item", &cancelled_s, "--json"],
    );
    let cancel = stdout_json(&out);
    assert_eq!(cancel["stages"][0]["from"]["state"], "waiting", "{cancel}");
    let late = review("t1", &cancelled_s, "review", r#"{"approve": true}"#);
    assert_eq!(late.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&late.stderr).contains("cancelled, not waiting"));
    workers.stop_all();
    let check = wait_until(db.url(), "quiet", 60, |c| c.is_quiet()).await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.waiting, 0);
    let _ = fine;
}
