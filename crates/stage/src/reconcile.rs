//! The reconciler: one mechanism for every way a stage can lose its job (a job
//! deleted by hand, a job failed or cancelled while its stage was not final, a
//! send refused as `Duplicate` by a job that then failed). It sends again the job
//! of every expected stage that is not final and has no live job; the claim then
//! decides, as for any job (a duplicate send is harmless, so is a second
//! reconciler).
//!
//! Its cost is bounded: it looks only at the items in `items_open` (those
//! registered, or written a stage job for, since they were last found settled),
//! at most `batch_limit` per pass, in key order, continuing where the previous
//! pass stopped; per tenant of the batch it runs one scoped transaction of index
//! probes (the plan, and the sends), and one to settle the items it found
//! finished. The `PipelineWorker` runs passes back to back until the last open
//! item once an interval: the open items are those of the last interval, not
//! more, however fast a pipeline opens them. A `dead` stage is final and never
//! sent again (an operator's retry
//! revives it, and its job reopens the item). A `waiting` stage has no job by
//! design: the end of its wait sends one (a delivered signal, or the deadline,
//! which the `PipelineWorker` checks every `wait_interval`).

use diesel_async::AsyncPgConnection;
use idemstage_domain::{InputChangePolicy, ItemId, JobToSend, RepoError, SendResult, TenantId};
use idemstage_persistence::reconcile::{self, OpenItem, ReconciledStages, TenantPlan};
use idemstage_persistence::{queue, tenant, PgPool, TxError};

use crate::{Pipeline, StageJob};

/// What one [`Reconciler::pass`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Open items looked at.
    pub examined: usize,
    /// Stage jobs sent again.
    pub resent: usize,
    /// Stage jobs found lost whose send was `Duplicate` (another reconciler, or a
    /// worker, sent one meanwhile).
    pub duplicates: usize,
    /// Items found finished (every expected stage final, no live job): not
    /// looked at again until a job is written for them.
    pub settled: usize,
    /// The batch held the last open items: the next pass starts from the first.
    pub last_batch: bool,
}

/// Sends again the jobs of a pipeline's lost stages, one batch of open items
/// per [`pass`](Reconciler::pass). The `PipelineWorker` runs one (its
/// `reconcile_interval`); any number may run at once.
pub struct Reconciler {
    pipeline: Pipeline,
    stages: ReconciledStages,
    batch_limit: u32,
    /// The last item of the previous batch; `None`: start from the first.
    cursor: Option<OpenItem>,
}

impl Reconciler {
    /// The default number of open items a pass looks at.
    pub const DEFAULT_BATCH_LIMIT: u32 = 1000;

    /// A reconciler of `pipeline`'s stages, looking at
    /// [`DEFAULT_BATCH_LIMIT`](Self::DEFAULT_BATCH_LIMIT) items per pass.
    pub fn new(pipeline: Pipeline) -> Self {
        let shape = pipeline.shape();
        let stages = ReconciledStages {
            stages: shape.iter().map(|s| s.0.clone()).collect(),
            upstreams: shape.iter().map(|s| s.1.clone()).collect(),
            per_child: shape.iter().map(|s| s.2).collect(),
            gathers: shape.iter().map(|s| s.3).collect(),
            first_reruns: pipeline.first_stage().policy().on_input_change
                == InputChangePolicy::Rerun,
        };
        Self {
            pipeline,
            stages,
            batch_limit: Self::DEFAULT_BATCH_LIMIT,
            cursor: None,
        }
    }

    /// The same, looking at `limit` open items per pass (0 counts as 1).
    pub fn with_batch_limit(mut self, limit: u32) -> Self {
        self.batch_limit = limit.max(1);
        self
    }

    /// One pass on a connection of `pool`: the next batch of open items (from
    /// the first again once the last was reached), their lost stages' jobs sent,
    /// the finished ones settled. An error ends the pass; the next one goes on
    /// from the batch after it.
    pub async fn pass(&mut self, pool: &PgPool) -> Result<ReconcileReport, RepoError> {
        let mut conn = idemstage_persistence::get(pool).await?;
        let batch =
            reconcile::open_items(&mut conn, self.cursor.as_ref(), self.batch_limit).await?;
        self.cursor = if batch.len() < self.batch_limit as usize {
            None
        } else {
            batch.last().cloned()
        };
        let mut report = ReconcileReport {
            examined: batch.len(),
            last_batch: self.cursor.is_none(),
            ..ReconcileReport::default()
        };
        // The batch is in key order: each tenant's items are together.
        for group in batch.chunk_by(|a, b| a.tenant == b.tenant) {
            let tenant = &group[0].tenant;
            let items: Vec<ItemId> = group.iter().map(|a| a.item).collect();
            let (settled, sent) = self.resend(&mut conn, tenant, &items).await?;
            for result in sent {
                match result {
                    SendResult::Sent(_) => report.resent += 1,
                    SendResult::Duplicate => report.duplicates += 1,
                }
            }
            if !settled.is_empty() {
                // Its own transaction: it takes exclusive locks, and must not
                // hold them while waiting for anything (a send waits on a
                // concurrent insert of the same key).
                let stages = &self.stages;
                report.settled += tenant::transaction(&mut conn, tenant, async |conn| {
                    Ok::<_, TxError>(reconcile::settle(conn, stages, tenant, &settled).await?)
                })
                .await
                .map_err(TxError::into_repo)?;
            }
        }
        Ok(report)
    }

    /// In one transaction scoped to `tenant`: the plan for `items`, and the
    /// jobs of their lost stages sent. Returns the items found settled and the
    /// sends' results.
    async fn resend(
        &self,
        conn: &mut AsyncPgConnection,
        tenant: &TenantId,
        items: &[ItemId],
    ) -> Result<(Vec<ItemId>, Vec<SendResult>), RepoError> {
        tenant::transaction(conn, tenant, async |conn| {
            let TenantPlan { lost, settled } =
                reconcile::plan(conn, &self.stages, tenant, items).await?;
            let jobs: Vec<JobToSend> = lost
                .into_iter()
                .map(|lost| {
                    tracing::info!(
                        %tenant, item = %lost.item, stage = %lost.stage,
                        "reconciler: the stage is not final and has no live job; sending it again"
                    );
                    self.pipeline.job_for(
                        &lost.stage,
                        &StageJob {
                            tenant_id: tenant.clone(),
                            item_id: lost.item,
                            input_hash: lost.input_hash,
                        },
                    )
                })
                .collect();
            let sent = queue::send_batch(conn, &jobs).await?;
            Ok::<_, TxError>((settled, sent))
        })
        .await
        .map_err(TxError::into_repo)
    }
}
