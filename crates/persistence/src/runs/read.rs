//! Reads of a run and of its attempt history.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{AttemptRecord, ItemId, RepoError, RunId, RunRecord, StageName, TenantId};

use crate::error::{map_diesel_error, TxError};
use crate::schema::stage_runs;
use crate::views::stage_run_attempts;

use super::{PgRunRepository, RunRow};

impl PgRunRepository {
    /// The run of (tenant, item, stage), if any, read in a transaction scoped to
    /// `tenant`.
    pub async fn read_run(
        &self,
        tenant: &TenantId,
        item: &ItemId,
        stage: &StageName,
    ) -> Result<Option<RunRecord>, RepoError> {
        let mut conn = self.conn().await?;
        crate::tenant::transaction::<_, TxError, _>(&mut conn, tenant, async |conn| {
            Ok(read_run_row(conn, tenant.as_str(), &item.to_string(), stage.as_str()).await?)
        })
        .await
        .map_err(TxError::into_repo)?
        .map(RunRow::into_record)
        .transpose()
    }

    /// Every attempt of a run, in order; empty for an unknown id. Not scoped to a
    /// tenant: it runs as the connecting user and finds the run by its id alone.
    pub async fn attempt_history(&self, run_id: &RunId) -> Result<Vec<AttemptRecord>, RepoError> {
        use stage_run_attempts::dsl as pa;
        type Row = (
            i32,
            String,
            String,
            DateTime<Utc>,
            Option<DateTime<Utc>>,
            String,
            Option<String>,
            Option<i32>,
        );
        let mut conn = self.conn().await?;
        let query = pa::stage_run_attempts
            .filter(pa::run_id.eq(run_id.to_string()))
            .order(pa::attempt)
            .select((
                pa::attempt,
                pa::worker_id,
                pa::input_hash,
                pa::started_at,
                pa::finished_at,
                pa::outcome,
                pa::error,
                pa::upstream_attempt,
            ));
        let rows: Vec<Row> = crate::db::pinned(&mut conn, async move |conn| query.load(conn).await)
            .await
            .map_err(map_diesel_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(
                    attempt,
                    worker_id,
                    input_hash,
                    started_at,
                    finished_at,
                    outcome,
                    error,
                    upstream_attempt,
                )| AttemptRecord {
                    attempt,
                    worker_id,
                    input_hash,
                    started_at,
                    finished_at,
                    outcome,
                    error,
                    upstream_attempt,
                },
            )
            .collect())
    }
}

/// The row of (tenant, item, stage), if any, in the caller's transaction.
pub(super) async fn read_run_row(
    conn: &mut AsyncPgConnection,
    tenant: &str,
    item: &str,
    stage: &str,
) -> Result<Option<RunRow>, RepoError> {
    use stage_runs::dsl as pr;
    pr::stage_runs
        .filter(pr::tenant_id.eq(tenant))
        .filter(pr::item_id.eq(item))
        .filter(pr::stage.eq(stage))
        .select(RunRow::as_select())
        .first(conn)
        .await
        .optional()
        .map_err(map_diesel_error)
}
