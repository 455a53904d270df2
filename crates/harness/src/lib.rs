//! Our own test harnesses (`publish = false`; a team links `idemstage-testkit`
//! only): a PgBouncer in front of the test server, private and replicated
//! PostgreSQL clusters for the fault and failover tests, and the seed example
//! pipeline in tests ([`example`]).

pub mod example;
mod pg_server;
mod pgbouncer;
mod private_cluster;
mod replicated_cluster;

pub use pgbouncer::PgBouncer;
pub use private_cluster::PrivateCluster;
pub use replicated_cluster::{ReplicatedCluster, Replication};
