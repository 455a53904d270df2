//! Fan-out and gather (migration `2026-12-04-210000_fan_out`): a fan-out
//! stage's fenced transaction writes its children (items of their own, with
//! `fanout_children` rows) and the `fanouts` row; each child's last stage
//! counts the child final in its own fenced transaction
//! (`idemstage_child_final`, under the fan-out's row lock), and the one that
//! completes the fan-out sends the gather's job; the gather reads every child's
//! result and, at its commit, checks that none changed since
//! (`fanouts.version`). What the gather reads, and when it is due, is in
//! `gather.rs`.

use diesel::sql_types::{Array, Bool, Integer, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ClaimToken, ItemId, RepoError, StageName};

use crate::cached::CachedExt;
use crate::error::map_diesel_error;
use crate::FencedTx;

mod gather;

pub use gather::{
    due_gather, gather_read, ChildState, DueGather, GatherRead, GATHER_READ, GATHER_VERSION,
};

/// One child as the fan-out writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewChild {
    /// Its key in the fan-out.
    pub key: String,
    /// Its item id (`idemstage_domain::child_item_id`).
    pub item: ItemId,
    /// Its input text (the child's first stage reads it as an item's input).
    pub input_text: String,
    /// The SHA-256 (hex) of `input_text`.
    pub input_sha256: String,
}

/// The fan-out row, in the fan-out stage's fenced transaction: the parent's
/// run input hash is the gather job's. `$1` tenant, `$2` parent item, `$3`
/// stage, `$4` attempt, `$5` gather stage, `$6` run id, `$7` children.
const INSERT_FANOUT: &str = "\
INSERT INTO fanouts (tenant_id, parent_item, stage, attempt, gather_stage, input_hash, children,
                     completed_at)
SELECT $1, $2, $3, $4, $5, r.input_hash, $7, CASE WHEN $7 = 0 THEN clock_timestamp() END
  FROM stage_runs r WHERE r.id = $6
RETURNING input_hash";

/// The children's items. `$1` tenant, `$2` ids, `$3` texts, `$4` hashes.
const INSERT_CHILD_ITEMS: &str = "\
INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
SELECT $1, c.id, c.text, c.sha, 'items/' || $1 || '/' || c.id || '/input.txt'
  FROM unnest($2::text[], $3::text[], $4::text[]) AS c(id, text, sha)";

/// The children's rows, in the fan-out's order. `$1` tenant, `$2` parent item,
/// `$3` stage, `$4` attempt, `$5` ids, `$6` keys.
const INSERT_CHILDREN: &str = "\
INSERT INTO fanout_children (tenant_id, item_id, parent_item, stage, attempt, child_key, position)
SELECT $1, c.id, $2, $3, $4, c.key, c.pos
  FROM unnest($5::text[], $6::text[]) WITH ORDINALITY AS c(id, key, pos)";

/// A child made final (`$3` outcome, by `$4` its stage), on the token's item:
/// see the migration's `idemstage_child_final`. `$1` tenant, `$2` item.
pub const CHILD_FINAL: &str = "\
SELECT parent_item, stage, attempt, gather_stage, input_hash, complete, completed_now, recount,
       superseded
  FROM idemstage_child_final($1, $2, $3, $4)";

/// When a fan-out stage succeeds again (a rerun: another attempt), in its
/// fenced transaction: the parent's other fan-outs of this stage are
/// superseded, and so are their children's items (migration
/// `2026-12-04-220000_fan_out_reruns`: the claim binds nothing of them and
/// their commits fail the lineage check). Returns the children. `$1` tenant,
/// `$2` parent item, `$3` stage, `$4` the new attempt.
pub const SUPERSEDE: &str = "\
WITH old AS (
    UPDATE fanouts SET superseded_at = clock_timestamp()
     WHERE tenant_id = $1 AND parent_item = $2 AND stage = $3 AND attempt <> $4
       AND superseded_at IS NULL
    RETURNING tenant_id, parent_item, stage, attempt)
