//! Queue types shared by the stage layer (which sends the next stage's job) and
//! persistence (which stores jobs).

use std::time::Duration;

use serde::Serialize;

use crate::{DomainError, JobId};

/// Options of one send. Defaults: priority 0, start now, 2 retries, no delay,
/// 15 minutes job lease, no dead-letter queue, no throttle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendOptions {
    /// At most one live (queued, retrying or active) job per (queue, key).
    pub singleton_key: Option<String>,
    /// With a key: at most one job per (queue, key) per window of this many seconds,
    /// whatever its state.
    pub singleton_seconds: Option<u32>,
    /// Higher runs first.
    pub priority: i32,
    pub start_after: Option<Duration>,
    pub retry_limit: i32,
    pub retry_delay: Duration,
    /// Exponential backoff with jitter, capped by `retry_delay_max`.
    pub retry_backoff: bool,
    pub retry_delay_max: Option<Duration>,
    /// The job lease: an active job not completed within this is retried.
    pub expire_in: Duration,
    /// Queue that receives a copy of the job when it fails for good.
    pub dead_letter: Option<String>,
}

impl Default for SendOptions {
    fn default() -> Self {
        Self {
            singleton_key: None,
            singleton_seconds: None,
            priority: 0,
            start_after: None,
            retry_limit: 2,
            retry_delay: Duration::ZERO,
            retry_backoff: false,
            retry_delay_max: None,
            expire_in: Duration::from_secs(15 * 60),
            dead_letter: None,
        }
    }
}

impl SendOptions {
    pub fn validate(&self) -> Result<(), DomainError> {
        use DomainError::InvalidOption;
        if self.retry_limit < 0 {
            return Err(InvalidOption("retry_limit must not be negative".into()));
        }
        if self.expire_in.is_zero() {
            return Err(InvalidOption("expire_in must be positive".into()));
        }
        if self.singleton_seconds.is_some() && self.singleton_key.is_none() {
            return Err(InvalidOption(
                "singleton_seconds needs a singleton_key".into(),
            ));
        }
        if self.singleton_seconds == Some(0) {
            return Err(InvalidOption("singleton_seconds must be positive".into()));
        }
        if let Some(key) = &self.singleton_key {
            if key.is_empty() || key.len() > 512 {
                return Err(InvalidOption(
                    "singleton_key must have 1..=512 bytes".into(),
                ));
            }
        }
        Ok(())
    }
}

/// A job to send: queue name, serialized payload, options.
#[derive(Clone, Debug, PartialEq)]
pub struct JobToSend {
    pub queue: String,
    pub payload: serde_json::Value,
    pub options: SendOptions,
}

/// Validates a queue name: `[A-Za-z0-9_.:-]{1,100}` (same as the SQL CHECK).
pub fn validate_queue_name(name: &str) -> Result<(), DomainError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(DomainError::InvalidOption(format!(
            "invalid queue name {name:?}: expected [A-Za-z0-9_.:-]{{1,100}}"
        )))
    }
}

/// The result of a send: a duplicate is an outcome, never an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SendResult {
    Sent(JobId),
    Duplicate,
}

/// `jobs.state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Created,
    Retry,
    Active,
    Completed,
    Cancelled,
    Failed,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Created,
        JobState::Retry,
        JobState::Active,
        JobState::Completed,
        JobState::Cancelled,
        JobState::Failed,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Created => "created",
            JobState::Retry => "retry",
            JobState::Active => "active",
            JobState::Completed => "completed",
            JobState::Cancelled => "cancelled",
            JobState::Failed => "failed",
        }
    }
}

/// The singleton key convention of the seed: `"{stage}:{tenant_id}:{anfrage_id}"`.
pub fn stage_singleton_key(
    stage: &crate::StageName,
    tenant: &crate::TenantId,
    anfrage: &crate::AnfrageId,
) -> String {
    format!("{stage}:{tenant}:{anfrage}")
}
