//! Fan-out and gather: a stage's success hands on children, each runs the
//! child stages as an item of its own (at most once per child), and the gather
//! runs once per fan-out when every child is final, reading their outputs; a
//! dead child makes the gather's policy decide.

use std::collections::HashMap;
use std::sync::Mutex;

use diesel::OptionalExtension;
use idemstage_domain::{Children, GatherPolicy, Gathered, RunStatus};
use idemstage_stage::Reconciler;
use serde_json::json;

use super::*;

/// The first stage: hands the input on.
struct Intake;

#[async_trait]
impl Stage for Intake {
    const NAME: &'static str = "intake";
    type Input = String;
    type Prepared = ();
    type Output = String;
    async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        input: &String,
        _: &(),
    ) -> Result<Done<String>, StageError> {
        Ok(Done::next(input.clone()))
    }
}

/// Splits the input's whitespace-separated numbers into one child each (key:
/// its position). `stop` as the input ends the item here.
struct Split;

#[async_trait]
impl Stage for Split {
    const NAME: &'static str = "split";
    type Input = String;
    type Prepared = ();
    type Output = Children<u32>;
    async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        input: &String,
        _: &(),
    ) -> Result<Done<Children<u32>>, StageError> {
        if input.trim() == "stop" {
            return Ok(Done::stop(Children::new()));
        }
        if input.trim() == "none" {
            return Ok(Done::next(Children::new()));
        }
        if input.trim() == "twice" {
            return Ok(Done::next([("a", 1), ("a", 2)].into_iter().collect()));
        }
        let children = input
            .split_whitespace()
            .enumerate()
            .map(|(i, n)| (format!("p{i}"), n.parse::<u32>().unwrap_or(0)))
            .collect();
        Ok(Done::next(children))
    }
}

/// Per child: squares its number; 13 is a permanent failure. Counts its
/// executions per child item.
#[derive(Default)]
struct Square {
    runs: Mutex<HashMap<ItemId, usize>>,
    /// 13 is no longer unlucky (an operator fixed the cause).
    fixed: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Stage for Square {
    const NAME: &'static str = "square";
    type Input = u32;
    type Prepared = ();
    type Output = u64;
    async fn prepare(&self, ctx: &PrepareContext<'_, u32>) -> Result<(), StageError> {
        if *ctx.input() == 13
            && !std::sync::atomic::AtomicBool::load(
                &self.fixed,
                std::sync::atomic::Ordering::SeqCst,
            )
        {
            return Err(StageError::Permanent("13 is unlucky".into()));
        }
        Ok(())
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &u32,
        _: &(),
    ) -> Result<Done<u64>, StageError> {
        *self
            .runs
            .lock()
            .unwrap()
            .entry(tx.token().item)
            .or_default() += 1;
        Ok(Done::next(u64::from(*input) * u64::from(*input)))
    }
}

/// Per child, the last: the square as text.
struct Label;

#[async_trait]
impl Stage for Label {
    const NAME: &'static str = "label";
    type Input = u64;
    type Prepared = ();
    type Output = String;
    async fn prepare(&self, _: &PrepareContext<'_, u64>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        input: &u64,
        _: &(),
    ) -> Result<Done<String>, StageError> {
        Ok(Done::next(format!("={input}")))
    }
}

/// The gather: the labels in order, and the failed keys. Counts its runs.
#[derive(Default)]
struct Sum {
    runs: Mutex<HashMap<ItemId, usize>>,
}

#[async_trait]
impl Stage for Sum {
    const NAME: &'static str = "sum";
    type Input = Gathered<String>;
    type Prepared = ();
    type Output = String;
    async fn prepare(&self, _: &PrepareContext<'_, Gathered<String>>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &Gathered<String>,
        _: &(),
    ) -> Result<Done<String>, StageError> {
        *self
            .runs
            .lock()
            .unwrap()
            .entry(tx.token().item)
            .or_default() += 1;
        let ok: Vec<&str> = input.succeeded().map(|(_, o)| o.as_str()).collect();
        let failed: Vec<&str> = input.failed().map(|(k, _)| k).collect();
        Ok(Done::next(format!(
            "{} | failed {}",
            ok.join(" "),
            failed.join(" ")
        )))
    }
}

/// After the gather: a plain stage on the parent item.
struct Report;

#[async_trait]
impl Stage for Report {
    const NAME: &'static str = "report";
    type Input = String;
    type Prepared = ();
    type Output = String;
    async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        input: &String,
        _: &(),
    ) -> Result<Done<String>, StageError> {
        Ok(Done::next(format!("report: {input}")))
    }
}