UPDATE items a SET superseded_at = clock_timestamp()
  FROM fanout_children c
  JOIN old ON old.tenant_id = c.tenant_id AND old.parent_item = c.parent_item
          AND old.stage = c.stage AND old.attempt = c.attempt
 WHERE a.tenant_id = c.tenant_id AND a.id = c.item_id
RETURNING a.id";

/// The runs of superseded children end `cancelled` with no current success:
/// final (nothing claims them), a running attempt fenced, their results no
/// longer current (so no later stage of the child binds them). `$1` tenant,
/// `$2` the children, `$3` the reason.
pub const SUPERSEDE_RUNS: &str = "\
UPDATE stage_runs
   SET status = 'cancelled', success_attempt = NULL, last_error = $3,
       finished_at = CASE WHEN status = 'cancelled' THEN finished_at ELSE clock_timestamp() END,
       lease_expires_at = least(lease_expires_at, clock_timestamp())
 WHERE tenant_id = $1 AND item_id = ANY($2::text[])
   AND NOT (status = 'cancelled' AND success_attempt IS NULL)";

/// What counting a child final found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChildFinal {
    /// The parent item.
    pub parent: ItemId,
    /// The gather stage.
    pub gather_stage: StageName,
    /// The gather job's input hash (the parent run's).
    pub input_hash: String,
    /// Every child is final.
    pub complete: bool,
    /// This count made it so: this transaction sends the gather's job.
    pub completed_now: bool,
    /// The child was final before: its outcome changed after the gather may
    /// have read it (the gather was made stale if the fan-out was complete).
    pub recount: bool,
    /// A rerun of the parent replaced this fan-out: its gather never runs.
    pub superseded: bool,
}

impl ChildFinal {
    /// Whether the gather's job is to be sent now: this count completed the
    /// fan-out, or changed a child of a complete one.
    pub fn gather_due(&self) -> bool {
        !self.superseded && (self.completed_now || (self.recount && self.complete))
    }
}

#[derive(QueryableByName)]
struct ChildFinalRow {
    #[diesel(sql_type = Text)]
    parent_item: String,
    #[diesel(sql_type = Text)]
    gather_stage: String,
    #[diesel(sql_type = Text)]
    input_hash: String,
    #[diesel(sql_type = Bool)]
    complete: bool,
    #[diesel(sql_type = Bool)]
    completed_now: bool,
    #[diesel(sql_type = Bool)]
    recount: bool,
    #[diesel(sql_type = Bool)]
    superseded: bool,
}

#[derive(QueryableByName)]
struct InputHashRow {
    #[diesel(sql_type = Text)]
    input_hash: String,
}

