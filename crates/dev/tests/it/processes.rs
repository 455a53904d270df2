//! `idemstage worker` as real OS processes against one database: duplicated sends,
//! a SIGKILL mid-run, a SIGTERM for a clean stop. Checked afterwards with SQL only.

use crate::support::{
    assert_quiet_and_sound, count, enqueue, signal, wait_exit, wait_until, Workers,
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
