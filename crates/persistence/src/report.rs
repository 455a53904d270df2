//! Read-only reports: counts for `idemstage status`. (The example pipeline's
//! invariant checker lives in its own crate, `idemstage-example`.)

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{RepoError, TenantId};
use serde::Serialize;

use crate::error::map_diesel_error;
use crate::schema::pipeline_runs;

/// One row of [`stage_status_counts`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StageStatusCount {
    /// The stage name.
    pub stage: String,
    /// The run status as stored (`running`, `success`, `failed`, `dead`, `stale`,
    /// `cancelled`).
    pub status: String,
    /// How many runs of `stage` are in `status`.
    pub count: i64,
}

/// `pipeline_runs` counted by stage and status, optionally for one tenant; ordered
/// by stage, then status. Not scoped: it runs as the connecting user, so without
/// `tenant` it counts every tenant's runs (those that user can see).
pub async fn stage_status_counts(
    conn: &mut AsyncPgConnection,
    tenant: Option<&TenantId>,
) -> Result<Vec<StageStatusCount>, RepoError> {
    use pipeline_runs::dsl as pr;
    let mut query = pr::pipeline_runs
        .group_by((pr::stage, pr::status))
        .select((pr::stage, pr::status, diesel::dsl::count_star()))
        .order_by((pr::stage, pr::status))
        .into_boxed();
    if let Some(t) = tenant {
        query = query.filter(pr::tenant_id.eq(t.as_str().to_owned()));
    }
    let rows: Vec<(String, String, i64)> = query.load(conn).await.map_err(map_diesel_error)?;
    Ok(rows
        .into_iter()
        .map(|(stage, status, count)| StageStatusCount {
            stage,
            status,
            count,
        })
        .collect())
}