impl FencedTx<'_> {
    /// Writes the fan-out of this attempt (its success): the `fanouts` row, the
    /// children's items and rows. Returns the parent run's input hash (the
    /// gather job's). The caller sends the children's jobs (and, for no
    /// children, the gather's) in the same transaction.
    #[doc(hidden)]
    pub async fn write_fan_out(
        &mut self,
        gather_stage: &StageName,
        children: &[NewChild],
    ) -> Result<String, RepoError> {
        let token = self.token().clone();
        let count = i32::try_from(children.len()).unwrap_or(i32::MAX);
        let row: InputHashRow = diesel::sql_query(INSERT_FANOUT)
            .bind::<Text, _>(token.tenant.as_str())
            .bind::<Text, _>(token.item.to_string())
            .bind::<Text, _>(token.stage.as_str())
            .bind::<Integer, _>(token.attempt)
            .bind::<Text, _>(gather_stage.as_str())
            .bind::<Text, _>(token.run_id.to_string())
            .bind::<Integer, _>(count)
            .get_result(self.conn())
            .await
            .map_err(map_diesel_error)?;
        if children.is_empty() {
            return Ok(row.input_hash);
        }
        let ids: Vec<String> = children.iter().map(|c| c.item.to_string()).collect();
        let texts: Vec<&str> = children.iter().map(|c| c.input_text.as_str()).collect();
        let hashes: Vec<&str> = children.iter().map(|c| c.input_sha256.as_str()).collect();
        let keys: Vec<&str> = children.iter().map(|c| c.key.as_str()).collect();
        diesel::sql_query(INSERT_CHILD_ITEMS)
            .bind::<Text, _>(token.tenant.as_str())
            .bind::<Array<Text>, _>(&ids)
            .bind::<Array<Text>, _>(&texts)
            .bind::<Array<Text>, _>(&hashes)
            .execute(self.conn())
            .await
            .map_err(map_diesel_error)?;
        diesel::sql_query(INSERT_CHILDREN)
            .bind::<Text, _>(token.tenant.as_str())
            .bind::<Text, _>(token.item.to_string())
            .bind::<Text, _>(token.stage.as_str())
            .bind::<Integer, _>(token.attempt)
            .bind::<Array<Text>, _>(&ids)
            .bind::<Array<Text>, _>(&keys)
            .execute(self.conn())
            .await
            .map_err(map_diesel_error)?;
        Ok(row.input_hash)
    }

    /// A rerun of this fan-out stage succeeds: its earlier fan-outs are
    /// superseded (their children never run or commit again, their runs end
    /// `cancelled` with no current success). Returns how many children.
    #[doc(hidden)]
    pub async fn supersede_fan_outs(&mut self) -> Result<usize, RepoError> {
        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = Text)]
            id: String,
        }
        let token = self.token().clone();
        let children: Vec<Id> = diesel::sql_query(SUPERSEDE)
            .bind::<Text, _>(token.tenant.as_str())
            .bind::<Text, _>(token.item.to_string())
            .bind::<Text, _>(token.stage.as_str())
            .bind::<Integer, _>(token.attempt)
            .load(self.conn())
            .await
            .map_err(map_diesel_error)?;
        if children.is_empty() {
            return Ok(0);
        }
        let ids: Vec<String> = children.into_iter().map(|c| c.id).collect();
        diesel::sql_query(SUPERSEDE_RUNS)
            .bind::<Text, _>(token.tenant.as_str())
            .bind::<Array<Text>, _>(&ids)
            .bind::<Text, _>(format!(
                "superseded: stage {} of the parent succeeded again (attempt {})",
                token.stage, token.attempt
            ))
            .execute(self.conn())
            .await
            .map_err(map_diesel_error)?;
        Ok(ids.len())
    }

    /// Counts this attempt's item (a child) final with `outcome` (`success`
    /// or `stopped`), in its fenced transaction. `None`: the item is no child.
    #[doc(hidden)]
    pub async fn child_final(&mut self, outcome: &str) -> Result<Option<ChildFinal>, RepoError> {
        let token = self.token().clone();
        child_final(self.conn(), &token, outcome).await
    }
}

async fn child_final(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
    outcome: &str,
) -> Result<Option<ChildFinal>, RepoError> {
    let row: Option<ChildFinalRow> = diesel::sql_query(CHILD_FINAL)
        .bind::<Text, _>(token.tenant.as_str())
        .bind::<Text, _>(token.item.to_string())
        .bind::<Text, _>(outcome)
        .bind::<Text, _>(token.stage.as_str())
        .cached()
        .get_result(conn)
        .await
        .optional()
        .map_err(map_diesel_error)?;
    row.map(|r| {
        Ok(ChildFinal {
            parent: ItemId::parse(&r.parent_item)?,
            gather_stage: StageName::parse(&r.gather_stage)?,
            input_hash: r.input_hash,
            complete: r.complete,
            completed_now: r.completed_now,
            recount: r.recount,
            superseded: r.superseded,
        })
    })
    .transpose()
}
