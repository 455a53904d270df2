//! The gather's side of a fan-out: what a gather reads (its fan-out's
//! version and every child's result), its check at its commit, and the
//! gather due after a child ended outside a fenced transaction.

use diesel::sql_types::{Bool, Integer, Jsonb, Nullable, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ClaimToken, ItemId, RepoError, StageName, TenantId};

use crate::cached::CachedExt;
use crate::error::map_diesel_error;
use crate::FencedTx;

/// What a gather reads, fenced on its token: the fan-out its run is bound to
/// (the upstream's attempt), its version and whether it is complete, and each
/// child in order with the run that made it final. `$1` run id, `$2` attempt.
pub const GATHER_READ: &str = "\
SELECT f.version, f.completed_at IS NOT NULL AS complete, c.child_key, c.item_id, c.outcome,
       c.final_stage, x.output, x.last_error, x.success_attempt IS NOT NULL AS current
  FROM stage_runs g
  JOIN fanouts f ON f.tenant_id = g.tenant_id AND f.parent_item = g.item_id
                AND f.stage = g.upstream_stage AND f.attempt = g.upstream_attempt
  LEFT JOIN fanout_children c ON c.tenant_id = f.tenant_id AND c.parent_item = f.parent_item
                             AND c.stage = f.stage AND c.attempt = f.attempt
  LEFT JOIN stage_runs x ON x.tenant_id = c.tenant_id AND x.item_id = c.item_id
                        AND x.stage = c.final_stage
 WHERE g.id = $1 AND g.attempts = $2
 ORDER BY c.position";

/// In the gather's fenced transaction (after its fence): the version of its
/// fan-out, share-locked, so a child's final count that is under way commits
/// first and is seen. `$1` run id, `$2` attempt.
pub const GATHER_VERSION: &str = "\
SELECT f.version
  FROM stage_runs g
  JOIN fanouts f ON f.tenant_id = g.tenant_id AND f.parent_item = g.item_id
                AND f.stage = g.upstream_stage AND f.attempt = g.upstream_attempt
 WHERE g.id = $1 AND g.attempts = $2
   FOR SHARE OF f";

/// The complete, current fan-out of a child: its gather is due. `$1` tenant,
/// `$2` child item.
const DUE_GATHER: &str = "\
SELECT f.parent_item, f.gather_stage, f.input_hash
  FROM fanout_children c
  JOIN fanouts f ON f.tenant_id = c.tenant_id AND f.parent_item = c.parent_item
                AND f.stage = c.stage AND f.attempt = c.attempt
 WHERE c.tenant_id = $1 AND c.item_id = $2
   AND f.completed_at IS NOT NULL AND f.superseded_at IS NULL";

/// One child as the gather reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct ChildState {
    /// Its key.
    pub key: String,
    /// Its item.
    pub item: ItemId,
    /// `success`, `stopped`, `dead`, `cancelled`; `None` while it runs.
    pub outcome: Option<String>,
    /// The stage that made it final.
    pub final_stage: Option<StageName>,
    /// That stage's output (JSON `null` for none).
    pub output: serde_json::Value,
    /// That stage's last error.
    pub error: Option<String>,
    /// That stage's success is current (not invalidated by a rerun of the
    /// child under way).
    pub current: bool,
}

/// What a gather reads ([`gather_read`]).
#[derive(Clone, Debug, PartialEq)]
pub struct GatherRead {
    /// The fan-out's version: the gather's commit checks it again.
    pub version: i32,
    /// Every child is final.
    pub complete: bool,
    /// The children, in the fan-out's order.
    pub children: Vec<ChildState>,
}

#[derive(QueryableByName)]
struct GatherRow {
    #[diesel(sql_type = Integer)]
    version: i32,
    #[diesel(sql_type = Bool)]
    complete: bool,
    #[diesel(sql_type = Nullable<Text>)]
    child_key: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    item_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    outcome: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    final_stage: Option<String>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    output: Option<serde_json::Value>,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Nullable<Bool>)]
    current: Option<bool>,
}

#[derive(QueryableByName)]
struct VersionRow {
    #[diesel(sql_type = Integer)]
    version: i32,
}

#[derive(QueryableByName)]
struct DueRow {
    #[diesel(sql_type = Text)]
    parent_item: String,
    #[diesel(sql_type = Text)]
    gather_stage: String,
    #[diesel(sql_type = Text)]
    input_hash: String,
}

/// A gather that is due: its parent item, stage and job's input hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueGather {
    /// The parent item.
    pub parent: ItemId,
    /// The gather stage.
    pub gather_stage: StageName,
    /// The gather job's input hash.
    pub input_hash: String,
}

