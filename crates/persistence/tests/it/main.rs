//! Integration tests of the persistence crate, one binary (link time on 2 cores).
//! Every test gets its own database from `idemstage_testkit::TestDb`.

mod claim;
mod claim_cost;
mod claims;
mod closures;
mod controls;
mod diesel_errors;
mod fair;
mod fetch_plans;
mod floors;
mod foundation;
mod hot_updates;
mod isolation;
mod job_labels;
mod lane_starts;
mod no_jit;
mod open_ring;
mod ops;
mod pgbench_scripts;
mod pooler;
mod queue;
mod roles;
mod run_fk_plans;
mod singletons;
mod start;
mod support;
mod team_tables;
mod tenant_isolation;
mod tenant_run_fks;
mod wake;
