//! A pipeline: stages in order, the jobs between them, and their payload.

use std::collections::HashMap;
use std::sync::Arc;

use idemstage_domain::queue::stage_singleton_key;
use idemstage_domain::{AnfrageId, DomainError, JobToSend, SendOptions, StageName, TenantId};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::Stage;

/// The payload of every stage job. The queue of a stage is named after the stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageJob {
    /// The tenant the anfrage belongs to; every write of the stage is scoped to it.
    pub tenant_id: TenantId,
    /// The anfrage the stage runs for.
    pub anfrage_id: AnfrageId,
    /// The hash the claim binds to: the SHA-256 of the anfrage's input.
    pub input_hash: String,
}

impl StageJob {
    /// Parses a job payload; a malformed one is a clear, permanent error.
    pub fn from_payload(queue: &str, payload: &serde_json::Value) -> Result<Self, DomainError> {
        let job: StageJob = serde_json::from_value(payload.clone())
            .map_err(|e| DomainError::InvalidPayload(format!("queue {queue}: {e}")))?;
        // One canonical form (lower-case hex, as `input_hash_of` writes it): an
        // upper-case hash of the same input is another string to the claim.
        if job.input_hash.len() != 64
            || !job
                .input_hash
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(DomainError::InvalidPayload(format!(
                "queue {queue}: input_hash must be 64 lower-case hex characters"
            )));
        }
        Ok(job)
    }
}

/// Why a pipeline was refused at construction ([`Pipeline::new`],
/// [`Pipeline::with_send_options`]): a configuration mistake, never retryable.
#[derive(Debug, Error)]
pub enum PipelineError {
    /// `Pipeline::new` was given no stage.
    #[error("pipeline has no stages")]
    Empty,
    /// Two stages share a name: a stage's name is its queue and its claim key.
    #[error("stage {0} appears twice in the pipeline")]
    DuplicateStage(StageName),
    /// A stage job that gives up before its stage does would leave the stage with
    /// no live job: lost.
    #[error(
        "the jobs' retry_limit {retry_limit} is below stage {stage}'s max_attempts {max_attempts}: \
         a job must outlive its stage's attempts"
    )]
    RetryBudgetTooSmall {
        /// The first stage whose attempts outnumber the job's retries.
        stage: StageName,
        /// The jobs' `SendOptions::retry_limit`.
        retry_limit: i32,
        /// The stage's `StagePolicy::max_attempts`.
        max_attempts: i32,
    },
    /// A stage's policy is invalid (`StagePolicy::validate`).
    #[error(transparent)]
    Invalid(#[from] DomainError),
}

/// Stages in order. Each stage's `policy().downstream` is what a rerun invalidates;
/// `Pipeline::new` checks the stages and the policies.
#[derive(Clone)]
pub struct Pipeline {
    stages: Vec<Arc<dyn Stage>>,
    index: HashMap<StageName, usize>,
    send_options: SendOptions,
}

impl Pipeline {
    /// A pipeline of `stages`, run in this order: each stage after the first runs
    /// on the current success of the one before it. Its jobs get
    /// [`Pipeline::default_send_options`]. Refused if `stages` is empty, a name
    /// repeats, a policy is invalid, or a stage's `max_attempts` exceeds the jobs'
    /// `retry_limit` (25).
    ///
    /// ```no_run
    /// use std::sync::Arc;
    ///
    /// use idemstage::{
    ///     async_trait, FencedTx, Pipeline, PipelineError, SendOptions, Stage, StageError,
    ///     StageFlow, StageJob, StageName, StagePolicy,
    /// };
    ///
    /// struct Step(StageName, StagePolicy);
    ///
    /// #[async_trait]
    /// impl Stage for Step {
    ///     fn name(&self) -> &StageName {
    ///         &self.0
    ///     }
    ///     fn policy(&self) -> &StagePolicy {
    ///         &self.1
    ///     }
    ///     async fn run(
    ///         &self,
    ///         _job: &StageJob,
    ///         _prepared: &idemstage::serde_json::Value,
    ///         _tx: &mut FencedTx<'_>,
    ///     ) -> Result<StageFlow, StageError> {
    ///         Ok(StageFlow::Continue)
    ///     }
    /// }
    ///
    /// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let step = |name: &str| -> Result<Arc<dyn Stage>, idemstage::DomainError> {
    ///     Ok(Arc::new(Step(StageName::parse(name)?, StagePolicy::default())))
    /// };
    /// // `ocr` runs on the anfrage's input, `translate` on `ocr`'s current success.
    /// let pipeline = Pipeline::new(vec![step("ocr")?, step("translate")?])?;
    /// assert_eq!(pipeline.first_stage().name().as_str(), "ocr");
    ///
    /// // Jobs that give up before their stage does are refused.
    /// let few_retries = Pipeline::default_send_options().with_retry_limit(2);
    /// assert!(matches!(
    ///     pipeline.with_send_options(few_retries),
    ///     Err(PipelineError::RetryBudgetTooSmall { .. })
    /// ));
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(stages: Vec<Arc<dyn Stage>>) -> Result<Self, PipelineError> {
        if stages.is_empty() {
            return Err(PipelineError::Empty);
        }
        let mut index = HashMap::new();
        for (i, stage) in stages.iter().enumerate() {
            stage.policy().validate()?;
            if index.insert(stage.name().clone(), i).is_some() {
                return Err(PipelineError::DuplicateStage(stage.name().clone()));
            }
        }
        Self {
            stages,
            index,
            send_options: SendOptions::default(),
        }
        .with_send_options(Self::default_send_options())
    }

