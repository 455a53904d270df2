//! A product team's own pipeline, defined here, outside our crates: its own stage
//! names, order and policies, without editing `idemstage-stage`.

use idemstage_persistence::FencedTx;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemstage_domain::{InputChangePolicy, StageError, StageName, StagePolicy, TenantId, WorkerId};
use idemstage_persistence::PgRunRepository;
use idemstage_stage::{ExecutionOutcome, Executor, Pipeline, Stage, StageFlow, StageJob};
use idemstage_testkit::TestDb;

use crate::support::*;

/// A stage that records that it ran, in the fenced transaction.
struct Recorder {
    name: StageName,
    policy: StagePolicy,
}

impl Recorder {
    fn stage(name: &str, policy: StagePolicy) -> Arc<dyn Stage> {
        Arc::new(Self {
            name: StageName::parse(name).unwrap(),
            policy,
        })
    }
}

#[async_trait]
impl Stage for Recorder {
    fn name(&self) -> &StageName {
        &self.name
    }
    fn policy(&self) -> &StagePolicy {
        &self.policy
    }
    async fn run(
        &self,
        job: &StageJob,
        _: &serde_json::Value,
        tx: &mut FencedTx<'_>,
    ) -> Result<StageFlow, StageError> {
        tx.audit(
            &job.anfrage_id.to_string(),
            &format!("{}.ran", self.name),
            serde_json::json!({ "attempt": tx.token().attempt }),
        )
        .await?;
        Ok(StageFlow::Continue)
    }
}

#[tokio::test]
async fn a_team_defines_and_runs_its_own_pipeline() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let ocr_policy = StagePolicy {
        max_attempts: 2,
        lease: Duration::from_secs(60),
        heartbeat: Duration::from_secs(20),
        on_input_change: InputChangePolicy::Rerun,
        ..StagePolicy::default()
    };
    let pipeline = Pipeline::new(vec![
        Recorder::stage("ocr", ocr_policy),
        Recorder::stage("translate", StagePolicy::default()),
    ])
    .unwrap();
    assert_eq!(
        pipeline.downstream_of(&StageName::parse("ocr").unwrap()),
        vec![StageName::parse("translate").unwrap()]
    );
    // A duplicate stage name is refused when the pipeline is built.
    assert!(Pipeline::new(vec![
        Recorder::stage("ocr", StagePolicy::default()),
        Recorder::stage("ocr", StagePolicy::default()),
    ])
    .is_err());

    let tenant = TenantId::parse("team-b").unwrap();
    let (anfrage, hash) = anfrage(&mut conn, &tenant, "scan.pdf").await;
    let job = StageJob {
        tenant_id: tenant,
        anfrage_id: anfrage,
        input_hash: hash,
    };
    let exec = Executor::new(
        Arc::new(PgRunRepository::new(db.pool(4).await)),
        WorkerId::generate(),
    );
    for stage in pipeline.stages() {
        assert!(matches!(
            exec.run(&pipeline, stage, &job).await.unwrap(),
            ExecutionOutcome::Succeeded { attempt: 1, .. }
        ));
    }
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM audit_log WHERE action IN ('ocr.ran', 'translate.ran')"
        )
        .await,
        2
    );
    // ocr handed off to translate through the queue, with the seed's singleton key.
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT * FROM jobs WHERE queue = 'translate' AND singleton_key = 'translate:team-b:{anfrage}'")
        )
        .await,
        1
    );

    // New input for ocr: its Rerun policy re-runs it and makes translate stale.
    diesel_async::RunQueryDsl::execute(
        diesel::sql_query(format!(
            "UPDATE anfragen SET input_text = 'scan2.pdf', input_sha256 = '{}' WHERE id = '{anfrage}'",
            idemstage_domain::input_hash_of(b"scan2.pdf")
        )),
        &mut conn,
    )
    .await
    .unwrap();
    let changed = StageJob {
        input_hash: idemstage_domain::input_hash_of(b"scan2.pdf"),
        ..job.clone()
    };
    assert!(matches!(
        exec.run(&pipeline, &pipeline.stages()[0], &changed)
            .await
            .unwrap(),
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM pipeline_runs WHERE stage = 'translate' AND status = 'stale'"
        )
        .await,
        1
    );
    assert!(matches!(
        exec.run(&pipeline, &pipeline.stages()[1], &changed)
            .await
            .unwrap(),
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
}
