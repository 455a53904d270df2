//! Issue 29, item 5: an error that never reached the server is not a lost
//! connection, and interruptions that are released uncounted are bounded, so that
//! a deterministic failure ends `dead` with its reason instead of looping.

use diesel::sql_types::{Integer, Nullable, Text};
use diesel::ExpressionMethods;
use idemstage_domain::RepoError;
use idemstage_example::schema::dateien;
use idemstage_persistence::map_diesel_error;

use super::*;

#[derive(diesel::QueryableByName, Debug)]
struct RunRow {
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

async fn run_row(conn: &mut AsyncPgConnection, stage: &str) -> RunRow {
    diesel::sql_query("SELECT status, attempts, last_error FROM stage_runs WHERE stage = $1")
        .bind::<Text, _>(stage)
        .get_result(conn)
        .await
        .unwrap()
}

/// "error encoding message to server" is the driver refusing a statement before
/// anything was sent: the same statement fails the same way on every attempt, and
/// the connection is as good as before. It was classed `Unavailable`.
#[tokio::test]
async fn a_statement_the_driver_cannot_encode_is_a_database_error_not_unavailable() {
    let mut f = fixture().await;
    use dateien::dsl as d;
    // 11,000 rows of 6 bound columns: 66,000 bind parameters.
    let rows: Vec<_> = (0..11_000)
        .map(|i| {
            (
                d::id.eq(idemstage_domain::RowId::new().to_string()),
                d::tenant_id.eq("t1"),
                d::item_id.eq(ItemId::new().to_string()),
                d::sha256.eq(format!("{i:064x}")),
                d::s3_key.eq("k"),
                d::size_bytes.eq(1i64),
            )
        })
        .collect();
    let err = diesel::insert_into(d::dateien)
        .values(rows)
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    let mapped = map_diesel_error(err);
    assert!(
        matches!(&mapped, RepoError::Database(m) if m.contains("65,535 bind parameters")),
        "{mapped:?}"
    );
    assert!(!mapped.is_retryable());
    // The connection was never gone.
    assert_eq!(count(&mut f.conn, "SELECT 1").await, 1);
}

/// A stage whose body hits a statement timeout (57014, an interruption: released
/// uncounted) on every attempt.
struct AlwaysInterrupted {
    policy: StagePolicy,
}

#[async_trait]
impl Stage for AlwaysInterrupted {
    const NAME: &'static str = "flaky";
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
        diesel::sql_query("SET LOCAL statement_timeout = '20ms'")
            .execute(tx.conn())
            .await
            .map_err(map_diesel_error)?;
        diesel::sql_query("SELECT pg_sleep(1)")
            .execute(tx.conn())
            .await
            .map_err(map_diesel_error)?;
        Ok(Done::next(()))
    }
}

/// Runs an `AlwaysInterrupted` stage under `policy` until its run is final (at
/// most `limit` executions); returns the outcomes.
async fn run_until_final(
    f: &Fixture,
    policy: StagePolicy,
    job: &StageJob,
    limit: usize,
) -> Vec<ExecutionOutcome> {
    let stage = StageRef::new(AlwaysInterrupted { policy }).unwrap();
    let pipeline = Pipeline::new(vec![stage.clone()]).unwrap();
    let exec = f.executor();
    let mut outcomes = Vec::new();
    for _ in 0..limit {
        let outcome = exec.run(&pipeline, &stage, job).await.unwrap();
        let last = matches!(
            outcome,
            ExecutionOutcome::Failed { dead: true, .. } | ExecutionOutcome::Exhausted { .. }
        );
        outcomes.push(outcome);
        if last {
            break;
        }
    }
    outcomes
}

/// With the default policy (5 uncounted interruptions in a row) and one attempt,
/// the sixth interruption counts and the run is `dead` with the error. Each
/// interruption used to raise `max_attempts`: 40 executions, 40 releases.
#[tokio::test]
async fn a_stage_interrupted_every_time_ends_dead_after_its_bound() {
    let mut f = fixture().await;
    let job = f.item("1 Stk Warten").await;
    let outcomes = run_until_final(&f, StagePolicy::default().with_max_attempts(1), &job, 40).await;
    let kinds: Vec<&str> = outcomes
        .iter()
        .map(|o| match o {
            ExecutionOutcome::Interrupted { .. } => "interrupted",
            ExecutionOutcome::Failed { dead: true, .. } => "dead",
            _ => "other",
        })
        .collect();
    assert_eq!(
        kinds,
        [&["interrupted"; 5][..], &["dead"]].concat(),
        "{outcomes:?}"
    );
    let run = run_row(&mut f.conn, "flaky").await;
    assert_eq!((run.status.as_str(), run.attempts), ("dead", 6), "{run:?}");
    let error = run.last_error.unwrap_or_default();
    assert!(error.contains("statement timeout"), "{error}");
    assert!(error.contains("5 interruptions in a row"), "{error}");
    // The history: five attempts given back, the sixth failed with the reason.
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_run_attempts WHERE outcome = 'abandoned' AND attempt <= 5"
        )
        .await,
        5
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_run_attempts
              WHERE attempt = 6 AND outcome = 'failed' AND error LIKE '%statement timeout%'"
        )
        .await,
        1
    );
}

/// The bound is the policy's: with `max_interruptions` 1 and two attempts, every
/// second interruption counts, and the run is `dead` after four executions. A
/// negative bound is refused before anything is claimed.
#[tokio::test]
async fn the_bound_on_interruptions_in_a_row_is_the_stages_policy() {
    let mut f = fixture().await;
    let job = f.item("1 Stk Warten").await;
    let policy = StagePolicy::default()
        .with_max_attempts(2)
        .with_max_interruptions(1);
    let outcomes = run_until_final(&f, policy, &job, 20).await;
    let kinds: Vec<String> = outcomes
        .iter()
        .map(|o| match o {
            ExecutionOutcome::Interrupted { attempt, .. } => format!("interrupted {attempt}"),
            ExecutionOutcome::Failed { attempt, dead, .. } => format!("failed {attempt} {dead}"),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "interrupted 1",
            "failed 2 false",
            "interrupted 3",
            "failed 4 true"
        ],
        "{outcomes:?}"
    );
    let run = run_row(&mut f.conn, "flaky").await;
    assert_eq!((run.status.as_str(), run.attempts), ("dead", 4), "{run:?}");
    let error = run.last_error.unwrap_or_default();
    assert!(
        error.contains("counted after 1 interruptions in a row"),
        "{error}"
    );

    let job = f.item("2 Stk Warten").await;
    let stage = StageRef::new(AlwaysInterrupted {
        policy: StagePolicy::default().with_max_interruptions(-1),
    })
    .unwrap();
    let refused = match Pipeline::new(vec![stage.clone()]) {
        Err(e) => e.to_string(),
        Ok(pipeline) => f
            .executor()
            .run(&pipeline, &stage, &job)
            .await
            .unwrap_err()
            .to_string(),
    };
    assert!(refused.contains("max_interruptions"), "{refused}");
    assert_eq!(
        count(
            &mut f.conn,
            &format!("SELECT 1 FROM stage_runs WHERE item_id = '{}'", job.item_id)
        )
        .await,
        0
    );
}