fn pipeline(square: &Arc<Square>, sum: &Arc<Sum>, policy: GatherPolicy) -> Pipeline {
    Pipeline::builder(Intake)
        .fan_out(Split)
        .then(square.clone())
        .then(Label)
        .gather(sum.clone(), policy)
        .then(Report)
        .build()
        .unwrap()
}

/// Runs every stage job there is until the queue is empty, with `exec`
/// (fetch, execute, complete as a worker would): the jobs of every stage.
async fn drain(f: &mut Fixture, pipeline: &Pipeline, exec: &Executor) -> usize {
    let queues: Vec<String> = pipeline
        .stages()
        .iter()
        .map(|s| s.name().to_string())
        .collect();
    let mut ran = 0;
    loop {
        let fetched = queue::fetch(&mut f.conn, &queues, 50).await.unwrap();
        if fetched.is_empty() {
            return ran;
        }
        for job in fetched {
            let stage = pipeline.stage(&job.queue).unwrap();
            let payload = StageJob::from_payload(&job.queue, &job.payload).unwrap();
            let lease = JobLease {
                id: job.id,
                attempt: job.attempt,
            };
            let outcome = exec
                .run_and_complete_job(pipeline, stage, &payload, lease)
                .await
                .unwrap();
            if !matches!(
                outcome,
                ExecutionOutcome::Succeeded {
                    job_completed: true,
                    ..
                }
            ) {
                queue::complete(&mut f.conn, job.id, job.attempt, None)
                    .await
                    .unwrap();
            }
            ran += 1;
        }
    }
}

async fn output(conn: &mut AsyncPgConnection, item: &ItemId, stage: &str) -> serde_json::Value {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Jsonb>)]
        output: Option<serde_json::Value>,
    }
    let row: Row =
        diesel::sql_query("SELECT output FROM stage_runs WHERE item_id = $1 AND stage = $2")
            .bind::<diesel::sql_types::Text, _>(item.to_string())
            .bind::<diesel::sql_types::Text, _>(stage)
            .get_result(conn)
            .await
            .unwrap();
    row.output.unwrap_or(serde_json::Value::Null)
}

async fn status(conn: &mut AsyncPgConnection, item: &ItemId, stage: &str) -> Option<RunStatus> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        status: String,
    }
    let row: Option<Row> =
        diesel::sql_query("SELECT status FROM stage_runs WHERE item_id = $1 AND stage = $2")
            .bind::<diesel::sql_types::Text, _>(item.to_string())
            .bind::<diesel::sql_types::Text, _>(stage)
            .get_result(conn)
            .await
            .optional()
            .unwrap();
    row.map(|r| r.status.parse().unwrap())
}

/// Sends the item's first job, as `start` would.
async fn start(f: &mut Fixture, pipeline: &Pipeline, job: &StageJob) {
    queue::send_in(
        &mut f.conn,
        &first_job(
            pipeline,
            job.tenant_id.clone(),
            job.item_id,
            job.input_hash.clone(),
        ),
    )
    .await
    .unwrap();
}

