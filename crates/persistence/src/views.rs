//! The Diesel `table!` definitions of the core's views, for reads with
//! Diesel's DSL (`diesel print-schema` writes tables only). Read-only: a write
//! to a view is refused by the database.

diesel::table! {
    /// Every attempt of every run, one row an attempt: the ended attempts
    /// (`stage_attempt_ends`) and each run's current attempt that has not
    /// ended (`outcome` `running`, read from the run's row). Migration
    /// `2026-12-06-010000_attempt_ends`.
    stage_run_attempts (run_id, attempt) {
        /// The run (`stage_runs.id`).
        run_id -> Text,
        /// The attempt's number, the run's fencing token while it ran.
        attempt -> Int4,
        /// The run's tenant.
        tenant_id -> Text,
        /// The worker that claimed the attempt.
        worker_id -> Text,
        /// The hash of the input the attempt was bound to.
        input_hash -> Text,
        /// When the attempt was claimed.
        started_at -> Timestamptz,
        /// When it ended; `NULL` while `running`.
        finished_at -> Nullable<Timestamptz>,
        /// `running`, `success`, `failed`, `abandoned`, `fenced`, `cancelled` or `waiting`.
        outcome -> Text,
        /// The error it ended with, if any.
        error -> Nullable<Text>,
        /// The upstream attempt it read (`NULL` for a first stage).
        upstream_attempt -> Nullable<Int4>,
    }
}
