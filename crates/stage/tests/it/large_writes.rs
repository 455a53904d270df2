//! Issue 29, item 5: a stage writes any number of child rows. One multi-row INSERT
//! has at most 65,535 bind parameters; the chunked helpers of `FencedTx` keep every
//! statement under that.

use std::time::Instant;

use super::*;

/// 72,000 positions, one per line, under the 1 MiB input limit.
fn large_text(lines: usize) -> String {
    (0..lines)
        .map(|i| format!("{} stk S\n", i % 90 + 1))
        .collect()
}

/// The example's extract wrote its positions in one multi-row INSERT: 72,000 rows of
/// 9 columns exceed the protocol's 65,535 bind parameters, the driver refused to
/// encode it, and the attempt was released as "database unavailable", for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_72000_line_input_runs_through_every_stage_of_the_example() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    let text = large_text(72_000);
    assert!(text.len() < 1 << 20, "{} bytes", text.len());
    let job = f.item(&text).await;
    let exec = f.executor();
    let started = Instant::now();
    for stage in pipeline.stages() {
        let stage_started = Instant::now();
        let outcome = exec.run(&pipeline, stage, &job).await.unwrap();
        eprintln!(
            "{}: {outcome:?} in {:?}",
            stage.name(),
            stage_started.elapsed()
        );
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { attempt: 1, .. }),
            "{}: {outcome:?}",
            stage.name()
        );
    }
    eprintln!("72,000 lines, four stages: {:?}", started.elapsed());
    let c = &mut f.conn;
    assert_eq!(count(c, "SELECT * FROM anfrage_extraktionen").await, 72_000);
    assert_eq!(
        count(
            c,
            "SELECT * FROM feasibility_results WHERE feasible AND reasons = '[]'"
        )
        .await,
        1
    );
    let check = idemstage_example::check_example_pipeline(c).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new());
    assert_eq!(check.stages_succeeded, 4);
}

/// Upserts `rows` as the item's extracted positions (`upsert_extraktionen`,
/// chunked), recording what the upsert did.
struct Upsert {
    name: StageName,
    policy: StagePolicy,
    rows: Vec<example::Extraktion>,
    did: std::sync::Mutex<Option<idemstage_persistence::Replaced>>,
}

#[async_trait]
impl Stage for Upsert {
    const NAME: &'static str = "upsert";
    type Input = ();
    type Prepared = ();
    type Output = ();
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        Ok(())
    }
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        use example::ExampleTables;
        let did = tx.upsert_extraktionen(&self.rows).await?;
        *self.did.lock().unwrap() = Some(did);
        Ok(Done::next(()))
    }
}

fn upsert(name: &str, rows: usize, label: &str) -> Arc<Upsert> {
    Arc::new(Upsert {
        name: StageName::parse(name).unwrap(),
        policy: StagePolicy::default(),
        rows: (0..rows)
            .map(|i| example::Extraktion {
                position_index: i as i32,
                description: format!("{label} {i}"),
                quantity: Some(1.0),
                unit: Some("stk".into()),
            })
            .collect(),
        did: std::sync::Mutex::new(None),
    })
}

/// The per-row variant: 72,000 rows upserted in chunks, then shrunk to 10 by the
/// next stage (10 updated, the other 71,990 deleted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chunked_upsert_writes_and_shrinks_a_child_set_of_any_size() {
    let mut f = fixture().await;
    let (grow, shrink) = (upsert("grow", 72_000, "old"), upsert("shrink", 10, "new"));
    let pipeline = Pipeline::new(vec![
        StageRef::named(grow.name.as_str(), grow.clone()).unwrap(),
        StageRef::named(shrink.name.as_str(), shrink.clone()).unwrap(),
    ])
    .unwrap();
    let job = f.item("1 Stk Wachsen").await;
    let exec = f.executor();
    for stage in pipeline.stages() {
        let outcome = exec.run(&pipeline, stage, &job).await.unwrap();
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { attempt: 1, .. }),
            "{}: {outcome:?}",
            stage.name()
        );
    }
    let grown = grow.did.lock().unwrap().unwrap();
    assert_eq!((grown.written, grown.deleted), (72_000, 0));
    let shrunk = shrink.did.lock().unwrap().unwrap();
    assert_eq!((shrunk.written, shrunk.deleted), (10, 71_990));
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM anfrage_extraktionen e JOIN stage_runs r ON r.id = e.run_id
              WHERE r.stage = 'shrink' AND e.description LIKE 'new %'"
        )
        .await,
        10
    );
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM anfrage_extraktionen").await,
        10
    );
}

/// How many rows one statement takes: as many as fit under 65,535 bind parameters;
/// a row binding none, or more than fit, is refused as bad input.
#[test]
fn rows_per_statement_stays_under_the_bind_limit_and_refuses_nonsense() {
    use idemstage_persistence::fenced::{rows_per_statement, MAX_BIND_PARAMETERS};
    assert_eq!(MAX_BIND_PARAMETERS, 65_535);
    assert_eq!(rows_per_statement(9).unwrap(), 7_281);
    assert_eq!(rows_per_statement(1).unwrap(), 65_535);
    assert_eq!(rows_per_statement(65_535).unwrap(), 1);
    for nonsense in [0, 65_536] {
        let err = rows_per_statement(nonsense).unwrap_err();
        assert!(err.is_bad_request(), "{err:?}");
        assert!(err.to_string().contains("binds_per_row"), "{err}");
    }
}