/// Runs intake and the fan-out (split) for `job` directly, each succeeding.
async fn run_to_the_fan_out(exec: &Executor, pipeline: &Pipeline, job: &StageJob) {
    for stage in ["intake", "split"] {
        let outcome = exec
            .run(pipeline, pipeline.stage(stage).unwrap(), job)
            .await
            .unwrap();
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { .. }),
            "{outcome:?}"
        );
    }
}

/// Fetches up to `n` jobs of `queues` and runs each as a worker would (its job
/// completed in the stage's transaction); the jobs it ran.
async fn run_fetched(
    f: &mut Fixture,
    pipeline: &Pipeline,
    exec: &Executor,
    queues: &[&str],
    n: u32,
) -> usize {
    let queues: Vec<String> = queues.iter().map(|q| q.to_string()).collect();
    let fetched = queue::fetch(&mut f.conn, &queues, n).await.unwrap();
    for j in &fetched {
        let payload = StageJob::from_payload(&j.queue, &j.payload).unwrap();
        exec.run_and_complete_job(
            pipeline,
            pipeline.stage(&j.queue).unwrap(),
            &payload,
            JobLease {
                id: j.id,
                attempt: j.attempt,
            },
        )
        .await
        .unwrap();
    }
    fetched.len()
}

/// Fetches the one next job of `queue` and runs it as [`run_fetched`] does; its
/// payload and outcome.
async fn run_one(
    f: &mut Fixture,
    pipeline: &Pipeline,
    exec: &Executor,
    queue: &str,
) -> (StageJob, ExecutionOutcome) {
    let fetched = queue::fetch(&mut f.conn, &[queue.to_owned()], 1)
        .await
        .unwrap();
    let j = &fetched[0];
    let payload = StageJob::from_payload(&j.queue, &j.payload).unwrap();
    let outcome = exec
        .run_and_complete_job(
            pipeline,
            pipeline.stage(queue).unwrap(),
            &payload,
            JobLease {
                id: j.id,
                attempt: j.attempt,
            },
        )
        .await
        .unwrap();
    (payload, outcome)
}

/// The testkit's checker finds nothing wrong; what it counted.
async fn assert_sound(
    conn: &mut AsyncPgConnection,
    pipeline: &Pipeline,
) -> idemstage_testkit::check::Invariants {
    let check = idemstage_testkit::check::check_pipeline(conn, pipeline)
        .await
        .unwrap();
    assert_eq!(check.violations(), Vec::<String>::new());
    check
}

#[tokio::test]
async fn each_child_runs_its_stages_once_and_the_gather_once_with_every_output_in_order() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let job = f.item("3 1 4 1 5").await;
    start(&mut f, &pipeline, &job).await;
    let exec = f.executor();
    drain(&mut f, &pipeline, &exec).await;

    // Five children, each an item of the tenant, each stage once.
    assert_eq!(count(&mut f.conn, "SELECT 1 FROM fanout_children").await, 5);
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM items i JOIN fanout_children c ON c.item_id = i.id WHERE i.tenant_id = 't1'").await,
        5
    );
    let runs = square.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 5);
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_runs WHERE stage IN ('square', 'label') AND status = 'success' AND attempts = 1").await,
        10
    );
    // The gather once, on the parent, with the labels in the fan-out's order.
    assert_eq!(sum.runs.lock().unwrap().get(&job.item_id), Some(&1));
    assert_eq!(
        output(&mut f.conn, &job.item_id, "sum").await,
        json!("=9 =1 =16 =1 =25 | failed ")
    );
    assert_eq!(
        output(&mut f.conn, &job.item_id, "report").await,
        json!("report: =9 =1 =16 =1 =25 | failed ")
    );
    // No child stage ran on the parent, no parent stage on a child.
    assert_eq!(
        count(
            &mut f.conn,
            &format!(
                "SELECT 1 FROM stage_runs WHERE item_id = '{}' AND stage IN ('square', 'label')",
                job.item_id
            )
        )
        .await,
        0
    );
    assert_eq!(count(&mut f.conn, "SELECT 1 FROM stage_runs r JOIN fanout_children c ON c.item_id = r.item_id WHERE r.stage NOT IN ('square', 'label')").await, 0);
    assert_eq!(count(&mut f.conn, "SELECT 1 FROM fanouts WHERE final_children = 5 AND children = 5 AND completed_at IS NOT NULL").await, 1);

    // The reconciler finds nothing lost, and settles every item.
    let mut reconciler = Reconciler::new(pipeline.clone());
    let pool = f.repo.pool().clone();
    let report = reconciler.pass(&pool).await.unwrap();
    assert_eq!((report.examined, report.resent, report.settled), (6, 0, 6));
}

