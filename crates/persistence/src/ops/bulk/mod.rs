//! Bulk actions: a [`rerun`](super::rerun), [`retry`](super::retry) or
//! [`cancel`](super::cancel) of every item a [`BulkFilter`] selects, with a
//! preview, in bounded batches, resumable after a crash, audited.

//!
//! `mod.rs`: what an action is and which items its filter selects (the
//! statement both other files build on); `preview.rs`: the counts before;
//! `run.rs`: the record, the batches and the resume.

use chrono::{DateTime, Utc};
use idemstage_domain::{DomainError, ItemId, RunStatus, StageName, TenantId};
use serde::{Deserialize, Serialize};

/// What a bulk action does to each item it selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BulkAction {
    /// [`rerun`](super::rerun) the filter's stage (required).
    Rerun,
    /// [`retry`](super::retry) the filter's stage, or every dead stage of the
    /// item without one.
    Retry,
    /// [`cancel`](super::cancel) the item.
    Cancel,
}

impl BulkAction {
    /// The action's name: `rerun`, `retry`, `cancel`.
    pub fn as_str(self) -> &'static str {
        match self {
            BulkAction::Rerun => "rerun",
            BulkAction::Retry => "retry",
            BulkAction::Cancel => "cancel",
        }
    }
}

impl std::fmt::Display for BulkAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BulkAction {
    type Err = DomainError;
    fn from_str(s: &str) -> Result<Self, DomainError> {
        match s {
            "rerun" => Ok(BulkAction::Rerun),
            "retry" => Ok(BulkAction::Retry),
            "cancel" => Ok(BulkAction::Cancel),
            other => Err(DomainError::InvalidOption(format!(
                "unknown bulk action {other:?}: expected rerun, retry or cancel"
            ))),
        }
    }
}

/// Which items a bulk action selects: every condition given holds. Items are
/// taken in (tenant, item id) order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkFilter {
    /// Only this tenant's items.
    pub tenant: Option<TenantId>,
    /// Only items with a run of this stage (the stage a rerun or retry acts on).
    pub stage: Option<StageName>,
    /// Only items whose run of `stage` has one of these statuses (empty: any).
    #[serde(default)]
    pub statuses: Vec<RunStatus>,
    /// Only items registered at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only items registered before this time.
    pub until: Option<DateTime<Utc>>,
    /// Only these items (at most [`BulkFilter::MAX_ITEMS`]).
    pub items: Option<Vec<ItemId>>,
}

impl BulkFilter {
    /// The most item ids a filter names: the list travels with every batch's
    /// selection (and is kept in the action's record), so a longer one goes as
    /// several bulk actions, or as a tenant and a time.
    pub const MAX_ITEMS: usize = 10_000;

    /// A time of the filter given as text (RFC 3339), `name` saying which
    /// (`since`, `until`) in the error.
    pub fn parse_time(name: &str, text: &str) -> Result<DateTime<Utc>, DomainError> {
        DateTime::parse_from_rfc3339(text.trim())
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| {
                DomainError::InvalidOption(format!("{name} {text:?}: not an RFC 3339 time ({e})"))
            })
    }

    /// Statuses given as text, separated by commas (`success,dead`; empty:
    /// none, so any status).
    pub fn parse_statuses(text: &str) -> Result<Vec<RunStatus>, DomainError> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::parse)
            .collect()
    }

    /// Checks the filter for `action`: a rerun names a stage, statuses need a
    /// stage, `since` is before `until`, an item list is not empty, and the
    /// filter names at least a tenant, an item list or a time (a bulk action
    /// over every item of every tenant is not one to make by accident).
    pub fn check(&self, action: BulkAction) -> Result<(), DomainError> {
        let bad = |m: &str| Err(DomainError::InvalidOption(m.to_owned()));
        if action == BulkAction::Rerun && self.stage.is_none() {
            return bad("a bulk rerun names its stage");
        }
        if !self.statuses.is_empty() && self.stage.is_none() {
            return bad("a status filter needs a stage: the status is that stage's");
        }
        if let (Some(since), Some(until)) = (self.since, self.until) {
            if since >= until {
                return bad("since must be before until");
            }
        }
        match &self.items {
            Some(items) if items.is_empty() => return bad("the item list is empty"),
            Some(items) if items.len() > Self::MAX_ITEMS => {
                return bad(
                    "more than 10,000 items in the list: split it into several bulk actions",
                )
            }
            _ => {}
        }
        if self.tenant.is_none() && self.items.is_none() && self.since.is_none() {
            return bad(
                "a bulk action names a tenant, an item list or a time it starts from \
                 (--tenant, --items-file, --since)",
            );
        }
        Ok(())
    }
}

/// The items a filter selects (`$1` stage, `$2` tenant, `$3` since, `$4` until,
/// `$5` item ids, `$6` statuses), and the state a preview groups them by.
const SELECTED: &str = "\
SELECT a.tenant_id, a.id AS item_id,
       CASE WHEN $1::text IS NOT NULL THEN r.status
            WHEN EXISTS (SELECT 1 FROM stage_runs o
                          WHERE o.tenant_id = a.tenant_id AND o.item_id = a.id
                            AND o.status NOT IN ('success', 'dead', 'cancelled'))
              OR NOT EXISTS (SELECT 1 FROM stage_runs o
                              WHERE o.tenant_id = a.tenant_id AND o.item_id = a.id)
            THEN 'open' ELSE 'final' END AS state
  FROM items a
  LEFT JOIN stage_runs r ON r.tenant_id = a.tenant_id AND r.item_id = a.id AND r.stage = $1::text
 WHERE ($2::text IS NULL OR a.tenant_id = $2)
   AND ($3::timestamptz IS NULL OR a.created_at >= $3)
   AND ($4::timestamptz IS NULL OR a.created_at < $4)
   AND ($5::text[] IS NULL OR a.id = ANY($5))
   AND ($1::text IS NULL OR r.id IS NOT NULL)
   AND (cardinality($6::text[]) = 0 OR r.status = ANY($6))";

/// Binds a filter to a statement built on [`SELECTED`] (parameters `$1`–`$6`).
macro_rules! bind_filter {
    ($query:expr, $filter:expr) => {{
        let f: &BulkFilter = $filter;
        $query
            .bind::<Nullable<Text>, _>(f.stage.as_ref().map(|s| s.as_str().to_owned()))
            .bind::<Nullable<Text>, _>(f.tenant.as_ref().map(|t| t.as_str().to_owned()))
            .bind::<Nullable<Timestamptz>, _>(f.since)
            .bind::<Nullable<Timestamptz>, _>(f.until)
            .bind::<Nullable<Array<Text>>, _>(
                f.items
                    .as_ref()
                    .map(|items| items.iter().map(ItemId::to_string).collect::<Vec<_>>()),
            )
            .bind::<Array<Text>, _>(
                f.statuses
                    .iter()
                    .map(|s| s.as_str().to_owned())
                    .collect::<Vec<_>>(),
            )
    }};
}

mod preview;
mod run;

pub use preview::{preview, BulkPreview, PreviewGroup};
pub use run::{bulk_progress, run_bulk, start_bulk, BulkProgress};
