//! `PrivateCluster`: a throwaway PostgreSQL server of one test's own.

use crate::pg_server::Server;

/// A throwaway PostgreSQL cluster of the test's own, for tests that must restart
/// the server (the shared server of `TestDb` cannot be restarted under other tests).
/// Started from the local server binaries (`initdb`, `pg_ctl` on PATH or under
/// `/usr/lib/postgresql/*/bin`); as root the server runs as the `postgres` (or
/// `nobody`) user, like xtask's cluster. Stopped and deleted on drop.
pub struct PrivateCluster {
    server: Server,
}

impl PrivateCluster {
    /// Initialises and starts the cluster on a free port (superuser `postgres`,
    /// trust authentication; not durable: `fsync`, `synchronous_commit` and
    /// `full_page_writes` off, as nothing outlives the test).
    pub fn start() -> PrivateCluster {
        let server = Server::new(
            "private",
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off \
             -c max_connections=200",
        );
        server.initdb();
        server.pg_ctl(&["start"]);
        PrivateCluster { server }
    }

    /// URL of database `db` (the cluster has `postgres`).
    pub fn url(&self, db: &str) -> String {
        self.server.url(db)
    }

    /// `pg_ctl restart -m fast`: every connection is closed, the server is back
    /// when this returns.
    pub fn restart(&self) {
        self.server.pg_ctl(&["-m", "fast", "restart"]);
    }
}