#[tokio::test]
async fn a_dead_child_fails_the_gather_or_is_gathered_as_failed_as_its_policy_says() {
    for (policy, gather) in [
        (GatherPolicy::FailOnDead, RunStatus::Dead),
        (GatherPolicy::GatherSucceeded, RunStatus::Success),
    ] {
        let mut f = fixture().await;
        let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
        let pipeline = pipeline(&square, &sum, policy);
        let job = f.item("2 13 3").await;
        start(&mut f, &pipeline, &job).await;
        let exec = f.executor();
        drain(&mut f, &pipeline, &exec).await;
        assert_eq!(
            status(&mut f.conn, &job.item_id, "sum").await,
            Some(gather),
            "{policy:?}"
        );
        assert_eq!(
            count(
                &mut f.conn,
                "SELECT 1 FROM fanout_children WHERE outcome = 'dead' AND final_stage = 'square'"
            )
            .await,
            1
        );
        match policy {
            GatherPolicy::FailOnDead => {
                assert_eq!(sum.runs.lock().unwrap().len(), 0, "the body never ran");
                assert_eq!(
                    count(&mut f.conn, "SELECT 1 FROM stage_runs WHERE stage = 'sum' AND last_error LIKE '%child p1 %13 is unlucky%'").await,
                    1
                );
                assert_eq!(status(&mut f.conn, &job.item_id, "report").await, None);
            }
            GatherPolicy::GatherSucceeded => {
                assert_eq!(
                    output(&mut f.conn, &job.item_id, "sum").await,
                    json!("=4 =9 | failed p1")
                );
            }
        }
    }
}

#[tokio::test]
async fn a_fan_out_of_no_children_runs_its_gather_at_once_and_a_stop_runs_neither() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let exec = f.executor();
    let empty = f.item("none").await;
    let stop = f.item("stop").await;
    for job in [&empty, &stop] {
        start(&mut f, &pipeline, job).await;
    }
    drain(&mut f, &pipeline, &exec).await;
    assert_eq!(
        output(&mut f.conn, &empty.item_id, "sum").await,
        json!(" | failed ")
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM fanouts WHERE children = 0 AND completed_at IS NOT NULL"
        )
        .await,
        1
    );
    assert_eq!(status(&mut f.conn, &stop.item_id, "sum").await, None);
    assert_eq!(
        count(
            &mut f.conn,
            &format!(
                "SELECT 1 FROM fanouts WHERE parent_item = '{}'",
                stop.item_id
            )
        )
        .await,
        0
    );
}

#[tokio::test]
async fn a_child_key_given_twice_is_a_permanent_failure_of_the_fan_out_and_writes_no_child() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let job = f.item("twice").await;
    start(&mut f, &pipeline, &job).await;
    let exec = f.executor();
    drain(&mut f, &pipeline, &exec).await;
    assert_eq!(
        status(&mut f.conn, &job.item_id, "split").await,
        Some(RunStatus::Dead)
    );
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_runs WHERE stage = 'split' AND last_error LIKE '%child key \"a\" appears twice%'").await,
        1
    );
    assert_eq!(count(&mut f.conn, "SELECT 1 FROM fanout_children").await, 0);
    assert_eq!(count(&mut f.conn, "SELECT 1 FROM fanouts").await, 0);
}

