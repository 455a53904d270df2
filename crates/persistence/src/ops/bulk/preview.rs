//! What a bulk action would select now, before it runs.

use diesel::sql_types::{Array, BigInt, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, TenantId};
use serde::Serialize;

use super::{BulkAction, BulkFilter, SELECTED};
use crate::ops::OpsError;

/// How many selected items there are of one tenant in one state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PreviewGroup {
    /// The tenant.
    pub tenant: TenantId,
    /// With a stage: its run's status. Without: `open` (a stage not final, or
    /// no run yet) or `final`.
    pub state: String,
    /// Items.
    pub items: i64,
}

/// What a bulk action would select now (nothing written).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BulkPreview {
    /// The action.
    pub action: BulkAction,
    /// Items selected, by tenant and state.
    pub groups: Vec<PreviewGroup>,
    /// Items selected.
    pub selected: i64,
    /// Of those, items the action would change as things stand (a rerun:
    /// `success` or `dead`; a retry: `dead`, without a stage every item; a
    /// cancel: `open`). Workers move on meanwhile: the run decides item by item.
    pub eligible: i64,
}

#[derive(QueryableByName)]
struct GroupRow {
    #[diesel(sql_type = Text)]
    tenant_id: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    items: i64,
}

/// What `action` over `filter` would select now, by tenant and state (read
/// only; as the operator, across tenants).
pub async fn preview(
    conn: &mut AsyncPgConnection,
    action: BulkAction,
    filter: &BulkFilter,
) -> Result<BulkPreview, OpsError> {
    filter.check(action)?;
    let sql = format!(
        "SELECT tenant_id, state, count(*) AS items FROM ({SELECTED}) s \
          GROUP BY tenant_id, state ORDER BY tenant_id, state"
    );
    let rows: Vec<GroupRow> = bind_filter!(diesel::sql_query(sql), filter)
        .load(conn)
        .await?;
    let eligible_state = |state: &str| match action {
        BulkAction::Rerun => state == "success" || state == "dead",
        BulkAction::Retry if filter.stage.is_some() => state == "dead",
        BulkAction::Retry => true,
        BulkAction::Cancel if filter.stage.is_some() => {
            !matches!(state, "success" | "dead" | "cancelled")
        }
        BulkAction::Cancel => state == "open",
    };
    let mut groups = Vec::with_capacity(rows.len());
    let (mut selected, mut eligible) = (0, 0);
    for r in rows {
        selected += r.items;
        if eligible_state(&r.state) {
            eligible += r.items;
        }
        groups.push(PreviewGroup {
            tenant: TenantId::parse(&r.tenant_id)?,
            state: r.state,
            items: r.items,
        });
    }
    Ok(BulkPreview {
        action,
        groups,
        selected,
        eligible,
    })
}
