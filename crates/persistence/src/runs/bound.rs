//! What an attempt of the typed stage contract reads before its `prepare` (its
//! bound input or upstream output, and a checkpointed prepared value), the
//! checkpoint it writes after, and the read-only scope `prepare` reads in.

use diesel::prelude::*;
use diesel::sql_types::{Bool, Integer, Jsonb, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ClaimToken, RepoError, TenantId};

use crate::cached::CachedExt;
use crate::error::TxError;
use crate::tenant::TenantBody;

use super::{sql, PgRunRepository};

/// What an attempt reads: exactly what its run is bound to.
#[derive(Clone, Debug, PartialEq)]
pub enum BoundInput {
    /// The first stage: the text of the item's input whose hash the run is
    /// bound to (the stored one, or the replaced one kept for it).
    Text(String),
    /// A later stage: its upstream's output at the attempt the run is bound to
    /// (JSON `null` for an upstream that returned none).
    UpstreamOutput(serde_json::Value),
}

/// The result of [`PgRunRepository::read_bound`].
#[derive(Clone, Debug, PartialEq)]
pub enum ReadBound {
    /// The attempt's binding.
    Read {
        /// Its input or upstream output.
        input: BoundInput,
        /// A prepared value checkpointed for this run on this very binding (only
        /// if asked for).
        checkpoint: Option<serde_json::Value>,
    },
    /// The upstream attempt the run is bound to is no longer the upstream's
    /// success (it succeeded again, or was invalidated): this attempt can never
    /// commit; its fenced completion marks it `stale`.
    UpstreamMoved,
    /// The token no longer holds.
    Fenced,
}

impl PgRunRepository {
    /// Reads what the token's attempt is bound to (`sql::READ_BOUND`), with the
    /// run's checkpoint if `with_checkpoint`, in a transaction scoped to the
    /// token's tenant.
    pub async fn read_bound(
        &self,
        token: &ClaimToken,
        with_checkpoint: bool,
    ) -> Result<ReadBound, RepoError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Text)]
            input_hash: String,
            #[diesel(sql_type = Bool)]
            first_stage: bool,
            #[diesel(sql_type = Nullable<Text>)]
            input_text: Option<String>,
            #[diesel(sql_type = Bool)]
            upstream_found: bool,
            #[diesel(sql_type = Nullable<Jsonb>)]
            upstream_output: Option<serde_json::Value>,
            #[diesel(sql_type = Nullable<Jsonb>)]
            checkpoint: Option<serde_json::Value>,
        }
        let mut conn = self.conn().await?;
        let row: Option<Row> =
            crate::tenant::transaction::<_, TxError, _>(&mut conn, &token.tenant, async |conn| {
                Ok(diesel::sql_query(sql::READ_BOUND)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<Bool, _>(with_checkpoint)
                    .cached()
                    .get_result(conn)
                    .await
                    .optional()?)
            })
            .await
            .map_err(TxError::into_repo)?;
        let Some(row) = row else {
            return Ok(ReadBound::Fenced);
        };
        let input = if row.first_stage {
            let text = row.input_text.ok_or_else(|| RepoError::BoundInputMissing {
                tenant: token.tenant.to_string(),
                item: token.item.to_string(),
                input_hash: row.input_hash.clone(),
            })?;
            // The limit holds for input that did not come through
            // `register_item` (written by hand or by another tool).
            crate::items::validate_input(&text)?;
            BoundInput::Text(text)
        } else if row.upstream_found {
            BoundInput::UpstreamOutput(row.upstream_output.unwrap_or(serde_json::Value::Null))
        } else {
            return Ok(ReadBound::UpstreamMoved);
        };
        Ok(ReadBound::Read {
            input,
            checkpoint: row.checkpoint,
        })
    }

    /// Keeps `prepared` for the next attempt of the token's run, with the binding
    /// it was computed from (`sql::CHECKPOINT`). `false`: the token no longer
    /// holds and nothing was written.
    pub async fn checkpoint(
        &self,
        token: &ClaimToken,
        prepared: &serde_json::Value,
    ) -> Result<bool, RepoError> {
        let mut conn = self.conn().await?;
        let written =
            crate::tenant::transaction::<_, TxError, _>(&mut conn, &token.tenant, async |conn| {
                Ok(diesel::sql_query(sql::CHECKPOINT)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<Jsonb, _>(prepared)
                    .cached()
                    .execute(conn)
                    .await?)
            })
            .await
            .map_err(TxError::into_repo)?;
        Ok(written == 1)
    }

    /// The text of the input the token's attempt is bound to (every stage's: a
    /// later stage's run is bound to the hash its upstream's success read), in a
    /// transaction scoped to the token's tenant. `BoundInputMissing` if no text of
    /// that hash is kept; `ItemNotFound` if the token no longer holds.
    pub async fn bound_input(&self, token: &ClaimToken) -> Result<String, RepoError> {
        let mut conn = self.conn().await?;
        crate::tenant::transaction::<_, TxError, _>(&mut conn, &token.tenant, async |conn| {
            Ok(bound_input_text(conn, token).await?)
        })
        .await
        .map_err(TxError::into_repo)
    }

    /// Runs `body` in a read-only transaction scoped to `tenant` (row-level
    /// security, role `idemstage_app`): what a stage's `prepare` reads of the
    /// team's own tables. A write in it fails (25006, not retryable).
    pub async fn read_only<R, F>(&self, tenant: &TenantId, body: F) -> Result<R, RepoError>
    where
        for<'r> F: AsyncFnOnce(&'r mut AsyncPgConnection) -> Result<R, diesel::result::Error>
            + TenantBody<'r, R, diesel::result::Error>
            + Send,
        R: Send,
    {
        let mut conn = self.conn().await?;
        crate::tenant::transaction::<_, TxError, _>(&mut conn, tenant, async move |conn| {
            diesel::sql_query("SET TRANSACTION READ ONLY")
                .execute(conn)
                .await?;
            Ok(body(conn).await?)
        })
        .await
        .map_err(TxError::into_repo)
    }
}

/// The text of the input the token's attempt is bound to (`sql::BOUND_INPUT`):
/// the item's stored input while it is current, else the replaced input kept
/// for it. On a connection already scoped to the token's tenant.
pub(crate) async fn bound_input_text(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
) -> Result<String, RepoError> {
    #[derive(QueryableByName)]
    struct Bound {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        input_hash: Option<String>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        input_text: Option<String>,
    }
    let bound: Option<Bound> = diesel::sql_query(crate::runs::sql::BOUND_INPUT)
        .bind::<diesel::sql_types::Text, _>(token.run_id.to_string())
        .bind::<diesel::sql_types::Integer, _>(token.attempt)
        .get_result(conn)
        .await
        .optional()
        .map_err(crate::error::map_diesel_error)?;
    let not_found = || RepoError::ItemNotFound {
        tenant: token.tenant.to_string(),
        item: token.item.to_string(),
    };
    let bound = bound.ok_or_else(not_found)?;
    let (Some(hash), text) = (bound.input_hash, bound.input_text) else {
        return Err(not_found());
    };
    let text = text.ok_or_else(|| RepoError::BoundInputMissing {
        tenant: token.tenant.to_string(),
        item: token.item.to_string(),
        input_hash: hash,
    })?;
    // The limit holds for input that did not come through `register_item`
    // (written by hand or by another tool): a clear, permanent error.
    crate::items::validate_input(&text)?;
    Ok(text)
}