#[tokio::test]
async fn a_lost_gather_job_is_sent_again_by_the_reconciler() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let job = f.item("1 2").await;
    start(&mut f, &pipeline, &job).await;
    let exec = f.executor();
    // Run everything but the gather, then lose its job.
    while run_fetched(
        &mut f,
        &pipeline,
        &exec,
        &["intake", "split", "square", "label"],
        50,
    )
    .await
        > 0
    {}
    assert_eq!(
        diesel::sql_query("DELETE FROM jobs WHERE queue = 'sum'")
            .execute(&mut f.conn)
            .await
            .unwrap(),
        1
    );
    let pool = f.repo.pool().clone();
    let mut reconciler = Reconciler::new(pipeline.clone());
    let report = reconciler.pass(&pool).await.unwrap();
    assert_eq!(report.resent, 1, "{report:?}");
    drain(&mut f, &pipeline, &exec).await;
    assert_eq!(
        output(&mut f.conn, &job.item_id, "sum").await,
        json!("=1 =4 | failed ")
    );
    assert_eq!(sum.runs.lock().unwrap().get(&job.item_id), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_workers_run_every_child_once_and_each_gather_once() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::GatherSucceeded);
    let start_pool = db.pool(4).await;
    let tenants = ["t1", "t2"];
    let mut parents = Vec::new();
    for i in 0..8 {
        let tenant = TenantId::parse(tenants[i % 2]).unwrap();
        let item = ItemId::new();
        let numbers: Vec<String> = (0..25).map(|n| ((n + i) % 12).to_string()).collect();
        idemstage::pipeline::start(&start_pool, &pipeline, &tenant, &item, &numbers.join(" "))
            .await
            .unwrap();
        parents.push(item);
    }
    let stop = idemstage::worker::CancellationToken::new();
    let mut workers = Vec::new();
    for _ in 0..3 {
        let config = idemstage::worker::PipelineWorkerConfig::default().with_concurrency(6);
        let worker = idemstage::worker::PipelineWorker::new(
            db.pool(10).await,
            db.url(),
            pipeline.clone(),
            config,
            Arc::new(idemstage::worker::Counters::default()),
        )
        .unwrap();
        workers.push(tokio::spawn(worker.run(stop.clone())));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while count(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE stage = 'report' AND status = 'success'",
    )
    .await
        < 8
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pipeline did not finish"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    for w in workers {
        w.await.unwrap();
    }
    let runs = square.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 8 * 25);
    assert!(runs.values().all(|&n| n == 1), "a child ran twice");
    let gathers = sum.runs.lock().unwrap().clone();
    assert_eq!(gathers.len(), 8);
    assert!(
        gathers.values().all(|&n| n == 1),
        "a gather ran twice: {gathers:?}"
    );
    for (i, parent) in parents.iter().enumerate() {
        let expected: Vec<String> = (0..25)
            .map(|n| format!("={}", ((n + i) % 12).pow(2)))
            .collect();
        assert_eq!(
            output(&mut conn, parent, "sum").await,
            json!(format!("{} | failed ", expected.join(" ")))
        );
    }
    let check = assert_sound(&mut conn, &pipeline).await;
    assert_eq!(check.items, 8 + 8 * 25);
    assert_eq!(check.items_final, check.items);
}