    /// Stage jobs retry generously with capped backoff: the stage's `max_attempts`
    /// is what limits executions, and a job must outlive its stage's retries (a
    /// job that gives up first would leave the stage lost).
    pub fn default_send_options() -> SendOptions {
        SendOptions::default()
            .with_retry_limit(25)
            .with_retry_delay(std::time::Duration::from_millis(100))
            .with_retry_backoff(true)
            .with_retry_delay_max(std::time::Duration::from_secs(30))
            // Renewed by the worker while it runs: short, so a dead worker's job
            // comes back soon.
            .with_expire_in(std::time::Duration::from_secs(60))
    }

    /// Options for the jobs this pipeline sends (retries, job lease); the singleton
    /// key is always set per job. Refused if a job would give up before its stage:
    /// `retry_limit` must be at least every stage's `max_attempts`.
    pub fn with_send_options(mut self, options: SendOptions) -> Result<Self, PipelineError> {
        let retry_limit = options.retry_limit;
        for stage in &self.stages {
            let max_attempts = stage.policy().max_attempts;
            if retry_limit < max_attempts {
                return Err(PipelineError::RetryBudgetTooSmall {
                    stage: stage.name().clone(),
                    retry_limit,
                    max_attempts,
                });
            }
        }
        self.send_options = options;
        Ok(self)
    }

    /// The options of the jobs this pipeline sends (retries, job lease).
    pub fn send_options(&self) -> &SendOptions {
        &self.send_options
    }

    /// The stages, in order.
    pub fn stages(&self) -> &[Arc<dyn Stage>] {
        &self.stages
    }

    /// The stage that [`start`](crate::start) sends the first job for; its
    /// `on_input_change` policy decides about an anfrage's new input.
    pub fn first_stage(&self) -> &Arc<dyn Stage> {
        &self.stages[0]
    }

    /// The stage called `name` (its queue's name); `DomainError::UnknownStage` if
    /// there is none.
    pub fn stage(&self, name: &str) -> Result<&Arc<dyn Stage>, DomainError> {
        StageName::parse(name)
            .ok()
            .and_then(|n| self.index.get(&n))
            .map(|&i| &self.stages[i])
            .ok_or_else(|| DomainError::UnknownStage(name.to_owned()))
    }

    /// The stage before `stage`, whose current success `stage` runs on (`None` for
    /// the first stage, which runs on the anfrage's stored input).
    pub fn upstream_of(&self, stage: &StageName) -> Option<&Arc<dyn Stage>> {
        match self.index.get(stage) {
            Some(&i) if i > 0 => Some(&self.stages[i - 1]),
            _ => None,
        }
    }

    /// The stage after `stage`, whose job `stage`'s success sends (`None` for the
    /// last stage, or a name not in the pipeline).
    pub fn next(&self, stage: &StageName) -> Option<&Arc<dyn Stage>> {
        self.index.get(stage).and_then(|&i| self.stages.get(i + 1))
    }

    /// The names of the stages after `stage`: what a successful rerun of `stage`
    /// invalidates (the database follows the recorded lineage, not this list).
    pub fn downstream_of(&self, stage: &StageName) -> Vec<StageName> {
        match self.index.get(stage) {
            Some(&i) => self.stages[i + 1..]
                .iter()
                .map(|s| s.name().clone())
                .collect(),
            None => Vec::new(),
        }
    }

    /// The job that starts `stage` for an anfrage, with the seed's singleton key.
    pub fn job_for(&self, stage: &StageName, job: &StageJob) -> JobToSend {
        let mut options = self.send_options.clone();
        options.singleton_key = Some(stage_singleton_key(stage, &job.tenant_id, &job.anfrage_id));
        JobToSend {
            queue: stage.as_str().to_owned(),
            tenant: Some(job.tenant_id.clone()),
            payload: serde_json::to_value(job).expect("StageJob serializes"),
            options,
        }
    }
}

/// Helper for tests and CLIs: a job for the first stage.
pub fn first_job(
    pipeline: &Pipeline,
    tenant: TenantId,
    anfrage: AnfrageId,
    input_hash: String,
) -> JobToSend {
    pipeline.job_for(
        pipeline.first_stage().name(),
        &StageJob {
            tenant_id: tenant,
            anfrage_id: anfrage,
            input_hash,
        },
    )
}
