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
//! probes (the plan, the sends, and the items not settled opened again), and one
//! to settle the items it found finished. `items_open` is a ring of slots: a
//! round starts by moving the ring on, then passes each older slot and
//! truncates it, so nothing is deleted. The `PipelineWorker` runs passes back
//! to back until the round's end once an interval: the open items are those of
//! the last interval, not more, however fast a pipeline opens them. A `dead`
//! stage is final and never sent again (an operator's retry revives it, and
//! its job reopens the item). A `waiting` stage has no job by
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
    /// The batch held the round's last open items: the next pass starts a
    /// new round (the ring moves on).
    pub last_batch: bool,
    /// Slots passed and emptied by this pass.
    pub truncated: usize,
}

/// Sends again the jobs of a pipeline's lost stages, one batch of open items
/// per [`pass`](Reconciler::pass). The `PipelineWorker` runs one (its
/// `reconcile_interval`); any number may run at once.
pub struct Reconciler {
    pipeline: Pipeline,
    stages: ReconciledStages,
    batch_limit: u32,
    /// How old the ring's current slot must be before a round moves it on.
    rotation_age: std::time::Duration,
    /// Where the round is; `None`: the next pass starts one.
    round: Option<Round>,
}

/// A round over the ring's slots but the current one, oldest first.
struct Round {
    /// The slots still to pass, the next first.
    slots: std::collections::VecDeque<i16>,
    /// The next slot's writers were waited for.
    sealed: bool,
    /// The last item of the previous batch of the next slot.
    after: Option<OpenItem>,
    /// Items read from the next slot so far (none: nothing to truncate).
    read: usize,
    /// A batch of the next slot failed: its items may not be open elsewhere,
    /// so the slot is not truncated this round (the next passes it again).
    failed: bool,
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
            rotation_age: std::time::Duration::ZERO,
            round: None,
        }
    }

    /// The same, looking at `limit` open items per pass (0 counts as 1).
    pub fn with_batch_limit(mut self, limit: u32) -> Self {
        self.batch_limit = limit.max(1);
        self
    }

    /// The same, moving the ring of open items on only once its current
    /// slot's oldest item is `age` old (default: at once). Reconcilers whose
    /// intervals start together then take turns: the second finds the ring
    /// just moved and passes nothing, where both would pass the same slots
    /// and find each other's locks on the items (the `PipelineWorker` sets
    /// half its interval).
    pub fn with_rotation_age(mut self, age: std::time::Duration) -> Self {
        self.rotation_age = age;
        self
    }

    /// One pass on a connection of `pool`: the next batch of open items (a new
    /// round once the last was reached: the ring moves on first), their lost
    /// stages' jobs sent, the finished ones settled, the others opened again
    /// in the current slot; a slot passed to its end is truncated. An error
    /// ends the pass; the next one goes on from the batch after it.
    pub async fn pass(&mut self, pool: &PgPool) -> Result<ReconcileReport, RepoError> {
        let mut conn = idemstage_persistence::get(pool).await?;
        let mut report = ReconcileReport::default();
        let round = match &mut self.round {
            Some(round) => round,
            None => self.round.insert(Round {
                slots: reconcile::rotate(&mut conn, self.rotation_age)
                    .await?
                    .slots()
                    .iter()
                    .copied()
                    .collect(),
                sealed: false,
                after: None,
                read: 0,
                failed: false,
            }),
        };
        let (slot, batch) = loop {
            let Some(&slot) = round.slots.front() else {
                self.round = None;
                report.last_batch = true;
                return Ok(report);
            };
            if !round.sealed {
                if !reconcile::seal(&mut conn, slot).await? {
                    // A rotation since the round began made it current.
                    round.slots.pop_front();
                    continue;
                }
                round.sealed = true;
            }
            let batch =
                reconcile::open_items(&mut conn, slot, round.after.as_ref(), self.batch_limit)
                    .await?;
            round.read += batch.len();
            round.after = batch.last().cloned();
            if !batch.is_empty() || round.read > 0 {
                break (slot, batch);
            }
            // Nothing in it this round: nothing to truncate either.
            round.slots.pop_front();
            round.sealed = false;
        };
        let slot_done = batch.len() < self.batch_limit as usize;
        report.examined = batch.len();
        if let Err(e) = self.settle_batch(&mut conn, &batch, &mut report).await {
            if let Some(round) = &mut self.round {
                round.failed = true;
            }
            return Err(e);
        }
        if slot_done {
            let round = self.round.as_mut().expect("the round of this pass");
            // Every item of the slot is settled or open in the current one.
            if !round.failed && reconcile::truncate(&mut conn, slot).await? {
                report.truncated += 1;
            }
            round.slots.pop_front();
            round.sealed = false;
            round.after = None;
            round.read = 0;
            round.failed = false;
            if round.slots.is_empty() {
                self.round = None;
                report.last_batch = true;
            }
        }
        Ok(report)
    }

    /// The batch's lost stages sent, its finished items settled, the others
    /// opened again in the current slot.
    async fn settle_batch(
        &self,
        conn: &mut AsyncPgConnection,
        batch: &[OpenItem],
        report: &mut ReconcileReport,
    ) -> Result<(), RepoError> {
        // The batch is in key order: each tenant's items are together.
        for group in batch.chunk_by(|a, b| a.tenant == b.tenant) {
            let tenant = &group[0].tenant;
            let items: Vec<ItemId> = group.iter().map(|a| a.item).collect();
            let (settled, sent) = self.resend(conn, tenant, &items).await?;
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
                report.settled += tenant::transaction(conn, tenant, async |conn| {
                    Ok::<_, TxError>(reconcile::settle(conn, stages, tenant, &settled).await?)
                })
                .await
                .map_err(TxError::into_repo)?;
            }
        }
        Ok(())
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
            // Not settled: open again in the current slot, before this slot's
            // truncate (the found-settled ones are decided by `settle`).
            reconcile::carry(conn, tenant, items, &settled).await?;
            Ok::<_, TxError>((settled, sent))
        })
        .await
        .map_err(TxError::into_repo)
    }
}
