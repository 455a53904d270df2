//! The SQL text of the library's statements, by name.
//!
//! Each entry is the very text the library sends (placeholders `$1..$n`, bound by
//! the calling code): the executing function and this registry read the same
//! `const` (or the same `LazyLock` built once), so there is no copy to drift. The
//! isolation tests (`tests/isolation/`) render their specs from this registry:
//! `{{job_complete}}` in a spec becomes the text of `job_complete`, so a spec always
//! races the statements the library runs today.
//!
//! Adding a statement is one line in [`all`]: `s("name", path::TO_SQL)` for a text
//! statement (`&str` const or `LazyLock<String>`), or
//! `s("name", &sql_of(&query))` for one built with Diesel's DSL (its text as Diesel
//! sends it; build `query` with any values of the right shape, since the values
//! travel as binds, except where the DSL changes the text with the value, e.g.
//! `None` in an insert becomes `DEFAULT`). Names are `<area>_<operation>`
//! (`job_`, `tenant_`, ...) and unique.

use diesel::pg::{Pg, PgQueryBuilder};
use diesel::query_builder::{QueryBuilder, QueryFragment};

use crate::{fanout, ops, queue, reconcile, runs, tenant, waits};

/// One statement of the library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Statement {
    /// Unique name, e.g. `job_complete`.
    pub name: &'static str,
    /// The exact text the library sends, with `$1..$n` placeholders.
    pub sql: String,
}

/// Every registered statement, in a stable order. Bind types are documented at each
/// statement's definition (the `const`/`static` named here).
pub fn all() -> Vec<Statement> {
    fn s(name: &'static str, sql: &str) -> Statement {
        Statement {
            name,
            sql: sql.to_owned(),
        }
    }
    vec![
        s("tenant_scope", tenant::SCOPE_SQL),
        s("job_send", &queue::SEND_SQL_NOTIFYING),
        s("job_send_quiet", &queue::SEND_SQL_QUIET),
        s("job_notify_queues", queue::NOTIFY_QUEUES_SQL),
        s("job_send_batch", queue::SEND_BATCH_SQL),
        s("job_fetch", queue::FETCH_SQL),
        s("job_fetch_async_commit", queue::FETCH_ASYNC_COMMIT_SQL),
        s("job_fetch_wait", queue::FETCH_WAIT_SQL),
        s("job_advance_floors", queue::ADVANCE_FLOORS_SQL),
        s("job_complete", &queue::COMPLETE_SQL),
        s("job_complete_many", &queue::COMPLETE_MANY_SQL),
        s("job_fail", &queue::FAIL_SQL),
        s("job_cancel", &queue::CANCEL_SQL),
        s("job_retry_at", &queue::RETRY_AT_SQL),
        s("job_renew_lease", &queue::RENEW_LEASE_SQL),
        s("job_renew_leases", &queue::RENEW_LEASES_SQL),
        s("job_retry_now_many", &queue::RETRY_NOW_MANY_SQL),
        s("job_expiry_candidates", queue::EXPIRY_CANDIDATES_SQL),
        s("job_expire_leases", &queue::EXPIRE_SQL),
        s("job_retry_after", &queue::RETRY_AFTER_SQL),
        s("queue_hold", queue::HOLD_SQL),
        s("run_claim", runs::sql::CLAIM),
        s("run_explain_skip", runs::sql::EXPLAIN_SKIP),
        s("run_gather_ready", runs::sql::GATHER_READY),
        s("run_mark_exhausted", runs::sql::MARK_EXHAUSTED),
        s("run_restore_success", runs::sql::RESTORE_SUCCESS),
        s("run_bound_input", runs::sql::BOUND_INPUT),
        s("run_read_bound", runs::sql::READ_BOUND),
        s("run_checkpoint", runs::sql::CHECKPOINT),
        s("run_record_output", runs::sql::RECORD_OUTPUT),
        s(
            "run_record_output_clear_checkpoint",
            runs::sql::RECORD_OUTPUT_CLEAR_CHECKPOINT,
        ),
        s("run_lineage_current", runs::sql::LINEAGE_CURRENT),
        s("run_fence_success", runs::sql::FENCE_SUCCESS),
        s(
            "run_invalidate_downstream",
            runs::sql::INVALIDATE_DOWNSTREAM,
        ),
        s("run_stale_on_lineage", runs::sql::STALE_ON_LINEAGE),
        s("run_fail", runs::sql::FAIL),
        s("run_release", runs::sql::RELEASE),
        s("run_end_attempt", runs::sql::END_ATTEMPT),
        s("run_fence_abandoned", runs::sql::FENCE_ABANDONED),
        s("run_interrupt", runs::sql::INTERRUPT),
        s("run_renew", runs::sql::RENEW),
        s("ops_rerun_mark", ops::rerun::MARK_RERUN),
        s("ops_rerun_record", ops::rerun::RECORD_RERUN),
        s("ops_cancel_lock_runs", ops::cancel::LOCK_RUNS_SQL),
        s("ops_cancel_runs", ops::cancel::CANCEL_RUNS_SQL),
        s("ops_cancel_queued", ops::cancel::CANCEL_QUEUED_SQL),
        s("ops_cancel_open_children", ops::cancel::OPEN_CHILDREN_SQL),
        s(
            "ops_cancel_lock_child_runs",
            ops::cancel::LOCK_CHILD_RUNS_SQL,
        ),
        s("ops_cancel_gathers", ops::cancel::GATHERS_SQL),
        s("run_wait", runs::wait::WAIT),
        s("fanout_child_final", fanout::CHILD_FINAL),
        s("fanout_gather_read", fanout::GATHER_READ),
        s("fanout_gather_version", fanout::GATHER_VERSION),
        s("fanout_supersede", fanout::SUPERSEDE),
        s("fanout_supersede_runs", fanout::SUPERSEDE_RUNS),
        s("run_signal_of", runs::wait::SIGNAL_OF),
        s("ops_signal_deliver", ops::signal::DELIVER),
        s("waits_due", waits::DUE),
        s("waits_expire", waits::EXPIRE),
        s("reconcile_open_items", reconcile::OPEN_SQL),
        s("reconcile_rotate", reconcile::ROTATE_SQL),
        s("reconcile_seal", reconcile::SEAL_SQL),
        s("reconcile_truncate", reconcile::TRUNCATE_SQL),
        s("reconcile_carry", reconcile::CARRY_SQL),
    ]
}

