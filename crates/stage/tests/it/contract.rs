//! The typed stage contract: a stage reads exactly what its run is bound to (the
//! item's input, its upstream's output at the bound attempt), hands on its
//! output, and a prepared value (a paid call) is reused by the next attempt of
//! the same run on the same binding, and only then.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use idemstage_domain::InputChangePolicy;
use idemstage_persistence::runs::ReadBound;
use serde_json::json;

use super::edges::set_input;
use super::*;

fn policy() -> StagePolicy {
    StagePolicy::default()
        .with_on_input_change(InputChangePolicy::Rerun)
        .with_lease(Duration::from_secs(30))
        .with_heartbeat(Duration::from_secs(10))
}

/// The first stage: upper-cases the input in `prepare` (the "paid call"),
/// counting the calls; `commit` fails transiently while `fail_commits` is above
/// zero, then permanently while `refuse_commits` is, and waits for the test if
/// `hold_commit` is set.
#[derive(Default)]
struct Shout {
    calls: AtomicUsize,
    fail_commits: AtomicUsize,
    refuse_commits: AtomicUsize,
    reuse: Option<bool>,
    hold_commit: Option<(Notify, Notify)>,
}

#[async_trait]
impl Stage for Shout {
    const NAME: &'static str = "shout";
    type Input = String;
    type Prepared = String;
    type Output = String;
    fn policy(&self) -> StagePolicy {
        policy().with_reuse_prepared(self.reuse.unwrap_or(true))
    }
    async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<String, StageError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(format!("{}!", ctx.input().to_uppercase()))
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        _: &String,
        shouted: &String,
    ) -> Result<Done<String>, StageError> {
        if let Some((entered, release)) = &self.hold_commit {
            entered.notify_one();
            release.notified().await;
        }
        if self
            .fail_commits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(StageError::Transient("the commit failed".into()));
        }
        if self
            .refuse_commits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(StageError::Permanent("the answer is unusable".into()));
        }
        Ok(Done::next(shouted.clone()))
    }
}

/// The second stage: records what it was handed; `prepare` counts its calls and
/// may wait for the test; `commit` may fail transiently once.
#[derive(Default)]
struct Count {
    seen: Mutex<Vec<String>>,
    calls: AtomicUsize,
    fail_commits: AtomicUsize,
    hold_prepare: Option<(Notify, Notify)>,
}

#[async_trait]
impl Stage for Count {
    const NAME: &'static str = "count";
    type Input = String;
    type Prepared = usize;
    type Output = usize;
    fn policy(&self) -> StagePolicy {
        policy()
    }
    async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<usize, StageError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push(ctx.input().clone());
        if let Some((entered, release)) = &self.hold_prepare {
            entered.notify_one();
            release.notified().await;
        }
        Ok(ctx.input().len())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        _: &String,
        len: &usize,
    ) -> Result<Done<usize>, StageError> {
        if self
            .fail_commits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(StageError::Transient("the commit failed".into()));
        }
        Ok(Done::next(*len))
    }
}

fn pipeline(shout: &Arc<Shout>, count: &Arc<Count>) -> Pipeline {
    Pipeline::builder(shout.clone())
        .then(count.clone())
        .build()
        .unwrap()
}

async fn run(f: &Fixture, pipeline: &Pipeline, stage: &str, job: &StageJob) -> ExecutionOutcome {
    let stage = pipeline.stage(stage).unwrap();
    f.executor().run(pipeline, stage, job).await.unwrap()
}

fn succeeded(outcome: &ExecutionOutcome, attempt: i32) -> bool {
    matches!(outcome, ExecutionOutcome::Succeeded { attempt: a, .. } if *a == attempt)
}

