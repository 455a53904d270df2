//! PostgreSQL implementation of idemstage: the schema, the embedded migrations, the
//! bb8 pool, the claim repository and the job queue.
//!
//! Invariant: this is the only crate of the core that names Diesel tables (the
//! core's; a pipeline's crate names its own).

pub mod anfragen;
pub mod cached;
pub mod db;
pub mod error;
pub mod fenced;
pub mod queue;
pub mod report;
pub mod runs;
pub mod schema;
pub mod statements;
pub mod tenant;

pub use db::{
    connect, connect_pool, get, migrate, migrate_with, redact_url, revert_all_migrations,
    revert_all_with, PgPool, PoolConfig, PooledConn, MIGRATIONS, MIGRATIONS_FINGERPRINT,
};
pub use error::{map_diesel_error, TxError};
pub use fenced::{FencedTx, FencedWrite, InsertOrGet, Replaced};
pub use runs::PgRunRepository;
