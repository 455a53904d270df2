//! `idemstage worker` as real OS processes against one database: duplicated sends,
//! a SIGKILL mid-run, a SIGTERM for a clean stop. Checked afterwards with SQL only.

use crate::support::{
    assert_quiet_and_sound, count, enqueue, idemstage_as, signal, stdout_json, wait_exit,
    wait_until, Workers,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_worker_processes_one_killed_lose_nothing_and_run_nothing_twice() {
    let db = idemstage_harness::example::db().await;
    enqueue(db.url(), 60).await;
    let mut workers = Workers::start(db.url(), 3, &["--crash-rate", "0.05"]);
    // Kill one worker with SIGKILL once work is under way (it holds claims and jobs).
    wait_until(db.url(), "first successes", 60, |c| {
        c.stages_succeeded >= 20
    })
    .await;
    let mut killed = workers.children.remove(0);
    killed.kill().unwrap();
    killed.wait().unwrap();
    let check = assert_quiet_and_sound(db.url(), 120).await;
    workers.stop_all();
    assert_eq!(check.items, 60);
    assert_eq!(check.stages_succeeded, 60 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stops_cleanly_on_sigterm() {
    let db = idemstage_harness::example::db().await;
    enqueue(db.url(), 10).await;
    let mut w = Workers::start(db.url(), 1, &[]);
    wait_until(db.url(), "work under way", 60, |c| c.stages_succeeded >= 1).await;
    signal(&w.children[0], "-TERM");
    let status = wait_exit(&mut w.children[0], 30);
    assert!(status.success(), "{status:?}");
    // Whatever it had in flight was finished or released, never left claimed.
    let mut conn = db.conn().await;
    let running = count(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE status = 'running' AND lease_expires_at > now()",
    )
    .await;
    assert_eq!(running, 0);
}

/// The seed pipeline with a fan-out (`worker --fan-out`: feasibility per
/// position, calculate gathering) on three worker processes, two SIGKILLed
/// mid-run and replaced, bodies crashing at 5 %: every position checked once,
/// every item's gather once, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_on_worker_processes_killed_mid_run_runs_each_child_and_gather_once() {
    let db = idemstage_harness::example::db().await;
    enqueue(db.url(), 40).await;
    let pipeline = idemstage_example::fan_out_pipeline(
        idemstage_example::Chaos::default(),
        idemstage::stage::StagePolicy::default(),
    )
    .unwrap();
    let mut workers = Workers::start(db.url(), 3, &["--fan-out", "--crash-rate", "0.05"]);
    let mut conn = db.conn().await;
    for (kill, children_done) in [(0, 10), (1, 40)] {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
        while count(
            &mut conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'feasibility' AND status = 'success'",
        )
        .await
            < children_done
        {
            assert!(tokio::time::Instant::now() < deadline, "no progress");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        workers.kill_and_replace(kill);
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(180);
    let check = loop {
        let check = idemstage_testkit::check_pipeline(&mut conn, &pipeline)
            .await
            .unwrap();
        if check.is_quiet() {
            break check;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not quiet: {check:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    workers.assert_all_alive();
    workers.stop_all();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    // 40 items of two positions each: 80 children, each checked once (the
    // checker counts a second success on the same input as a double execution).
    assert_eq!(check.items, 40 + 80);
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM fanouts WHERE children = 2 AND final_children = 2 AND superseded_at IS NULL").await,
        40
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'feasibility' AND status = 'success'"
        )
        .await,
        80
    );
    // Every item priced, once (its gather's one success; every text is feasible).
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM stage_runs WHERE stage = 'calculate' AND status = 'success' AND success_attempt = attempts").await,
        40
    );
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM calculation_results").await,
        40
    );
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM stage_runs r JOIN fanout_children c ON c.item_id = r.item_id WHERE r.stage <> 'feasibility'").await,
        0
    );
    // `idemstage inspect` shows a parent's fan-out with its children's ends,
    // and a child's parent.
    #[derive(diesel::QueryableByName)]
    struct Child {
        #[diesel(sql_type = diesel::sql_types::Text)]
        tenant_id: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        item_id: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        parent_item: String,
    }
    use diesel_async::RunQueryDsl;
    let child: Child = diesel::sql_query(
        "SELECT tenant_id, item_id, parent_item FROM fanout_children ORDER BY item_id LIMIT 1",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    let parent = stdout_json(&idemstage_as(
        db.url(),
        "ops",
        &[
            "inspect",
            "--tenant",
            &child.tenant_id,
            "--item",
            &child.parent_item,
            "--json",
        ],
    ));
    let fan_out = &parent["fan_outs"][0];
    assert_eq!(fan_out["stage"], "extract", "{parent}");
    assert_eq!(fan_out["gather_stage"], "calculate", "{parent}");
    assert_eq!(fan_out["final_children"], 2, "{parent}");
    let children = fan_out["children"].as_array().unwrap();
    assert_eq!(children.len(), 2, "{parent}");
    assert!(
        children
            .iter()
            .all(|c| c["outcome"] == "success" && c["final_stage"] == "feasibility"),
        "{parent}"
    );
    assert!(
        children.iter().any(|c| c["item"] == child.item_id.as_str()),
        "{parent}"
    );
    let of_child = stdout_json(&idemstage_as(
        db.url(),
        "ops",
        &[
            "inspect",
            "--tenant",
            &child.tenant_id,
            "--item",
            &child.item_id,
            "--json",
        ],
    ));
    assert_eq!(
        of_child["child_of"]["parent"],
        child.parent_item.as_str(),
        "{of_child}"
    );
    assert_eq!(of_child["fan_outs"], serde_json::json!([]), "{of_child}");
}