async fn output(f: &mut Fixture, stage: &str) -> Option<serde_json::Value> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Jsonb>)]
        output: Option<serde_json::Value>,
    }
    diesel::sql_query(format!(
        "SELECT output FROM stage_runs WHERE stage = '{stage}'"
    ))
    .get_result::<Row>(&mut f.conn)
    .await
    .unwrap()
    .output
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_are_carried_to_the_next_stage_and_kept_with_their_attempt() {
    let mut f = fixture().await;
    let (shout, counter) = (Arc::new(Shout::default()), Arc::new(Count::default()));
    let pipeline = pipeline(&shout, &counter);
    let job = f.item("hallo welt").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job).await, 1));
    assert!(succeeded(&run(&f, &pipeline, "count", &job).await, 1));
    assert_eq!(*counter.seen.lock().unwrap(), ["HALLO WELT!"]);
    assert_eq!(output(&mut f, "shout").await, Some(json!("HALLO WELT!")));
    assert_eq!(output(&mut f, "count").await, Some(json!(11)));
    // A success leaves no checkpoint behind.
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_checkpoints").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downstream_stage_reads_its_bound_upstream_output_not_a_newer_one() {
    let mut f = fixture().await;
    let shout = Arc::new(Shout::default());
    let count = Arc::new(Count {
        hold_prepare: Some((Notify::new(), Notify::new())),
        ..Count::default()
    });
    let pipeline = pipeline(&shout, &count);
    let job = f.item("eins").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job).await, 1));

    // `count` is claimed on shout's attempt 1 and has read its output ...
    let held = {
        let (exec, pipeline, job) = (f.executor(), pipeline.clone(), job.clone());
        tokio::spawn(async move {
            let stage = pipeline.stage("count").unwrap().clone();
            exec.run(&pipeline, &stage, &job).await.unwrap()
        })
    };
    let (entered, release) = count.hold_prepare.as_ref().unwrap();
    entered.notified().await;
    // ... when shout runs again on a new input and succeeds with a new output.
    let job2 = set_input(&mut f, &job, "zwei").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job2).await, 2));
    release.notify_one();
    // The held attempt computed from "EINS!" and can never commit it (shout's
    // new success made it stale, which fences it).
    let held = held.await.unwrap();
    assert!(
        matches!(
            held,
            ExecutionOutcome::Fenced { attempt: 1 }
                | ExecutionOutcome::UpstreamChanged { attempt: 1 }
        ),
        "{held:?}"
    );
    assert_eq!(output(&mut f, "count").await, None);
    // The next attempt is bound to shout's attempt 2, and reads its output.
    let next = {
        let (exec, pipeline, job) = (f.executor(), pipeline.clone(), job2.clone());
        tokio::spawn(async move {
            let stage = pipeline.stage("count").unwrap().clone();
            exec.run(&pipeline, &stage, &job).await.unwrap()
        })
    };
    entered.notified().await;
    release.notify_one();
    assert!(succeeded(&next.await.unwrap(), 2));
    assert_eq!(*count.seen.lock().unwrap(), ["EINS!", "ZWEI!"]);
    assert_eq!(output(&mut f, "count").await, Some(json!(5)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_whose_bound_upstream_attempt_is_gone_reads_nothing() {
    let mut f = fixture().await;
    let (shout, counter) = (Arc::new(Shout::default()), Arc::new(Count::default()));
    let pipeline = pipeline(&shout, &counter);
    let job = f.item("eins").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job).await, 1));
    // `count` claimed by hand on shout's attempt 1 ...
    let claimed = f
        .repo
        .claim(&ClaimRequest {
            tenant: job.tenant_id.clone(),
            item: job.item_id,
            stage: StageName::parse("count").unwrap(),
            input_hash: job.input_hash.clone(),
            worker: WorkerId::generate(),
            policy: policy(),
            upstream: Some(StageName::parse("shout").unwrap()),
        })
        .await
        .unwrap();
    let ClaimOutcome::Claimed {
        run_id, attempt, ..
    } = claimed
    else {
        panic!("{claimed:?}")
    };
    let token = idemstage_domain::ClaimToken {
        run_id,
        tenant: job.tenant_id.clone(),
        item: job.item_id,
        stage: StageName::parse("count").unwrap(),
        attempt,
    };
    assert!(matches!(
        f.repo.read_bound(&token, true).await.unwrap(),
        ReadBound::Read { input: idemstage_persistence::runs::BoundInput::UpstreamOutput(v), .. } if v == json!("EINS!")
    ));
    // ... then shout succeeds again: the bound output is no longer there to read.
    let job2 = set_input(&mut f, &job, "zwei").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job2).await, 2));
    assert_eq!(
        f.repo.read_bound(&token, true).await.unwrap(),
        ReadBound::UpstreamMoved
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paid_call_is_reused_by_the_next_attempt_after_a_failed_commit() {
    let mut f = fixture().await;
    let shout = Arc::new(Shout {
        fail_commits: AtomicUsize::new(1),
        ..Shout::default()
    });
    let pipeline = pipeline(&shout, &Arc::new(Count::default()));
    let job = f.item("teuer").await;
    assert!(matches!(
        run(&f, &pipeline, "shout", &job).await,
        ExecutionOutcome::Failed {
            attempt: 1,
            dead: false,
            ..
        }
    ));
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_checkpoints WHERE prepared = '\"TEUER!\"'"
        )
        .await,
        1
    );
    assert!(succeeded(&run(&f, &pipeline, "shout", &job).await, 2));
    assert_eq!(
        AtomicUsize::load(&shout.calls, Ordering::SeqCst),
        1,
        "paid once"
    );
    assert_eq!(output(&mut f, "shout").await, Some(json!("TEUER!")));
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_checkpoints").await,
        0
    );
}

