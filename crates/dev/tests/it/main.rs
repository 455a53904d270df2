//! Integration tests of the CLI crate (one binary): `idemstage` and `idemstage
//! worker` processes, fault injection (failover to a standby among them), bad
//! input and the soak against a real PostgreSQL.

mod bad_input;
mod bulk;
mod cli;
mod console;
mod failover;
mod faults;
mod large_input;
mod logs;
mod metrics;
mod nul_input;
mod ops;
mod pooler;
mod processes;
mod signal;
mod soak;
mod support;
mod unknown_names;