#[tokio::test]
async fn an_operators_retry_of_a_dead_child_runs_the_dead_gather_again_on_every_child() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let job = f.item("2 13 3").await;
    start(&mut f, &pipeline, &job).await;
    let exec = f.executor();
    drain(&mut f, &pipeline, &exec).await;
    assert_eq!(
        status(&mut f.conn, &job.item_id, "sum").await,
        Some(RunStatus::Dead)
    );

    #[derive(diesel::QueryableByName)]
    struct Child {
        #[diesel(sql_type = diesel::sql_types::Text)]
        item_id: String,
    }
    let dead: Child =
        diesel::sql_query("SELECT item_id FROM fanout_children WHERE outcome = 'dead'")
            .get_result(&mut f.conn)
            .await
            .unwrap();
    let child = ItemId::parse(&dead.item_id).unwrap();
    square
        .fixed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let actor = idemstage_persistence::ops::Actor::parse("ops").unwrap();
    idemstage_persistence::ops::retry(
        &mut f.conn,
        &job.tenant_id,
        &child,
        Some(&StageName::parse("square").unwrap()),
        &actor,
        &pipeline,
    )
    .await
    .unwrap();
    drain(&mut f, &pipeline, &exec).await;
    // The child's success was counted again: the dead gather went stale, its
    // job was sent, and it ran on every child.
    assert_eq!(
        status(&mut f.conn, &job.item_id, "sum").await,
        Some(RunStatus::Success)
    );
    assert_eq!(
        output(&mut f.conn, &job.item_id, "sum").await,
        json!("=4 =169 =9 | failed ")
    );
    assert_eq!(
        output(&mut f.conn, &job.item_id, "report").await,
        json!("report: =4 =169 =9 | failed ")
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM fanouts WHERE final_children = 3 AND version = 4"
        )
        .await,
        1
    );
    assert_sound(&mut f.conn, &pipeline).await;
}

#[tokio::test]
async fn a_child_that_ends_again_after_the_gather_succeeded_makes_it_and_what_follows_run_again() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::GatherSucceeded);
    let job = f.item("2 13").await;
    start(&mut f, &pipeline, &job).await;
    let exec = f.executor();
    drain(&mut f, &pipeline, &exec).await;
    assert_eq!(
        output(&mut f.conn, &job.item_id, "report").await,
        json!("report: =4 | failed p1")
    );
    #[derive(diesel::QueryableByName)]
    struct Child {
        #[diesel(sql_type = diesel::sql_types::Text)]
        item_id: String,
    }
    let dead: Child =
        diesel::sql_query("SELECT item_id FROM fanout_children WHERE outcome = 'dead'")
            .get_result(&mut f.conn)
            .await
            .unwrap();
    square
        .fixed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let actor = idemstage_persistence::ops::Actor::parse("ops").unwrap();
    idemstage_persistence::ops::retry(
        &mut f.conn,
        &job.tenant_id,
        &ItemId::parse(&dead.item_id).unwrap(),
        None,
        &actor,
        &pipeline,
    )
    .await
    .unwrap();
    drain(&mut f, &pipeline, &exec).await;
    assert_eq!(
        output(&mut f.conn, &job.item_id, "report").await,
        json!("report: =4 =169 | failed ")
    );
    assert_eq!(sum.runs.lock().unwrap().get(&job.item_id), Some(&2));
    assert_sound(&mut f.conn, &pipeline).await;
}