impl FencedTx<'_> {
    /// The gather's check at its commit: is its fan-out's version still the
    /// one its children were read at? Share-locks the fan-out's row.
    #[doc(hidden)]
    pub async fn gather_version(&mut self) -> Result<Option<i32>, RepoError> {
        let token = self.token().clone();
        let row: Option<VersionRow> = diesel::sql_query(GATHER_VERSION)
            .bind::<Text, _>(token.run_id.to_string())
            .bind::<Integer, _>(token.attempt)
            .cached()
            .get_result(self.conn())
            .await
            .optional()
            .map_err(map_diesel_error)?;
        Ok(row.map(|r| r.version))
    }
}

/// What the gather of the token's run reads ([`GATHER_READ`]), on a connection
/// scoped to the token's tenant. `None`: the token no longer holds, or its run
/// is bound to no fan-out.
pub async fn gather_read(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
) -> Result<Option<GatherRead>, RepoError> {
    let rows: Vec<GatherRow> = diesel::sql_query(GATHER_READ)
        .bind::<Text, _>(token.run_id.to_string())
        .bind::<Integer, _>(token.attempt)
        .cached()
        .load(conn)
        .await
        .map_err(map_diesel_error)?;
    let Some(head) = rows.as_slice().first() else {
        return Ok(None);
    };
    let (version, complete) = (head.version, head.complete);
    let mut children = Vec::with_capacity(rows.len());
    for r in rows {
        let (Some(key), Some(item)) = (r.child_key, r.item_id) else {
            continue; // a fan-out of no children
        };
        children.push(ChildState {
            key,
            item: ItemId::parse(&item)?,
            outcome: r.outcome,
            final_stage: r.final_stage.as_deref().map(StageName::parse).transpose()?,
            output: r.output.unwrap_or(serde_json::Value::Null),
            error: r.last_error,
            current: r.current.unwrap_or(false),
        });
    }
    Ok(Some(GatherRead {
        version,
        complete,
        children,
    }))
}

/// The gather due for `child`'s fan-out, if it is complete and current: after
/// a child ended `dead` or `cancelled` outside a fenced transaction (its
/// count is the trigger's), the executor sends the gather's job with it.
pub async fn due_gather(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    child: &ItemId,
) -> Result<Option<DueGather>, RepoError> {
    let row: Option<DueRow> = diesel::sql_query(DUE_GATHER)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(child.to_string())
        .get_result(conn)
        .await
        .optional()
        .map_err(map_diesel_error)?;
    row.map(|r| {
        Ok(DueGather {
            parent: ItemId::parse(&r.parent_item)?,
            gather_stage: StageName::parse(&r.gather_stage)?,
            input_hash: r.input_hash,
        })
    })
    .transpose()
}

impl crate::PgRunRepository {
    /// What the gather of the token's run reads ([`gather_read`]), in a
    /// read-only transaction scoped to the token's tenant (one snapshot: the
    /// version and the children agree).
    pub async fn gather_read(&self, token: &ClaimToken) -> Result<Option<GatherRead>, RepoError> {
        let mut conn = self.conn().await?;
        crate::tenant::transaction::<_, crate::TxError, _>(&mut conn, &token.tenant, async |conn| {
            diesel::sql_query("SET TRANSACTION READ ONLY")
                .execute(conn)
                .await?;
            Ok(gather_read(conn, token).await?)
        })
        .await
        .map_err(crate::TxError::into_repo)
    }
}

impl crate::PgRunRepository {
    /// After `child` ended `dead` or `cancelled` outside a fenced transaction
    /// (the trigger counted it): sends the gather's job (`job`, from what is
    /// due) if its fan-out is complete and current, in one transaction scoped
    /// to `tenant`. A live gather job makes the send a `Duplicate`; the
    /// reconciler sends it too if this never runs (a crash in between).
    pub async fn send_due_gather(
        &self,
        tenant: &TenantId,
        child: &ItemId,
        job: impl Fn(&DueGather) -> idemstage_domain::JobToSend + Send + Sync,
    ) -> Result<Option<idemstage_domain::SendResult>, RepoError> {
        let mut conn = self.conn().await?;
        crate::tenant::transaction::<_, crate::TxError, _>(&mut conn, tenant, async |conn| {
            let Some(due) = due_gather(conn, tenant, child).await? else {
                return Ok(None);
            };
            Ok(Some(crate::queue::send_in(conn, &job(&due)).await?))
        })
        .await
        .map_err(crate::TxError::into_repo)
    }
}
