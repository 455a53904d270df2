//! Integration tests of the runner crate (one binary): the queue worker loop and
//! in-process stage workers (shutdown, database errors) against a real PostgreSQL.
//! The tests that run `idemstage` processes are in `crates/dev/tests/it/`.

mod builder;
mod config;
mod controls;
mod db_errors;
mod interruptions;
mod leases;
mod prefetch;
mod queue_worker;
mod reconcile;
mod shutdown;
mod support;
