//! `idemstage inspect | retry | cancel | dead` as processes: `--json` outputs,
//! the audit entries with their actor, exit code 2 and nothing changed on bad
//! input.

use std::process::{Command, Output};
use std::sync::Arc;

use diesel_async::AsyncPgConnection;
use idemstage::runs::ClaimRequest;
use idemstage::runs::PgRunRepository;
use idemstage::{ids::ItemId, ids::StageName, ids::TenantId, ids::WorkerId, stage::StagePolicy};
use idemstage_testkit::{count, TestDb};

fn idemstage(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "error")
        .env("USER", "ci-user")
        .output()
        .expect("run idemstage")
}

fn json(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Everything the commands may change, as one text.
async fn snapshot(conn: &mut AsyncPgConnection) -> String {
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    use diesel_async::RunQueryDsl;
    diesel::sql_query(
        "SELECT coalesce((SELECT string_agg(r::text, '|' ORDER BY id) FROM stage_runs r), '')
             || coalesce((SELECT string_agg(j::text, '|' ORDER BY id) FROM job_states j), '')
             || coalesce((SELECT string_agg(l::text, '|' ORDER BY id) FROM audit_log l), '')
             AS s",
    )
    .get_result::<S>(conn)
    .await
    .unwrap()
    .s
}

#[tokio::test]
async fn operator_commands_print_json_record_their_actor_and_refuse_bad_input_with_exit_2() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let (done, queued, dying) = (ItemId::new(), ItemId::new(), ItemId::new());
    let text = idemstage_harness::example::text(1);
    idemstage_harness::example::send(&mut conn, &tenant, done, &text).await;
    let check = {
        let worker = idemstage_harness::example::start_pipeline_worker(
            db.pool(4).await,
            db.url(),
            idemstage_harness::example::pipeline(),
            2,
            Arc::new(idemstage::worker::Counters::default()),
        );
        let check = idemstage_harness::example::assert_quiet_and_sound(db.url(), 60).await;
        idemstage_harness::example::stop_pipeline_worker(worker).await;
        check
    };
    assert_eq!(check.stages_succeeded, 4);
    idemstage_harness::example::send(&mut conn, &tenant, queued, &text).await;
    // A dead intake: one attempt, failed for good.
    idemstage_harness::example::send(&mut conn, &tenant, dying, &text).await;
    let repo = PgRunRepository::new(db.pool(2).await);
    let req = ClaimRequest {
        tenant: tenant.clone(),
        item: dying,
        stage: StageName::parse("intake").unwrap(),
        input_hash: idemstage::ids::input_hash_of(text.as_bytes()),
        worker: WorkerId::generate(),
        policy: StagePolicy::default().with_max_attempts(1),
        upstream: None,
    };
    let idemstage::runs::ClaimOutcome::Claimed {
        run_id, attempt, ..
    } = repo.claim(&req).await.unwrap()
    else {
        panic!("not claimed")
    };
    let token = idemstage::runs::ClaimToken {
        run_id,
        tenant: tenant.clone(),
        item: dying,
        stage: req.stage.clone(),
        attempt,
    };
    repo.fail(&token, "scanner on fire", false).await.unwrap();

    let (done_s, queued_s, dying_s) = (done.to_string(), queued.to_string(), dying.to_string());

    // Bad input: exit 2, one clear line, nothing changed.
    let before = snapshot(&mut conn).await;
    let unknown = ItemId::new().to_string();
    for (args, message) in [
        (
            vec!["inspect", "--tenant", "t1", "--item", "nope"],
            "invalid item id",
        ),
        (
            vec!["inspect", "--tenant", "T 1", "--item", &done_s],
            "invalid tenant id",
        ),
        (
            vec!["inspect", "--tenant", "t2", "--item", &done_s],
            "not found for tenant t2",
        ),
        (
            vec!["retry", "--tenant", "t1", "--item", &unknown],
            "not found for tenant t1",
        ),
        (
            vec![
                "retry", "--tenant", "t1", "--item", &done_s, "--stage", "ocr",
            ],
            "unknown stage",
        ),
        (
            vec![
                "retry", "--tenant", "t1", "--item", &done_s, "--stage", "Intake!",
            ],
            "invalid stage name",
        ),
        (
            vec![
                "retry", "--tenant", "t1", "--item", &done_s, "--stage", "intake",
            ],
            "cannot be retried: it succeeded",
        ),
        (
            vec![
                "retry", "--tenant", "t1", "--item", &queued_s, "--stage", "extract",
            ],
            "has no run of stage extract",
        ),
        (
            vec![
                "retry", "--tenant", "t1", "--item", &dying_s, "--actor", " ",
            ],
            "invalid actor",
        ),
        (
            vec!["cancel", "--tenant", "t1", "--item", &unknown],
            "not found for tenant t1",
        ),
        (vec!["dead", "--stage", "no such"], "invalid stage name"),
    ] {
        let out = idemstage(&db, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(stderr.lines().count() <= 2, "{args:?}: {stderr}");
    }
    assert_eq!(
        snapshot(&mut conn).await,
        before,
        "bad input changed something"
    );

    // inspect: every stage with its attempts, in the pipeline's order.
    let t = json(&idemstage(
        &db,
        &["inspect", "--tenant", "t1", "--item", &done_s, "--json"],
    ));
    let stages: Vec<_> = t["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["stage"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        stages,
        ["intake", "extract", "feasibility", "calculate"],
        "{t}"
    );
    assert_eq!(t["stages"][1]["upstream_stage"], "intake", "{t}");
    assert_eq!(
        t["stages"][1]["attempts_history"][0]["upstream_attempt"], 1,
        "{t}"
    );
    assert_eq!(
        t["stages"][3]["attempts_history"][0]["outcome"], "success",
        "{t}"
    );
    assert!(t["jobs"].as_array().unwrap().len() >= 4, "{t}");
    let q = json(&idemstage(
        &db,
        &["inspect", "--tenant", "t1", "--item", &queued_s, "--json"],
    ));
    assert_eq!(q["not_started"].as_array().unwrap().len(), 4, "{q}");
    assert_eq!(q["jobs"][0]["state"], "created", "{q}");

    // dead: the dead intake with its error.
    let d = json(&idemstage(&db, &["dead", "--tenant", "t1", "--json"]));
    assert_eq!(d["stages"].as_array().unwrap().len(), 1, "{d}");
    assert_eq!(d["stages"][0]["item"], dying_s.as_str(), "{d}");
    assert_eq!(d["stages"][0]["last_error"], "scanner on fire", "{d}");
    assert_eq!(d["jobs"].as_array().unwrap().len(), 0, "{d}");

    // retry: revived with a new job; the actor defaults to $USER.
    let r = json(&idemstage(
        &db,
        &["retry", "--tenant", "t1", "--item", &dying_s, "--json"],
    ));
    assert_eq!(r["outcome"], "retried", "{r}");
    assert_eq!(r["stages"][0]["stage"], "intake", "{r}");
    assert_eq!(r["actor"], "ci-user", "{r}");
    let again = json(&idemstage(
        &db,
        &["retry", "--tenant", "t1", "--item", &dying_s, "--json"],
    ));
    assert_eq!(again["outcome"], "nothing_to_retry", "{again}");

    // cancel: the queued item's intake job and its stage; then status knows it.
    let c = json(&idemstage(
        &db,
        &[
            "cancel", "--tenant", "t1", "--item", &queued_s, "--actor", "alice", "--json",
        ],
    ));
    assert_eq!(c["outcome"], "cancelled", "{c}");
    assert_eq!(c["stages"][0]["stage"], "intake", "{c}");
    assert_eq!(c["stages"][0]["from"]["state"], "queued", "{c}");
    assert_eq!(c["jobs"][0]["state"], "created", "{c}");
    assert_eq!(c["actor"], "alice", "{c}");
    let c2 = json(&idemstage(
        &db,
        &["cancel", "--tenant", "t1", "--item", &queued_s, "--json"],
    ));
    assert_eq!(c2["outcome"], "nothing_to_cancel", "{c2}");
    let s = json(&idemstage(&db, &["status", "--json"]));
    assert!(
        s["stages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["status"] == "cancelled" && r["count"] == 1),
        "{s}"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM audit_log WHERE run_id IS NULL AND (\
                (action = 'operator.retry' AND details->>'actor' = 'ci-user') OR \
                (action = 'operator.cancel' AND details->>'actor' = 'alice'))"
        )
        .await,
        2
    );
    // Text output works too.
    let out = idemstage(&db, &["inspect", "--tenant", "t1", "--item", &queued_s]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("intake: cancelled"));
}
