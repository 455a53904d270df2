//! Read-only reports: counts for `idemstage status`. (The example pipeline's
//! invariant checker lives in its own crate, `idemstage-example`.)

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{RepoError, TenantId};
use serde::Serialize;

use crate::error::map_diesel_error;
use crate::schema::stage_runs;

/// One row of [`stage_status_counts`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StageStatusCount {
    /// The stage name.
    pub stage: String,
    /// The run status as stored (`running`, `success`, `failed`, `dead`, `stale`,
    /// `cancelled`, `waiting`).
    pub status: String,
    /// How many runs of `stage` are in `status`.
    pub count: i64,
}

/// `stage_runs` counted by stage and status, optionally for one tenant; ordered
/// by stage, then status. Not scoped: it runs as the connecting user, so without
/// `tenant` it counts every tenant's runs (those that user can see).
pub async fn stage_status_counts(
    conn: &mut AsyncPgConnection,
    tenant: Option<&TenantId>,
) -> Result<Vec<StageStatusCount>, RepoError> {
    use stage_runs::dsl as pr;
    let mut query = pr::stage_runs
        .group_by((pr::stage, pr::status))
        .select((pr::stage, pr::status, diesel::dsl::count_star()))
        .order_by((pr::stage, pr::status))
        .into_boxed();
    if let Some(t) = tenant {
        query = query.filter(pr::tenant_id.eq(t.as_str().to_owned()));
    }
    let rows: Vec<(String, String, i64)> =
        crate::db::pinned(conn, async move |conn| query.load(conn).await)
            .await
            .map_err(map_diesel_error)?;
    Ok(rows
        .into_iter()
        .map(|(stage, status, count)| StageStatusCount {
            stage,
            status,
            count,
        })
        .collect())
}

/// One row of [`tenant_stage_overview`]: one tenant's runs of one stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TenantStageRow {
    /// The tenant.
    pub tenant: String,
    /// The stage name.
    pub stage: String,
    /// The run status as stored (see [`StageStatusCount::status`]).
    pub status: String,
    /// How many of the tenant's runs of `stage` are in `status`.
    pub count: i64,
    /// How many attempts of the tenant's runs of `stage` ended `success` within
    /// the window asked for (database clock); counted on the `status = 'success'`
    /// row only, 0 on the others.
    pub recent_successes: i64,
}

/// `$1`: the window in milliseconds. The attempt history counts the successes
/// of the window (a run that succeeded, went stale and succeeded again counts
/// twice: both were executions).
const TENANT_STAGE_OVERVIEW_SQL: &str = "\
WITH counts AS (
    SELECT tenant_id, stage, status, count(*) AS n
      FROM stage_runs
     GROUP BY tenant_id, stage, status
), recent AS (
    SELECT r.tenant_id, r.stage, count(*) AS n
      FROM stage_run_attempts a
      JOIN stage_runs r ON r.id = a.run_id
     WHERE a.outcome = 'success'
       AND a.finished_at > now() - make_interval(secs => $1::float8 / 1000)
     GROUP BY r.tenant_id, r.stage
)
SELECT c.tenant_id AS tenant, c.stage, c.status, c.n AS count,
       CASE WHEN c.status = 'success' THEN coalesce(r.n, 0) ELSE 0 END AS recent_successes
  FROM counts c
  LEFT JOIN recent r ON r.tenant_id = c.tenant_id AND r.stage = c.stage
 ORDER BY c.tenant_id, c.stage, c.status";

#[derive(diesel::QueryableByName)]
struct OverviewRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    tenant: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    stage: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    status: String,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    count: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    recent_successes: i64,
}

/// `stage_runs` counted by tenant, stage and status, with the successful
/// attempts of the last `window` (throughput), in one statement: the console's
/// overview. Not scoped, like [`stage_status_counts`]: it reads every tenant's
/// runs as the connecting user (an operator's read). Ordered by tenant, stage,
/// status.
pub async fn tenant_stage_overview(
    conn: &mut AsyncPgConnection,
    window: std::time::Duration,
) -> Result<Vec<TenantStageRow>, RepoError> {
    let query = diesel::sql_query(TENANT_STAGE_OVERVIEW_SQL).bind::<diesel::sql_types::BigInt, _>(
        i64::try_from(window.as_millis()).unwrap_or(i64::MAX),
    );
    let rows: Vec<OverviewRow> = crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(rows
        .into_iter()
        .map(|r| TenantStageRow {
            tenant: r.tenant,
            stage: r.stage,
            status: r.status,
            count: r.count,
            recent_successes: r.recent_successes,
        })
        .collect())
}

/// Whether `tenant` has registered any item (as the connecting user sees
/// `items`, across tenants): the console's check of a tenant it is asked
/// about.
pub async fn tenant_exists(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
) -> Result<bool, RepoError> {
    use crate::schema::items::dsl as a;
    let query = diesel::select(diesel::dsl::exists(
        a::items.filter(a::tenant_id.eq(tenant.as_str().to_owned())),
    ));
    crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(map_diesel_error)
}