#[tokio::test]
async fn a_rerun_of_the_fan_out_supersedes_its_children_and_gathers_the_new_ones_only() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let job = f.item("1 2 3").await;
    start(&mut f, &pipeline, &job).await;
    let exec = f.executor();
    // Run the fan-out and one child's first stage; the other children's jobs
    // (and one half-done child) are left when the operator reruns the fan-out.
    for _ in 0..2 {
        run_fetched(&mut f, &pipeline, &exec, &["intake", "split"], 10).await;
    }
    let (payload, _) = run_one(&mut f, &pipeline, &exec, "square").await;
    let old_child = payload.item_id;

    let actor = idemstage_persistence::ops::Actor::parse("ops").unwrap();
    idemstage_persistence::ops::rerun(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &StageName::parse("split").unwrap(),
        &actor,
        &pipeline,
    )
    .await
    .unwrap();
    // The rerun succeeds first (an old child finishing before it would be
    // legitimate: its lineage was current then); then everything else.
    let (_, outcome) = run_one(&mut f, &pipeline, &exec, "split").await;
    assert!(
        matches!(outcome, ExecutionOutcome::Succeeded { attempt: 2, .. }),
        "{outcome:?}"
    );
    drain(&mut f, &pipeline, &exec).await;

    // The new attempt's three children ran once each; the old ones never ran
    // again (the one half done never reached its last stage).
    assert_eq!(count(&mut f.conn, "SELECT 1 FROM fanouts").await, 2);
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM fanouts WHERE superseded_at IS NOT NULL AND attempt = 1"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM items WHERE superseded_at IS NOT NULL"
        )
        .await,
        3
    );
    assert_eq!(
        count(
            &mut f.conn,
            &format!("SELECT 1 FROM stage_runs WHERE item_id = '{old_child}' AND stage = 'label'")
        )
        .await,
        0
    );
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_runs r JOIN items a ON a.id = r.item_id WHERE a.superseded_at IS NOT NULL AND NOT (r.status = 'cancelled' AND r.success_attempt IS NULL)").await,
        0
    );
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM stage_runs r JOIN fanout_children c ON c.item_id = r.item_id WHERE c.attempt = 2 AND r.status = 'success'").await,
        6
    );
    let runs = square.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 1 + 3);
    assert!(runs.values().all(|&n| n == 1));
    assert_eq!(sum.runs.lock().unwrap().get(&job.item_id), Some(&1));
    assert_eq!(
        output(&mut f.conn, &job.item_id, "report").await,
        json!("report: =1 =4 =9 | failed ")
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM job_states WHERE state IN ('created', 'retry', 'active')"
        )
        .await,
        0
    );
    let check = assert_sound(&mut f.conn, &pipeline).await;
    assert_eq!(check.items_final, check.items);
}

#[tokio::test]
async fn a_gather_job_sent_before_every_child_is_final_is_skipped_without_using_an_attempt() {
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let job = f.item("5 6").await;
    let exec = f.executor();
    run_to_the_fan_out(&exec, &pipeline, &job).await;
    let early = exec
        .run(&pipeline, pipeline.stage("sum").unwrap(), &job)
        .await
        .unwrap();
    assert_eq!(
        early,
        ExecutionOutcome::Skipped(idemstage_domain::SkipReason::ChildrenNotFinal {
            final_children: 0,
            children: 2,
        })
    );
    assert_eq!(status(&mut f.conn, &job.item_id, "sum").await, None);
    drain(&mut f, &pipeline, &exec).await;
    assert_eq!(
        output(&mut f.conn, &job.item_id, "sum").await,
        json!("=25 =36 | failed ")
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'sum' AND attempts = 1 AND status = 'success'"
        )
        .await,
        1
    );
}

