//! `signal`: the signal a waiting stage waits for, delivered once.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, RunId, RunStatus, SendResult, StageName, TenantId};
use serde::Serialize;

use super::{audit, stored_hash, Actor, OpsError, RetryPlanner};

/// The most a signal's payload holds, as JSON text: 64 KiB. A signal carries a
/// decision (an approval, a provider's answer), not a document.
pub const MAX_SIGNAL_PAYLOAD_BYTES: usize = 64 * 1024;

/// Why a signal was not delivered: the stage does not wait for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum SignalRefusal {
    /// The stage is not waiting (and this signal was not delivered to its last
    /// wait either).
    NotWaiting {
        /// Its status.
        status: RunStatus,
    },
    /// It waits for another signal, or for a timer (`None`).
    OtherSignal {
        /// What it waits for.
        waiting_for: Option<StageName>,
    },
}

impl std::fmt::Display for SignalRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SignalRefusal::NotWaiting { status } => write!(f, "it is {status}, not waiting"),
            SignalRefusal::OtherSignal {
                waiting_for: Some(s),
            } => write!(f, "it waits for signal {s}"),
            SignalRefusal::OtherSignal { waiting_for: None } => f.write_str("it waits for a timer"),
        }
    }
}

/// What [`signal`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum SignalOutcome {
    /// The wait ended with this signal: the stage runs again (with a job) and
    /// reads it.
    Delivered {
        /// The run.
        run_id: RunId,
        /// The attempt that waited.
        attempt: i32,
        /// The job sent for it; `Duplicate`: a live job of its key exists.
        job: SendResult,
    },
    /// This signal was delivered to the stage's last wait already: nothing
    /// changed (a second delivery is reported, not applied).
    AlreadyDelivered {
        /// When it was delivered.
        delivered_at: DateTime<Utc>,
        /// Who delivered it.
        actor: String,
    },
}

/// Ends the wait with the signal, if the stage waits for it: the wait's row
/// (`ended_at IS NULL`, under the run's row lock) and the run (`waiting` →
/// its lease over, one more attempt in its budget, so claimable) in one
/// statement. `$1` tenant, `$2` item, `$3` stage, `$4` signal, `$5` payload,
/// `$6` actor, `$7` the reason.
pub(crate) const DELIVER: &str = "\
WITH run AS (
    SELECT id, attempts FROM stage_runs
     WHERE tenant_id = $1 AND item_id = $2 AND stage = $3 AND status = 'waiting'
       FOR UPDATE),
ended AS (
    UPDATE stage_waits w
       SET ended_at = clock_timestamp(), ended_by = 'signal', payload = $5, actor = $6
      FROM run
     WHERE w.run_id = run.id AND w.attempt = run.attempts AND w.ended_at IS NULL
       AND w.signal = $4
    RETURNING w.run_id, w.attempt)
UPDATE stage_runs r
   SET status = 'running', lease_expires_at = clock_timestamp(),
       max_attempts = r.max_attempts + 1, last_error = $7
  FROM ended
 WHERE r.id = ended.run_id AND r.attempts = ended.attempt
RETURNING r.id, r.attempts";

/// Why a delivery changed nothing: the run's status and its last wait.
const EXPLAIN: &str = "\
SELECT r.status, w.signal, w.ended_by, w.ended_at, w.actor
  FROM stage_runs r
  LEFT JOIN LATERAL (SELECT * FROM stage_waits w WHERE w.run_id = r.id
                      ORDER BY w.attempt DESC LIMIT 1) w ON true
 WHERE r.tenant_id = $1 AND r.item_id = $2 AND r.stage = $3";

#[derive(QueryableByName)]
struct Delivered {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

#[derive(QueryableByName)]
struct Explained {
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Nullable<Text>)]
    signal: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    ended_by: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    ended_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    actor: Option<String>,
}

