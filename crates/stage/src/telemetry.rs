//! The executor's metrics, recorded through the [`metrics`] facade (a no-op until
//! the binary installs a recorder, e.g. `idemstage worker --metrics-listen`).
//! Labels are the stage's name, the outcome and a reason: never a tenant or an
//! item, so that the number of series stays bounded by the pipeline's shape.

use std::time::Duration;

use idemstage_domain::{RejectReason, RepoError, SkipReason};

use crate::ExecutionOutcome;

/// Counter: executions by `stage`, `outcome` (see [`outcome_label`]) and, for
/// `skipped` and `rejected`, `reason`.
pub const STAGE_OUTCOMES: &str = "idemstage_stage_outcomes_total";
/// Histogram, seconds: one execution from its claim to its outcome (a skip is the
/// claim alone), by `stage` and `outcome`.
pub const STAGE_DURATION: &str = "idemstage_stage_duration_seconds";
/// Counter: stage lease renewals (heartbeats) by `stage` and `outcome`: `renewed`,
/// `lost` (fenced: someone took the stage over, the body is cancelled) or `error`
/// (a database error; retried at the next beat).
pub const STAGE_LEASE_RENEWALS: &str = "idemstage_stage_lease_renewals_total";
/// Counter: prepared values by `stage` and `source`: `prepared` (the stage's
/// `prepare` ran: an external call was paid) or `reused` (a checkpoint of an
/// earlier attempt on the same binding was used instead).
pub const STAGE_PREPARED: &str = "idemstage_stage_prepared_total";

/// Describes this crate's metrics to the installed recorder (their help text and
/// units); call it once after installing one.
pub fn describe() {
    metrics::describe_counter!(
        STAGE_OUTCOMES,
        "Stage executions by stage, outcome and (skipped, rejected) reason"
    );
    metrics::describe_histogram!(
        STAGE_DURATION,
        metrics::Unit::Seconds,
        "Stage executions from claim to outcome, by stage and outcome"
    );
    metrics::describe_counter!(
        STAGE_LEASE_RENEWALS,
        "Stage lease renewals (heartbeats) by stage and outcome (renewed, lost, error)"
    );
    metrics::describe_counter!(
        STAGE_PREPARED,
        "Prepared values by stage and source (prepared: prepare ran; reused: a checkpoint)"
    );
}

pub(crate) fn record_prepared(stage: &str, source: &'static str) {
    metrics::counter!(STAGE_PREPARED, "stage" => stage.to_owned(), "source" => source).increment(1);
}

/// The `outcome` label of an execution's result: `success`, `skipped`,
/// `rejected`, `fenced`, `upstream_changed`, `interrupted`, `rate_limited`,
/// `failed` (will retry), `dead`, `exhausted`, `waiting`, or `error` (a database error left
/// the outcome unknown; the job is deferred).
pub fn outcome_label(outcome: &Result<ExecutionOutcome, RepoError>) -> &'static str {
    match outcome {
        Ok(ExecutionOutcome::Succeeded { .. }) => "success",
        Ok(ExecutionOutcome::Skipped(_)) => "skipped",
        Ok(ExecutionOutcome::Rejected(_)) => "rejected",
        Ok(ExecutionOutcome::Fenced { .. }) => "fenced",
        Ok(ExecutionOutcome::UpstreamChanged { .. }) => "upstream_changed",
        Ok(ExecutionOutcome::Interrupted { .. }) => "interrupted",
        Ok(ExecutionOutcome::RateLimited { .. }) => "rate_limited",
        Ok(ExecutionOutcome::Failed { dead: false, .. }) => "failed",
        Ok(ExecutionOutcome::Failed { dead: true, .. }) => "dead",
        Ok(ExecutionOutcome::Exhausted { .. }) => "exhausted",
        Ok(ExecutionOutcome::Waiting { .. }) => "waiting",
        Err(_) => "error",
    }
}

/// The `reason` label of a skip or a rejection.
fn reason_label(outcome: &Result<ExecutionOutcome, RepoError>) -> Option<&'static str> {
    Some(match outcome {
        Ok(ExecutionOutcome::Skipped(SkipReason::AlreadySucceeded { .. })) => "already_succeeded",
        Ok(ExecutionOutcome::Skipped(SkipReason::InFlight { .. })) => "in_flight",
        Ok(ExecutionOutcome::Skipped(SkipReason::UpstreamNotDone { .. })) => "upstream_not_done",
        Ok(ExecutionOutcome::Skipped(SkipReason::Waiting { .. })) => "waiting",
        Ok(ExecutionOutcome::Skipped(SkipReason::Superseded)) => "superseded",
        Ok(ExecutionOutcome::Skipped(SkipReason::ChildrenNotFinal { .. })) => "children_not_final",
        Ok(ExecutionOutcome::Rejected(RejectReason::InputChanged { .. })) => "input_changed",
        Ok(ExecutionOutcome::Rejected(RejectReason::InputMismatch { .. })) => "input_mismatch",
        _ => return None,
    })
}

/// Counts one execution of `stage` and records its duration.
pub(crate) fn record_execution(
    stage: &str,
    outcome: &Result<ExecutionOutcome, RepoError>,
    took: Duration,
) {
    let label = outcome_label(outcome);
    match reason_label(outcome) {
        Some(reason) => metrics::counter!(
            STAGE_OUTCOMES,
            "stage" => stage.to_owned(),
            "outcome" => label,
            "reason" => reason
        )
        .increment(1),
        None => metrics::counter!(STAGE_OUTCOMES, "stage" => stage.to_owned(), "outcome" => label)
            .increment(1),
    }
    metrics::histogram!(STAGE_DURATION, "stage" => stage.to_owned(), "outcome" => label)
        .record(took.as_secs_f64());
}

/// Counts one stage lease renewal of `stage` (`renewed`, `lost`, `error`).
pub(crate) fn record_renewal(stage: &str, outcome: &'static str) {
    metrics::counter!(STAGE_LEASE_RENEWALS, "stage" => stage.to_owned(), "outcome" => outcome)
        .increment(1);
}
