//! The pipeline's side of the operator commands: what a retry needs to know of
//! it (`idemstage_persistence::ops::RetryPlanner`).

use idemstage_domain::{ItemId, JobToSend, StageName, TenantId};
use idemstage_persistence::ops::RetryPlanner;

use crate::{Pipeline, StageJob};

/// A retried stage gets its policy's `max_attempts` afresh, and the job the
/// pipeline sends for it (its singleton key and send options): a retry's job is
/// the same job as the one the stage before would send.
impl RetryPlanner for Pipeline {
    fn budget(&self, stage: &StageName) -> Option<i32> {
        self.stage(stage.as_str())
            .ok()
            .map(|s| s.policy().max_attempts)
    }

    fn job(
        &self,
        stage: &StageName,
        tenant: &TenantId,
        item: &ItemId,
        input_hash: &str,
    ) -> JobToSend {
        self.job_for(
            stage,
            &StageJob {
                tenant_id: tenant.clone(),
                item_id: *item,
                input_hash: input_hash.to_owned(),
            },
        )
    }
}