/// Delivers the signal `name` with `payload` to `stage` of the item, in one
/// transaction scoped to `tenant` (another tenant's item is `ItemNotFound`):
/// if the stage waits for it, the wait ends (once: a second delivery finds it
/// ended and is `AlreadyDelivered`, nothing changed), the stage gets its job
/// (`planner.job`) and runs again through the normal claim, reading the
/// payload; one `audit_log` entry (`operator.signal`, with `actor`). Refused
/// with nothing changed: a payload over [`MAX_SIGNAL_PAYLOAD_BYTES`]
/// (`Invalid`), an unknown stage (`UnknownStage`), one without a run
/// (`StageNotStarted`), one that does not wait for this signal
/// (`SignalRefused`).
#[allow(clippy::too_many_arguments)]
pub async fn signal(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
    name: &StageName,
    payload: &serde_json::Value,
    actor: &Actor,
    planner: &dyn RetryPlanner,
) -> Result<SignalOutcome, OpsError> {
    if planner.budget(stage).is_none() {
        return Err(OpsError::UnknownStage(stage.to_string()));
    }
    let size = payload.to_string().len();
    if size > MAX_SIGNAL_PAYLOAD_BYTES {
        return Err(idemstage_domain::DomainError::InvalidOption(format!(
            "a signal's payload of {size} bytes: at most {MAX_SIGNAL_PAYLOAD_BYTES} (as JSON)"
        ))
        .into());
    }
    let mut tries = 0;
    loop {
        let result = crate::tenant::transaction::<_, OpsError, _>(conn, tenant, async |conn| {
            signal_in(conn, tenant, item, stage, name, payload, actor, planner).await
        })
        .await;
        if !super::again_after(&result, &mut tries).await {
            return result;
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn signal_in(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
    name: &StageName,
    payload: &serde_json::Value,
    actor: &Actor,
    planner: &dyn RetryPlanner,
) -> Result<SignalOutcome, OpsError> {
    let hash = stored_hash(conn, tenant, item).await?;
    let delivered: Option<Delivered> = diesel::sql_query(DELIVER)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .bind::<Text, _>(stage.as_str())
        .bind::<Text, _>(name.as_str())
        .bind::<Jsonb, _>(payload)
        .bind::<Text, _>(actor.as_str())
        .bind::<Text, _>(format!("signal {name} delivered by {actor}"))
        .get_result(conn)
        .await
        .optional()?;
    let Some(delivered) = delivered else {
        return not_delivered(conn, tenant, item, stage, name).await;
    };
    let job = planner.job(stage, tenant, item, &hash);
    let sent = crate::queue::send_in(conn, &job).await?;
    let run_id = RunId::parse(&delivered.id)?;
    let details = serde_json::json!({
        "actor": actor,
        "stage": stage,
        "signal": name,
        "run_id": run_id,
        "attempt": delivered.attempts,
        "payload": payload,
    });
    audit(conn, tenant, item, "operator.signal", details, None).await?;
    Ok(SignalOutcome::Delivered {
        run_id,
        attempt: delivered.attempts,
        job: sent,
    })
}

async fn not_delivered(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
    name: &StageName,
) -> Result<SignalOutcome, OpsError> {
    let e: Option<Explained> = diesel::sql_query(EXPLAIN)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .bind::<Text, _>(stage.as_str())
        .get_result(conn)
        .await
        .optional()?;
    let Some(e) = e else {
        return Err(OpsError::StageNotStarted {
            tenant: tenant.clone(),
            item: *item,
            stage: stage.clone(),
        });
    };
    let status: RunStatus = e.status.parse()?;
    let refused = |reason| OpsError::SignalRefused {
        tenant: tenant.clone(),
        item: *item,
        stage: stage.clone(),
        reason,
    };
    if e.ended_by.as_deref() == Some("signal") && e.signal.as_deref() == Some(name.as_str()) {
        return Ok(SignalOutcome::AlreadyDelivered {
            delivered_at: e.ended_at.unwrap_or_default(),
            actor: e.actor.unwrap_or_default(),
        });
    }
    if status == RunStatus::Waiting {
        let waiting_for = e.signal.as_deref().map(StageName::parse).transpose()?;
        return Err(refused(SignalRefusal::OtherSignal { waiting_for }));
    }
    Err(refused(SignalRefusal::NotWaiting { status }))
}
