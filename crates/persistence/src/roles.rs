//! The roles of migration `2026-12-01-000110_roles` and the check a worker makes
//! before it starts ([`check_worker_role`]).
//!
//! * the migration owner (whoever runs `migrate`) owns every table;
//! * [`WORKER_ROLE`] `idemstage_worker`: the group role of the workers' login
//!   roles (`CREATE ROLE w LOGIN PASSWORD '..' IN ROLE idemstage_worker;`). It
//!   works the queue directly and reaches the tenant tables only through the
//!   tenant scope ([`crate::tenant`], as `idemstage_app`); it may not delete runs
//!   or their history, nor change the schema;
//! * [`OPERATOR_ROLE`] `idemstage_operator`: status, console, reports and the
//!   operator commands: reads every tenant's rows, writes the queue controls, and
//!   retries or cancels scoped to the tenant it names.
//!
//! Row-level security holds only for a connection that is not a superuser, has no
//! BYPASSRLS and does not own the tables: [`check_worker_role`] says which of
//! these a connection is.

use diesel::sql_types::{Array, Bool, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::RepoError;

/// The group role of the workers' login roles.
pub const WORKER_ROLE: &str = "idemstage_worker";

/// The group role of operators (status, console, reports, retry, cancel, controls).
pub const OPERATOR_ROLE: &str = "idemstage_operator";

/// The core's tables, whose owner a worker must not be.
pub const CORE_TABLES: [&str; 8] = [
    "anfragen",
    "pipeline_runs",
    "pipeline_run_attempts",
    "audit_log",
    "jobs",
    "queue_controls",
    "queue_control_changes",
    "queue_buckets",
];

/// What the login role of a connection is, as far as row-level security goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoleCheck {
    /// Neither a superuser nor BYPASSRLS, and owns none of the core's tables
    /// (directly or through a role it may become): row-level security holds.
    Restricted {
        /// The login role (`session_user`).
        role: String,
    },
    /// A superuser, or a member of one: every check is bypassed.
    Superuser {
        /// The login role.
        role: String,
    },
    /// BYPASSRLS, or a member of a role that has it: the policies are bypassed.
    BypassRls {
        /// The login role.
        role: String,
    },
    /// Owns these core tables (or may become their owner): it may alter or drop
    /// them and switch their row-level security off.
    OwnsTables {
        /// The login role.
        role: String,
        /// The core tables it owns, by name.
        tables: Vec<String>,
    },
}

impl RoleCheck {
    /// True for [`RoleCheck::Restricted`]: fit to run a worker.
    pub fn is_restricted(&self) -> bool {
        matches!(self, RoleCheck::Restricted { .. })
    }

    /// The login role checked.
    pub fn role(&self) -> &str {
        match self {
            RoleCheck::Restricted { role }
            | RoleCheck::Superuser { role }
            | RoleCheck::BypassRls { role }
            | RoleCheck::OwnsTables { role, .. } => role,
        }
    }
}

impl std::fmt::Display for RoleCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RoleCheck::Restricted { role } => {
                write!(f, "role {role} is subject to row-level security")
            }
            RoleCheck::Superuser { role } => write!(
                f,
                "role {role} is a superuser (or may become one): row-level security does not apply to it"
            ),
            RoleCheck::BypassRls { role } => write!(
                f,
                "role {role} has BYPASSRLS (or may become a role that has): row-level security does not apply to it"
            ),
            RoleCheck::OwnsTables { role, tables } => write!(
                f,
                "role {role} owns (or may become the owner of) {}: it may switch row-level security off",
                tables.join(", ")
            ),
        }
    }
}

#[derive(diesel::QueryableByName)]
struct Row {
    #[diesel(sql_type = Text)]
    role: String,
    #[diesel(sql_type = Bool)]
    superuser: bool,
    #[diesel(sql_type = Bool)]
    bypassrls: bool,
    #[diesel(sql_type = Array<Text>)]
    owned: Vec<String>,
}

/// `session_user` (the login role, which `RESET ROLE` returns to) and every role
/// it may `SET ROLE` to: a superuser, BYPASSRLS, the owner of a core table?
const CHECK_SQL: &str = "\
SELECT session_user::text AS role,
       EXISTS (SELECT FROM pg_roles r
                WHERE r.rolsuper AND pg_has_role(session_user, r.oid, 'MEMBER')) AS superuser,
       EXISTS (SELECT FROM pg_roles r
                WHERE r.rolbypassrls AND pg_has_role(session_user, r.oid, 'MEMBER')) AS bypassrls,
       coalesce((SELECT array_agg(c.relname::text ORDER BY c.relname)
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = 'public' AND c.relname = ANY($1)
                    AND pg_has_role(session_user, c.relowner, 'MEMBER')),
                '{}') AS owned";

/// Checks the login role of `conn` (`session_user`, and every role it may become
/// with `SET ROLE`): a worker should run only on a [`RoleCheck::Restricted`] one,
/// so that a stage body that leaves the tenant scope (`RESET ROLE`) holds no
/// more rights than the worker role's. `idemstage worker` refuses anything else
/// unless `--allow-owner`; a team's own binary calls this before it starts its
/// workers.
pub async fn check_worker_role(conn: &mut AsyncPgConnection) -> Result<RoleCheck, RepoError> {
    let query = diesel::sql_query(CHECK_SQL).bind::<Array<Text>, _>(CORE_TABLES.to_vec());
    let row: Row = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(crate::error::map_diesel_error)?;
    Ok(if row.superuser {
        RoleCheck::Superuser { role: row.role }
    } else if row.bypassrls {
        RoleCheck::BypassRls { role: row.role }
    } else if !row.owned.is_empty() {
        RoleCheck::OwnsTables {
            role: row.role,
            tables: row.owned,
        }
    } else {
        RoleCheck::Restricted { role: row.role }
    })
}