/// The statement called `name`, if registered.
pub fn get(name: &str) -> Option<Statement> {
    all().into_iter().find(|s| s.name == name)
}

/// The SQL text Diesel sends for `query` (binds as `$1..$n`), for registering a
/// statement built with the DSL.
pub fn sql_of<Q: QueryFragment<Pg>>(query: &Q) -> String {
    let mut out = PgQueryBuilder::default();
    query
        .to_sql(&mut out, &Pg)
        .expect("a Diesel query renders to SQL");
    out.finish()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// `{name}`: a slot of the texts that are built from templates (`{lease}`, ...).
    fn has_template_slot(sql: &str) -> bool {
        sql.split('{').skip(1).any(|rest| {
            rest.split_once('}').is_some_and(|(slot, _)| {
                !slot.is_empty() && slot.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            })
        })
    }

    #[test]
    fn names_are_unique_and_texts_use_binds() {
        let all = all();
        let names: HashSet<_> = all.iter().map(|s| s.name).collect();
        assert_eq!(names.len(), all.len(), "duplicate statement name");
        for s in &all {
            assert!(s.sql.contains("$1"), "{} has no $1: {}", s.name, s.sql);
            assert!(
                !has_template_slot(&s.sql),
                "{} has an unfilled slot",
                s.name
            );
        }
        assert_eq!(get("job_complete").unwrap().sql, *queue::COMPLETE_SQL);
    }

    #[test]
    fn sql_of_renders_a_dsl_query_as_sent() {
        use crate::schema::jobs;
        use diesel::prelude::*;
        let query =
            diesel::update(jobs::table.filter(jobs::id.eq("x"))).set(jobs::state.eq("completed"));
        assert_eq!(
            sql_of(&query),
            r#"UPDATE "jobs" SET "state" = $1 WHERE ("jobs"."id" = $2)"#
        );
    }
}