/// A commit that refuses the prepared value itself (a permanent error) ends the
/// run `dead` and throws the value away: an operator's retry pays for a new one
/// instead of failing on the same value again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_value_refused_for_good_is_not_reused_by_an_operators_retry() {
    let mut f = fixture().await;
    let shout = Arc::new(Shout {
        refuse_commits: AtomicUsize::new(1),
        ..Shout::default()
    });
    let pipeline = pipeline(&shout, &Arc::new(Count::default()));
    let job = f.item("teuer").await;
    assert!(matches!(
        run(&f, &pipeline, "shout", &job).await,
        ExecutionOutcome::Failed {
            attempt: 1,
            dead: true,
            ..
        }
    ));
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_checkpoints").await,
        0,
        "a value refused for good is not kept"
    );
    let retried = idemstage::ops::retry(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        None,
        &idemstage::ops::Actor::parse("ops-bot").unwrap(),
        &pipeline,
    )
    .await
    .unwrap();
    assert!(
        matches!(retried, idemstage::ops::RetryOutcome::Retried { .. }),
        "{retried:?}"
    );
    assert!(succeeded(&run(&f, &pipeline, "shout", &job).await, 2));
    assert_eq!(
        AtomicUsize::load(&shout.calls, Ordering::SeqCst),
        2,
        "the retry paid for a new value"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paid_call_is_reused_after_the_worker_died_between_prepare_and_commit() {
    let mut f = fixture().await;
    let shout = Arc::new(Shout {
        hold_commit: Some((Notify::new(), Notify::new())),
        ..Shout::default()
    });
    let pipeline = pipeline(&shout, &Arc::new(Count::default()));
    let job = f.item("teuer").await;
    // A worker prepared (paid) and is in its commit when it dies: its
    // transaction is gone with it, and its lease runs out.
    let dying = {
        let (exec, pipeline, job) = (f.executor(), pipeline.clone(), job.clone());
        tokio::spawn(async move {
            let stage = pipeline.stage("shout").unwrap().clone();
            exec.run(&pipeline, &stage, &job).await.unwrap()
        })
    };
    let (entered, _) = shout.hold_commit.as_ref().unwrap();
    entered.notified().await;
    dying.abort();
    assert!(dying.await.unwrap_err().is_cancelled());
    // The next worker does not pay again (`hold_commit` held the first commit only).
    let shout_once = Arc::new(Shout::default());
    let next = Pipeline::builder(shout_once.clone())
        .then(Arc::new(Count::default()))
        .build()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let outcome = loop {
        // The aborted execution gives its stage back in a task of its own.
        match run(&f, &next, "shout", &job).await {
            ExecutionOutcome::Skipped(_) if tokio::time::Instant::now() < deadline => {
                tokio::task::yield_now().await
            }
            outcome => break outcome,
        }
    };
    assert!(succeeded(&outcome, 2), "{outcome:?}");
    assert_eq!(AtomicUsize::load(&shout.calls, Ordering::SeqCst), 1);
    assert_eq!(
        AtomicUsize::load(&shout_once.calls, Ordering::SeqCst),
        0,
        "paid once"
    );
    assert_eq!(output(&mut f, "shout").await, Some(json!("TEUER!")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paid_call_is_not_reused_when_the_upstream_or_the_input_changed() {
    let mut f = fixture().await;
    let shout = Arc::new(Shout {
        fail_commits: AtomicUsize::new(1),
        ..Shout::default()
    });
    let count = Arc::new(Count {
        fail_commits: AtomicUsize::new(1),
        ..Count::default()
    });
    let pipeline = pipeline(&shout, &count);
    let job = f.item("eins").await;
    // shout: paid on "eins", commit failed; the input changes before attempt 2.
    assert!(matches!(
        run(&f, &pipeline, "shout", &job).await,
        ExecutionOutcome::Failed { attempt: 1, .. }
    ));
    let job2 = set_input(&mut f, &job, "zwei").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job2).await, 2));
    assert_eq!(
        AtomicUsize::load(&shout.calls, Ordering::SeqCst),
        2,
        "a new input is a new call"
    );
    assert_eq!(output(&mut f, "shout").await, Some(json!("ZWEI!")));
    // count: paid on shout's attempt 2, commit failed; shout succeeds again.
    assert!(matches!(
        run(&f, &pipeline, "count", &job2).await,
        ExecutionOutcome::Failed { attempt: 1, .. }
    ));
    let job3 = set_input(&mut f, &job2, "drei").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job3).await, 3));
    assert!(succeeded(&run(&f, &pipeline, "count", &job3).await, 2));
    assert_eq!(
        AtomicUsize::load(&count.calls, Ordering::SeqCst),
        2,
        "a new upstream is a new call"
    );
    assert_eq!(*count.seen.lock().unwrap(), ["ZWEI!", "DREI!"]);
    assert_eq!(output(&mut f, "count").await, Some(json!(5)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_does_not_reuse_pays_on_every_attempt() {
    let mut f = fixture().await;
    let shout = Arc::new(Shout {
        fail_commits: AtomicUsize::new(1),
        reuse: Some(false),
        ..Shout::default()
    });
    let pipeline = pipeline(&shout, &Arc::new(Count::default()));
    let job = f.item("teuer").await;
    assert!(matches!(
        run(&f, &pipeline, "shout", &job).await,
        ExecutionOutcome::Failed { attempt: 1, .. }
    ));
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_checkpoints").await,
        0
    );
    assert!(succeeded(&run(&f, &pipeline, "shout", &job).await, 2));
    assert_eq!(AtomicUsize::load(&shout.calls, Ordering::SeqCst), 2);
}

/// Reads the team's tables in `prepare` through the read-only, tenant-scoped
/// connection, and tries to write through it.
struct Reader {
    seen: Mutex<Option<(i64, String)>>,
}

#[async_trait]
impl Stage for Reader {
    const NAME: &'static str = "reader";
    type Input = ();
    type Prepared = ();
    type Output = ();
    async fn prepare(&self, ctx: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let items = ctx
            .read(async |conn| {
                diesel::sql_query("SELECT count(*) AS n FROM items")
                    .get_result::<N>(conn)
                    .await
            })
            .await?;
        let write = ctx
            .read(async |conn| diesel::sql_query("DELETE FROM items").execute(conn).await)
            .await;
        *self.seen.lock().unwrap() = Some((
            items.n,
            write
                .map(|n| n.to_string())
                .unwrap_or_else(|e| e.to_string()),
        ));
        Ok(())
    }
    async fn commit(&self, _: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        Ok(Done::next(()))
    }
}

#[tokio::test]
async fn prepare_reads_its_tenants_rows_and_cannot_write() {
    let mut f = fixture().await;
    let reader = Arc::new(Reader {
        seen: Mutex::new(None),
    });
    let pipeline = Pipeline::builder(reader.clone()).build().unwrap();
    let job = f.item("mine").await;
    // Another tenant's item: not visible to t1's stage.
    register_item(
        &mut f.conn,
        &TenantId::parse("t2").unwrap(),
        &ItemId::new(),
        "theirs",
    )
    .await
    .unwrap();
    assert!(succeeded(&run(&f, &pipeline, "reader", &job).await, 1));
    let (n, write) = reader.seen.lock().unwrap().clone().unwrap();
    assert_eq!(n, 1);
    assert!(write.contains("read-only transaction"), "{write}");
    assert_eq!(count(&mut f.conn, "SELECT 1 FROM items").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_testkit_checker_holds_any_pipeline_to_the_cores_invariants() {
    let mut f = fixture().await;
    let (shout, counter) = (Arc::new(Shout::default()), Arc::new(Count::default()));
    let pipeline = pipeline(&shout, &counter);
    let job = f.item("eins").await;
    assert!(succeeded(&run(&f, &pipeline, "shout", &job).await, 1));
    // count is expected now (shout succeeded and went on) and has not run: lost.
    let check = idemstage_testkit::check_pipeline(&mut f.conn, &pipeline)
        .await
        .unwrap();
    assert_eq!(
        (check.items, check.items_final, check.lost_stages),
        (1, 0, 1)
    );
    assert!(!check.violations().is_empty());
    assert!(succeeded(&run(&f, &pipeline, "count", &job).await, 1));
    let check = idemstage_testkit::check_pipeline(&mut f.conn, &pipeline)
        .await
        .unwrap();
    assert_eq!(check.violations(), Vec::<String>::new());
    assert_eq!(check.stages_succeeded, 2);
    // A success that names an upstream attempt that is not the current one.
    diesel::sql_query("UPDATE stage_runs SET upstream_attempt = 7 WHERE stage = 'count'")
        .execute(&mut f.conn)
        .await
        .unwrap();
    let check = idemstage_testkit::check_pipeline(&mut f.conn, &pipeline)
        .await
        .unwrap();
    assert_eq!(check.stale_lineage, 1);
}
