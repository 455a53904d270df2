//! Integration tests of the runner crate (one binary): the queue worker loop and
//! `idemstage worker` processes against a real PostgreSQL.

mod cli;
mod processes;
mod queue_worker;
