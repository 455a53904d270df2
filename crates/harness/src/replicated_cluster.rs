//! `ReplicatedCluster`: a throwaway primary with a streaming standby, for
//! failover tests.

use crate::pg_server::Server;

/// The standby's `application_name`, the name `synchronous_standby_names` lists.
const STANDBY_NAME: &str = "standby";

/// Settings of both servers. `fsync=off` is harmless here (the tests kill server
/// processes, not the machine, and the kernel keeps what a killed server wrote),
/// but `synchronous_commit` stays `on`: with `off` a commit would not wait for the
/// standby either, and synchronous replication would promise nothing.
const SETTINGS: &str = "-c fsync=off -c synchronous_commit=on -c max_connections=200 \
                        -c wal_level=replica -c max_wal_senders=4 -c hot_standby=on";

/// How a commit on the primary waits for the standby.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names = 'standby'` and `synchronous_commit = on` on
    /// the primary: a commit returns (and becomes visible to other sessions) only
    /// once the standby has flushed it, so nothing a client saw committed is lost
    /// with the primary.
    Synchronous,
    /// No synchronous standby: a commit returns once the primary has it; the
    /// standby follows a moment later. What the primary committed but had not yet
    /// shipped is lost when it dies.
    Asynchronous,
}

/// A throwaway primary and a hot standby streaming from it (`pg_basebackup -R`),
/// each in a directory of its own, from the same server binaries as
/// [`crate::PrivateCluster`] (and, as root, run as the same user). Both are
/// stopped and deleted on drop.
///
/// Clients find whichever is the primary through [`ReplicatedCluster::multi_host_url`]
/// (`target_session_attrs=read-write`); a failover is
/// [`ReplicatedCluster::stop_primary_immediate`] then
/// [`ReplicatedCluster::promote_standby`].
pub struct ReplicatedCluster {
    primary: Server,
    standby: Server,
    replication: Replication,
}

impl ReplicatedCluster {
    /// Initialises and starts the primary, clones it into the standby, starts the
    /// standby, and returns once the primary sees it streaming (and, for
    /// [`Replication::Synchronous`], as its synchronous standby).
    pub fn start(replication: Replication) -> ReplicatedCluster {
        let primary_settings = match replication {
            Replication::Synchronous => {
                format!("{SETTINGS} -c synchronous_standby_names={STANDBY_NAME}")
            }
            Replication::Asynchronous => SETTINGS.to_owned(),
        };
        let primary = Server::new("primary", &primary_settings);
        primary.initdb();
        primary.pg_ctl(&["start"]);
        // The standby's settings never name a synchronous standby of its own: once
        // promoted, its commits would wait for a standby that does not exist.
        let mut standby = Server::new("standby", SETTINGS);
        while standby.port() == primary.port() {
            standby.repick_port();
        }
        // -R writes standby.signal and primary_conninfo (with the application_name
        // below, which synchronous_standby_names refers to).
        let source = format!(
            "host=127.0.0.1 port={} user=postgres application_name={STANDBY_NAME}",
            primary.port()
        );
        standby.run(
            "pg_basebackup",
            &[
                "-D",
                "data",
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
                "-d",
                &source,
            ],
        );
        standby.pg_ctl(&["start"]);
        let want = match replication {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        };
        primary.wait_for(
            "the standby to stream",
            &format!(
                "SELECT sync_state FROM pg_stat_replication \
                 WHERE application_name = '{STANDBY_NAME}' AND state = 'streaming'"
            ),
            want,
            60,
        );
        ReplicatedCluster {
            primary,
            standby,
            replication,
        }
    }

    /// The mode it was started in.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// URL of database `db` on the primary only, as the superuser `postgres`.
    pub fn primary_url(&self, db: &str) -> String {
        self.primary.url(db)
    }

    /// URL of database `db` on the standby only (read-only until promoted), as
    /// the superuser `postgres`.
    pub fn standby_url(&self, db: &str) -> String {
        self.standby.url(db)
    }

    /// URL of database `db` naming both servers,
    /// `postgres://postgres@127.0.0.1:P1,127.0.0.1:P2/db?target_session_attrs=read-write`:
    /// a client tries them in order and keeps the first that accepts writes, so
    /// after a failover it connects to the promoted standby on its own.
    pub fn multi_host_url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{db}?target_session_attrs=read-write",
            self.primary.port(),
            self.standby.port()
        )
    }

    /// Cuts the standby off: its `primary_conninfo` is emptied and reloaded, and
    /// this returns once its WAL receiver has stopped and the primary's WAL sender
    /// is gone. From then on the primary commits what the standby will never see
    /// (under [`Replication::Synchronous`] every commit waits instead, for good).
    /// For showing what asynchronous replication loses.
    pub fn pause_replication(&self) {
        self.standby.psql("ALTER SYSTEM SET primary_conninfo = ''");
        self.standby.psql("SELECT pg_reload_conf()");
        self.standby.wait_for(
            "the standby's WAL receiver to stop",
            "SELECT count(*) FROM pg_stat_wal_receiver",
            "0",
            30,
        );
        self.primary.wait_for(
            "the primary's WAL sender to end",
            "SELECT count(*) FROM pg_stat_replication",
            "0",
            30,
        );
    }

    /// Returns once at least `n` sessions on the primary wait inside COMMIT for
    /// the synchronous standby (`wait_event = 'SyncRep'`): under
    /// [`Replication::Synchronous`] after [`ReplicatedCluster::pause_replication`],
    /// commits that are on the primary's disk but held back from every client.
    pub fn wait_for_commits_held(&self, n: usize) {
        self.primary.wait_for(
            &format!("{n} commits waiting for the standby"),
            &format!("SELECT count(*) >= {n} FROM pg_stat_activity WHERE wait_event = 'SyncRep'"),
            "t",
            60,
        );
    }

    /// `pg_ctl stop -m immediate` on the primary: every server process is killed
    /// at once (no checkpoint, no goodbye to clients), as in a crash. It stays
    /// down.
    pub fn stop_primary_immediate(&self) {
        self.primary.pg_ctl(&["-m", "immediate", "stop"]);
    }

    /// `pg_ctl promote` on the standby; returns once it accepts writes (it replays
    /// every WAL record it received first).
    pub fn promote_standby(&self) {
        self.standby.pg_ctl(&["promote"]);
        self.standby.wait_for(
            "the promoted standby to leave recovery",
            "SELECT pg_is_in_recovery()",
            "f",
            60,
        );
    }
}
