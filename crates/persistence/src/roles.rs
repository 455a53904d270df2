//! The roles of migration `2026-11-30-000000_baseline` and the check a worker makes
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
//! Row-level security holds only for a connection that cannot get around it: not
//! a superuser, no BYPASSRLS, owns none of the tables, and cannot make itself or
//! its code the owner's: no CREATEROLE (on PostgreSQL 15 it may grant itself
//! the owner's role), not the owner of the database or of the schema `public`
//! and no CREATE on it (each may put objects there that other roles' statements,
//! and the owner's, then run). [`check_worker_role`] says which of these a
//! connection is.

use diesel::sql_types::{Array, Bool, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::RepoError;

/// The group role of the workers' login roles.
pub const WORKER_ROLE: &str = "idemstage_worker";

/// The group role of operators (status, console, reports, retry, cancel, controls).
pub const OPERATOR_ROLE: &str = "idemstage_operator";

/// The core's tables, whose owner a worker must not be.
pub const CORE_TABLES: [&str; 8] = [
    "items",
    "stage_runs",
    "stage_attempt_ends",
    "audit_log",
    "jobs",
    "queue_controls",
    "queue_control_changes",
    "queue_buckets",
];

/// The schema of the core's tables and functions.
pub const CORE_SCHEMA: &str = "public";

/// What the login role of a connection is, as far as row-level security goes.
/// The first that applies, in the order of the variants.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    /// CREATEROLE, or a member of a role that has it: on PostgreSQL 15 it may
    /// grant itself any role but a superuser, the tables' owner included.
    CreateRole {
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
    /// Owns the database (or may become its owner): it owns the schema `public`
    /// too (`pg_database_owner`), and may set the database's `search_path`.
    OwnsDatabase {
        /// The login role.
        role: String,
        /// The database.
        database: String,
    },
    /// Owns the core's schema (or may become its owner): it may drop and
    /// replace any table or function in it, whoever owns them.
    OwnsSchema {
        /// The login role.
        role: String,
        /// The schema.
        schema: String,
    },
    /// May create objects in the core's schema: functions and operators there
    /// that match an unqualified call better than the built-in ones run as
    /// whoever calls them.
    CreateOnSchema {
        /// The login role.
        role: String,
        /// The schema.
        schema: String,
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
            | RoleCheck::CreateRole { role }
            | RoleCheck::OwnsTables { role, .. }
            | RoleCheck::OwnsDatabase { role, .. }
            | RoleCheck::OwnsSchema { role, .. }
            | RoleCheck::CreateOnSchema { role, .. } => role,
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
            RoleCheck::CreateRole { role } => write!(
                f,
                "role {role} has CREATEROLE (or may become a role that has): it may grant itself the tables' owner"
            ),
            RoleCheck::OwnsDatabase { role, database } => write!(
                f,
                "role {role} owns (or may become the owner of) database {database}: it may replace the tables and functions of its schema public"
            ),
            RoleCheck::OwnsSchema { role, schema } => write!(
                f,
                "role {role} owns (or may become the owner of) schema {schema}: it may replace the tables and functions in it"
            ),
            RoleCheck::CreateOnSchema { role, schema } => write!(
                f,
                "role {role} may create objects in schema {schema} (REVOKE CREATE ON SCHEMA {schema} FROM it, or from PUBLIC): they would run in other roles' statements"
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
    #[diesel(sql_type = Bool)]
    createrole: bool,
    #[diesel(sql_type = Array<Text>)]
    owned: Vec<String>,
    #[diesel(sql_type = Nullable<Text>)]
    owned_database: Option<String>,
    #[diesel(sql_type = Bool)]
    owns_schema: bool,
    #[diesel(sql_type = Bool)]
    create_on_schema: bool,
}

/// `session_user` (the login role, which `RESET ROLE` returns to) and every role
/// it may `SET ROLE` to: a superuser, BYPASSRLS, CREATEROLE, the owner of a core
/// table, of the database or of the schema `$2`, CREATE on that schema?
/// (`pg_has_role` counts the database's owner a member of `pg_database_owner`,
/// the owner of `public` on PostgreSQL 15.)
const CHECK_SQL: &str = "\
WITH mine AS (
    SELECT r.* FROM pg_catalog.pg_roles r
     WHERE pg_catalog.pg_has_role(session_user, r.oid, 'MEMBER')
), core_schema AS (
    SELECT n.oid, n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = $2
)
SELECT session_user::text AS role,
       EXISTS (SELECT FROM mine WHERE mine.rolsuper) AS superuser,
       EXISTS (SELECT FROM mine WHERE mine.rolbypassrls) AS bypassrls,
       EXISTS (SELECT FROM mine WHERE mine.rolcreaterole) AS createrole,
       coalesce((SELECT pg_catalog.array_agg(c.relname::text ORDER BY c.relname)
                   FROM pg_catalog.pg_class c JOIN core_schema n ON n.oid = c.relnamespace
                  WHERE c.relname = ANY($1)
                    AND pg_catalog.pg_has_role(session_user, c.relowner, 'MEMBER')),
                '{}') AS owned,
       (SELECT d.datname::text FROM pg_catalog.pg_database d
         WHERE d.datname = pg_catalog.current_database()
           AND pg_catalog.pg_has_role(session_user, d.datdba, 'MEMBER')) AS owned_database,
       EXISTS (SELECT FROM core_schema n
                WHERE pg_catalog.pg_has_role(session_user, n.nspowner, 'MEMBER')) AS owns_schema,
       EXISTS (SELECT FROM core_schema n, mine
                WHERE pg_catalog.has_schema_privilege(mine.oid, n.oid, 'CREATE')) AS create_on_schema";

/// Checks the login role of `conn` (`session_user`, and every role it may become
/// with `SET ROLE`): a worker should run only on a [`RoleCheck::Restricted`] one,
/// so that a stage body that leaves the tenant scope (`RESET ROLE`) holds no
/// more rights than the worker role's. `idemstage worker` refuses anything else
/// unless `--allow-owner`; a team's own binary calls this before it starts its
/// workers.
pub async fn check_worker_role(conn: &mut AsyncPgConnection) -> Result<RoleCheck, RepoError> {
    let query = diesel::sql_query(CHECK_SQL)
        .bind::<Array<Text>, _>(CORE_TABLES.to_vec())
        .bind::<Text, _>(CORE_SCHEMA);
    let row: Row = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(crate::error::map_diesel_error)?;
    let role = row.role;
    let schema = CORE_SCHEMA.to_owned();
    Ok(if row.superuser {
        RoleCheck::Superuser { role }
    } else if row.bypassrls {
        RoleCheck::BypassRls { role }
    } else if row.createrole {
        RoleCheck::CreateRole { role }
    } else if !row.owned.is_empty() {
        RoleCheck::OwnsTables {
            role,
            tables: row.owned,
        }
    } else if let Some(database) = row.owned_database {
        RoleCheck::OwnsDatabase { role, database }
    } else if row.owns_schema {
        RoleCheck::OwnsSchema { role, schema }
    } else if row.create_on_schema {
        RoleCheck::CreateOnSchema { role, schema }
    } else {
        RoleCheck::Restricted { role }
    })
}
