//! Durable waits, fenced on the token: an attempt ends `waiting` for a signal or
//! a timer ([`WaitFor`]), and a later attempt on the same binding reads how
//! that wait ended ([`Signal`]).

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::RunQueryDsl;
use idemstage_domain::{sanitize_error_text, ClaimToken, RepoError, Signal, StageName, WaitFor};

use crate::error::map_diesel_error;

use super::PgRunRepository;

/// What [`PgRunRepository::wait`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The run is `waiting` until its signal, or until `until`.
    Waiting {
        /// The wait's deadline (database clock).
        until: DateTime<Utc>,
    },
    /// The token no longer holds: nothing was recorded.
    Fenced,
}

/// The attempt ends in a wait: the run `waiting` (its lease over), and the
/// wait's row with its deadline. Fenced on the token. `$1` run, `$2` attempt,
/// `$3` the reason, `$4` signal (NULL: a timer), `$5` timeout in ms, `$6` what
/// the deadline does.
pub const WAIT: &str = "\
WITH r AS (
    UPDATE stage_runs
       SET status = 'waiting', lease_expires_at = clock_timestamp(), last_error = $3
     WHERE id = $1 AND attempts = $2 AND status = 'running'
    RETURNING id, tenant_id, attempts, stage)
INSERT INTO stage_waits (tenant_id, run_id, attempt, stage, signal, wait_until, on_timeout)
SELECT r.tenant_id, r.id, r.attempts, r.stage, $4, clock_timestamp() + $5 * interval '1 millisecond', $6
  FROM r
RETURNING wait_until";

/// How the last wait of the run ended that was on the binding the current
/// attempt (`$2`) has: its input hash and upstream attempt. No row: none
/// (never waited, or waited on another binding, or its deadline failed the run:
/// an operator's retry of that run waits again). Fenced on the token.
pub const SIGNAL_OF: &str = "\
SELECT w.signal, w.ended_by, w.payload, w.actor
  FROM stage_runs r
  JOIN stage_waits w ON w.run_id = r.id AND w.attempt < r.attempts
  JOIN stage_attempt_ends a ON a.run_id = w.run_id AND a.attempt = w.attempt
 WHERE r.id = $1 AND r.attempts = $2
   AND (w.ended_by = 'signal' OR (w.ended_by = 'timeout' AND w.on_timeout = 'resume'))
   AND a.input_hash = r.input_hash AND a.upstream_attempt IS NOT DISTINCT FROM r.upstream_attempt
 ORDER BY w.attempt DESC
 LIMIT 1";

#[derive(QueryableByName)]
struct UntilRow {
    #[diesel(sql_type = Timestamptz)]
    wait_until: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct SignalRow {
    #[diesel(sql_type = Nullable<Text>)]
    signal: Option<String>,
    #[diesel(sql_type = Text)]
    ended_by: String,
    #[diesel(sql_type = Nullable<Jsonb>)]
    payload: Option<serde_json::Value>,
    #[diesel(sql_type = Nullable<Text>)]
    actor: Option<String>,
}

impl PgRunRepository {
    /// Ends the attempt in `wait`, fenced on the token: the run is `waiting`,
    /// holds no lease, and runs again once a signal is delivered
    /// (`ops::signal`) or the deadline passes (`waits::expire_due`). What
    /// `prepare` checkpointed stays for the next attempt on the same binding.
    pub async fn wait(&self, token: &ClaimToken, wait: &WaitFor) -> Result<WaitOutcome, RepoError> {
        let mut conn = self.conn().await?;
        let reason = sanitize_error_text(&match &wait.signal {
            Some(s) => format!("waiting for signal {s} (at most {:?})", wait.timeout),
            None => format!("waiting for a timer of {:?}", wait.timeout),
        });
        let timeout_ms = i64::try_from(wait.timeout.as_millis()).unwrap_or(i64::MAX);
        let signal = wait.signal.as_ref().map(|s| s.as_str().to_owned());
        let until: Option<UntilRow> = crate::tenant::transaction::<_, diesel::result::Error, _>(
            &mut conn,
            &token.tenant,
            async |conn| {
                diesel::sql_query(WAIT)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<Text, _>(&reason)
                    .bind::<Nullable<Text>, _>(signal)
                    .bind::<BigInt, _>(timeout_ms)
                    .bind::<Text, _>(wait.on_timeout.as_str())
                    .get_result(conn)
                    .await
                    .optional()
            },
        )
        .await
        .map_err(map_diesel_error)?;
        Ok(match until {
            Some(u) => WaitOutcome::Waiting {
                until: u.wait_until,
            },
            None => WaitOutcome::Fenced,
        })
    }

    /// How the run's last wait on this attempt's binding ended: the signal
    /// delivered (with its payload), or its deadline; `None` if it has not
    /// waited on this binding. Fenced on the token (`None` for an attempt that
    /// is not the run's current one).
    pub async fn signal(&self, token: &ClaimToken) -> Result<Option<Signal>, RepoError> {
        let row: Option<SignalRow> = self
            .read_only(&token.tenant, async |conn| signal_row(conn, token).await)
            .await?;
        row.map(signal_of).transpose()
    }
}

async fn signal_row(
    conn: &mut diesel_async::AsyncPgConnection,
    token: &ClaimToken,
) -> Result<Option<SignalRow>, diesel::result::Error> {
    diesel::sql_query(SIGNAL_OF)
        .bind::<Text, _>(token.run_id.to_string())
        .bind::<Integer, _>(token.attempt)
        .get_result(conn)
        .await
        .optional()
}

/// [`PgRunRepository::signal`] on a connection in the run's tenant scope (a
/// stage's fenced transaction).
pub(crate) async fn signal_in(
    conn: &mut diesel_async::AsyncPgConnection,
    token: &ClaimToken,
) -> Result<Option<Signal>, RepoError> {
    signal_row(conn, token)
        .await
        .map_err(map_diesel_error)?
        .map(signal_of)
        .transpose()
}

fn signal_of(row: SignalRow) -> Result<Signal, RepoError> {
    Ok(match (row.ended_by.as_str(), row.signal) {
        ("signal", Some(name)) => Signal::Delivered {
            name: StageName::parse(&name)?,
            payload: row.payload.unwrap_or(serde_json::Value::Null),
            actor: row.actor.unwrap_or_default(),
        },
        _ => Signal::TimedOut,
    })
}