/// A cancel of a parent whose children are under way ends the children too:
/// the unfinished ones are cancelled (each with its own audit entry), the one
/// that had finished keeps its result, and the gather, which had no run yet,
/// gets one `cancelled`: it never runs, nothing is sent again, and a second
/// cancel finds nothing.
#[tokio::test]
async fn a_cancel_of_the_parent_cancels_its_unfinished_children_and_the_gather() {
    use idemstage::ops::{self, Actor, CancelOutcome, CancelledFrom};
    let mut f = fixture().await;
    let (square, sum) = (Arc::new(Square::default()), Arc::new(Sum::default()));
    let pipeline = pipeline(&square, &sum, GatherPolicy::FailOnDead);
    let job = f.item("2 3 4").await;
    let exec = f.executor();
    run_to_the_fan_out(&exec, &pipeline, &job).await;
    // One child runs to its end; the other two have only their first job.
    for queue_name in ["square", "label"] {
        run_one(&mut f, &pipeline, &exec, queue_name).await;
    }
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM fanout_children WHERE outcome = 'success'"
        )
        .await,
        1
    );

    let actor = Actor::parse("ops-bot").unwrap();
    let outcome = ops::cancel(&mut f.conn, &job.tenant_id, &job.item_id, &actor)
        .await
        .unwrap();
    let CancelOutcome::Cancelled {
        stages, children, ..
    } = &outcome
    else {
        panic!("{outcome:?}")
    };
    let gather: Vec<_> = stages
        .iter()
        .filter(|s| s.stage.as_str() == "sum")
        .collect();
    assert_eq!(gather.len(), 1, "{outcome:?}");
    assert_eq!(gather[0].from, CancelledFrom::AwaitingChildren);
    assert_eq!(children.len(), 2, "{outcome:?}");
    for child in children {
        assert_eq!(child.stages.len(), 1, "{outcome:?}");
        assert_eq!(child.stages[0].stage.as_str(), "square");
        assert_eq!(child.stages[0].from, CancelledFrom::Queued);
    }
    // The fan-out counted them: it is complete, the gather's run is final.
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM fanout_children WHERE outcome = 'cancelled' AND final_stage = 'square'"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM fanouts WHERE final_children = 3 AND completed_at IS NOT NULL"
        )
        .await,
        1
    );
    assert_eq!(
        status(&mut f.conn, &job.item_id, "sum").await,
        Some(RunStatus::Cancelled)
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM audit_log WHERE action = 'operator.cancel'"
        )
        .await,
        3
    );

    // `inspect` shows the parent's fan-out with each child's end, and each
    // child's parent.
    let timeline = ops::inspect(&mut f.conn, &job.tenant_id, &job.item_id)
        .await
        .unwrap();
    assert_eq!(timeline.child_of, None);
    assert_eq!(timeline.fan_outs.len(), 1);
    let fan_out = &timeline.fan_outs[0];
    assert_eq!(
        (fan_out.stage.as_str(), fan_out.gather_stage.as_str()),
        ("split", "sum")
    );
    assert_eq!(fan_out.final_children, 3);
    assert!(fan_out.completed_at.is_some());
    let ends: Vec<(&str, Option<&str>, Option<&str>)> = fan_out
        .children
        .iter()
        .map(|c| {
            (
                c.key.as_str(),
                c.outcome.as_deref(),
                c.final_stage.as_ref().map(|s| s.as_str()),
            )
        })
        .collect();
    assert_eq!(
        ends.iter()
            .filter(|e| e.1 == Some("cancelled") && e.2 == Some("square"))
            .count(),
        2,
        "{ends:?}"
    );
    assert_eq!(
        ends.iter()
            .filter(|e| e.1 == Some("success") && e.2 == Some("label"))
            .count(),
        1,
        "{ends:?}"
    );
    let cancelled_child = &children[0];
    let child = ops::inspect(&mut f.conn, &job.tenant_id, &cancelled_child.item)
        .await
        .unwrap();
    let child_of = child.child_of.as_ref().unwrap();
    assert_eq!(child_of.parent, job.item_id);
    assert_eq!((child_of.stage.as_str(), child_of.attempt), ("split", 1));
    assert!(!child_of.superseded);
    assert!(fan_out
        .children
        .iter()
        .any(|c| c.item == cancelled_child.item && c.key == child_of.key));
    assert!(child.fan_outs.is_empty());

    // Nothing runs after it, and nothing is sent again.
    assert_eq!(drain(&mut f, &pipeline, &exec).await, 0);
    assert_eq!(square.runs.lock().unwrap().len(), 1);
    assert!(sum.runs.lock().unwrap().is_empty());
    let pool = f.repo.pool().clone();
    let report = Reconciler::new(pipeline.clone()).pass(&pool).await.unwrap();
    assert_eq!((report.examined, report.resent, report.settled), (4, 0, 4));
    assert_eq!(
        ops::cancel(&mut f.conn, &job.tenant_id, &job.item_id, &actor)
            .await
            .unwrap(),
        CancelOutcome::NothingToCancel
    );
    assert_sound(&mut f.conn, &pipeline).await;
}
