//! Integration tests of the runner crate (one binary): the queue worker loop,
//! `idemstage worker` processes, fault injection and bad input against a real
//! PostgreSQL.

mod bad_input;
mod cli;
mod db_errors;
mod faults;
mod processes;
mod queue_worker;
mod shutdown;
mod soak;
mod support;
