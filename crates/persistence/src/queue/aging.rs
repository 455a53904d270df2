//! Priority aging (`queue_controls.aging_ms`, migration
//! `2026-12-04-230000_priority_aging`): within a tenant's share the fetch ranks
//! a ready job's priority one higher per interval it has waited, up to the
//! highest priority ready in the queue. Set apart from the limits, which it
//! keeps, on the queue's own control row.

use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::queue::validate_queue_name;
use idemstage_domain::{DomainError, RepoError};

use super::millis;
use crate::error::map_diesel_error;
use crate::ops::Actor;

/// `$3` the actor, as in `PAUSE_SQL`. Only the queue's row (scope `''`).
const SET_AGING_SQL: &str = "\
WITH actor AS (
    SELECT set_config('idemstage.actor', idemstage_actor_tag() || $3, true) AS name
)
INSERT INTO queue_controls (queue, scope, aging_ms)
SELECT $1, '', $2 FROM actor
ON CONFLICT (queue, scope) DO UPDATE
   SET aging_ms = excluded.aging_ms, updated_at = now(), updated_by = current_user";

/// Turning aging off writes no row where there is none (a row of its own
/// would send the queue's fetch down the controlled path for nothing).
const CLEAR_AGING_SQL: &str = "\
WITH actor AS (
    SELECT set_config('idemstage.actor', idemstage_actor_tag() || $2, true) AS name
)
UPDATE queue_controls SET aging_ms = NULL, updated_at = now(), updated_by = current_user
  FROM actor
 WHERE queue = $1 AND scope = '' AND aging_ms IS NOT NULL";

/// The longest aging interval: a week (and at least 1 ms).
pub const MAX_PRIORITY_AGING: Duration = Duration::from_secs(7 * 24 * 3600);

/// Sets `queue`'s priority aging: within a tenant's share the fetch takes the
/// highest priority first, and with `Some(every)` a ready job's priority counts
/// one more per `every` it has waited (from when it became due), up to the
/// highest priority with a ready job in the queue, so a low-priority job is
/// not starved by a stream of higher ones. The tenants' fair shares do not
/// age. `None` turns it off. Takes effect at the next fetch; recorded like a
/// limit ([`control_changes`](super::control_changes)). An interval outside
/// 1 ms to [`MAX_PRIORITY_AGING`] is refused (`InvalidOption`) with nothing written.
pub async fn set_priority_aging(
    conn: &mut AsyncPgConnection,
    queue: &str,
    every: Option<Duration>,
    actor: &Actor,
) -> Result<(), RepoError> {
    validate_queue_name(queue)?;
    match every {
        Some(every) => {
            if every < Duration::from_millis(1) || every > MAX_PRIORITY_AGING {
                return Err(DomainError::InvalidOption(format!(
                    "priority aging {every:?} must be 1 ms to 7 days"
                ))
                .into());
            }
            let query = diesel::sql_query(SET_AGING_SQL)
                .bind::<Text, _>(queue)
                .bind::<BigInt, _>(millis(every))
                .bind::<Text, _>(actor.as_str());
            crate::db::pinned(conn, async move |conn| query.execute(conn).await)
                .await
                .map_err(map_diesel_error)?;
        }
        None => {
            let query = diesel::sql_query(CLEAR_AGING_SQL)
                .bind::<Text, _>(queue)
                .bind::<Text, _>(actor.as_str());
            crate::db::pinned(conn, async move |conn| query.execute(conn).await)
                .await
                .map_err(map_diesel_error)?;
        }
    }
    Ok(())
}

/// A stored interval in ms as a duration.
pub(super) fn aging(ms: Option<i64>) -> Option<Duration> {
    ms.map(|ms| Duration::from_millis(ms.max(0) as u64))
}
