//! Bulk fixtures for `idemstage bench` (and the reset of `idemstage demo`). Workers
//! never call these: they write rows directly (outside the claim and the queue)
//! so that benchmarks can set up large states quickly, outside their timed windows.

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::db::map_diesel_error;
use idemstage::{db::RepoError, ids::ItemId};

/// Numbered items have ids `lpad(ITEM_BASE + i, 26, '0')`: all digits and a
/// leading `0`, so valid ULID text, and producible by pgbench scripts, which have
/// no string functions (`'000000000000000000:a'` with `a` 8 digits long).
pub const ITEM_BASE: u64 = 10_000_000;

/// The id of numbered item `i` (`i < 90_000_000`).
pub fn numbered_item_id(i: u64) -> ItemId {
    ItemId::parse(&format!("{:026}", ITEM_BASE + i)).expect("digits are valid ULID text")
}

#[derive(diesel::QueryableByName)]
struct Name {
    #[diesel(sql_type = Text)]
    name: String,
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

pub async fn current_database(conn: &mut AsyncPgConnection) -> Result<String, RepoError> {
    let row: Name = diesel::sql_query("SELECT current_database()::text AS name")
        .get_result(conn)
        .await
        .map_err(map_diesel_error)?;
    Ok(row.name)
}

/// Empties every table of the schema but the migrations' record (a benchmark or
/// demo database only): every table there is, so a table a later migration adds
/// (or a team's) is emptied too.
pub async fn reset(conn: &mut AsyncPgConnection) -> Result<(), RepoError> {
    diesel::sql_query(
        "DO $$ BEGIN
           EXECUTE (SELECT 'TRUNCATE ' || string_agg(format('public.%I', tablename), ', ')
                      FROM pg_tables
                     WHERE schemaname = 'public'
                       AND tablename NOT IN ('__diesel_schema_migrations', 'job_expiry_mark'));
           -- Expiry's mark keeps its one row (a migration refuses its
           -- deletion); it starts over.
           UPDATE job_expiry_mark
              SET expired_to = '-infinity',
                  xid_horizon = pg_snapshot_xmin(pg_current_snapshot())::text::bigint;
         END $$",
    )
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    Ok(())
}

/// Inserts numbered items `0..n` of `tenant` with the same input text.
pub async fn insert_numbered_items(
    conn: &mut AsyncPgConnection,
    tenant: &str,
    n: u64,
    input_text: &str,
) -> Result<(), RepoError> {
    insert_numbered_items_from(conn, tenant, 0, n, input_text).await
}

/// Inserts numbered items `from..from + n` of `tenant` (ids are unique across
/// tenants, so each tenant takes its own range).
pub async fn insert_numbered_items_from(
    conn: &mut AsyncPgConnection,
    tenant: &str,
    from: u64,
    n: u64,
    input_text: &str,
) -> Result<(), RepoError> {
    diesel::sql_query(
        "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
         SELECT $1, lpad(($2 + g)::text, 26, '0'), $3, $4, 'bench/' || g
           FROM generate_series(0, $5 - 1) AS g",
    )
    .bind::<Text, _>(tenant)
    .bind::<BigInt, _>((ITEM_BASE + from) as i64)
    .bind::<Text, _>(input_text)
    .bind::<Text, _>(idemstage::ids::input_hash_of(input_text.as_bytes()))
    .bind::<BigInt, _>(n as i64)
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    Ok(())
}

/// A succeeded run of `stage` for each numbered item `0..n`. Inserted running and
/// then marked success, so the attempt history (a trigger) looks like a real run's.
pub async fn insert_succeeded_runs(
    conn: &mut AsyncPgConnection,
    tenant: &str,
    n: u64,
    stage: &str,
    input_hash: &str,
) -> Result<(), RepoError> {
    diesel::sql_query(
        "INSERT INTO stage_runs (id, tenant_id, item_id, stage, status, attempts,
                                    max_attempts, input_hash, worker_id, started_at,
                                    lease_expires_at)
         SELECT '7' || lpad(g::text, 25, '0'), $1, lpad(($2 + g)::text, 26, '0'), $3,
                'running', 1, 5, $4, 'bench-fixture', now(), now()
           FROM generate_series(0, $5 - 1) AS g",
    )
    .bind::<Text, _>(tenant)
    .bind::<BigInt, _>(ITEM_BASE as i64)
    .bind::<Text, _>(stage)
    .bind::<Text, _>(input_hash)
    .bind::<BigInt, _>(n as i64)
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    diesel::sql_query(
        "UPDATE stage_runs SET status = 'success', success_attempt = attempts, finished_at = now()
          WHERE worker_id = 'bench-fixture' AND status = 'running'",
    )
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    Ok(())
}

/// `VACUUM ANALYZE` of the given tables (fresh statistics and visibility map after a
/// bulk load, as a long-running system would have them).
pub async fn vacuum_analyze(
    conn: &mut AsyncPgConnection,
    tables: &[&str],
) -> Result<(), RepoError> {
    for t in tables {
        // Table names come from our own code, never from input.
        diesel::sql_query(format!("VACUUM ANALYZE {t}"))
            .execute(conn)
            .await
            .map_err(map_diesel_error)?;
    }
    Ok(())
}

/// ANALYZE of `tables` (statistics only: no vacuum, which would wait for
/// nothing here but takes longer on a table being written).
pub async fn analyze(conn: &mut AsyncPgConnection, tables: &[&str]) -> Result<(), RepoError> {
    // Table names come from our own code, never from input.
    diesel::sql_query(format!("ANALYZE {}", tables.join(", ")))
        .execute(conn)
        .await
        .map_err(map_diesel_error)?;
    Ok(())
}

/// Jobs of `queue`, optionally only those in `state`.
pub async fn count_jobs(
    conn: &mut AsyncPgConnection,
    queue: &str,
    state: Option<&str>,
) -> Result<i64, RepoError> {
    let row: Count = diesel::sql_query(
        "SELECT count(*) AS n FROM job_states WHERE queue = $1 AND ($2::text IS NULL OR state = $2)",
    )
    .bind::<Text, _>(queue)
    .bind::<diesel::sql_types::Nullable<Text>, _>(state)
    .get_result(conn)
    .await
    .map_err(map_diesel_error)?;
    Ok(row.n)
}

/// The `n` of a query `SELECT count(*) AS n ...` (no binds).
pub async fn count_rows(conn: &mut AsyncPgConnection, sql: &str) -> Result<i64, RepoError> {
    let row: Count = diesel::sql_query(sql)
        .get_result(conn)
        .await
        .map_err(map_diesel_error)?;
    Ok(row.n)
}

#[cfg(test)]
mod tests {
    use diesel::sql_types::{BigInt, Text};
    use diesel::QueryableByName;
    use diesel_async::RunQueryDsl;
    use idemstage::{ids::ItemId, ids::TenantId, stage::InputChangePolicy};

    #[derive(QueryableByName)]
    struct Table {
        #[diesel(sql_type = Text)]
        name: String,
    }

    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }

    /// `reset` used to name its tables, and a table added later (the kept inputs
    /// of the baseline migration, the open items of the baseline migration) made it fail on its foreign key:
    /// the second `cargo xtask demo` on a cluster left running, and every bench.
    #[tokio::test]
    async fn reset_empties_every_table_of_the_schema() {
        let db = idemstage_harness::example::db().await;
        let mut conn = db.conn().await;
        let pipeline = idemstage_example::pipeline(idemstage_example::Chaos::default());
        let tenant = TenantId::parse("t1").unwrap();
        let item = ItemId::new();
        for text in ["10 Stk Schrauben", "20 Stk Schrauben"] {
            idemstage::items::start_in(
                &mut conn,
                &tenant,
                &item,
                text,
                InputChangePolicy::Rerun,
                |hash| idemstage::pipeline::first_job(&pipeline, tenant.clone(), item, hash.into()),
            )
            .await
            .unwrap();
        }
        super::reset(&mut conn).await.unwrap();
        let tables: Vec<Table> = diesel::sql_query(
            "SELECT tablename::text AS name FROM pg_tables
              WHERE schemaname = 'public' AND tablename <> '__diesel_schema_migrations'",
        )
        .load(&mut conn)
        .await
        .unwrap();
        assert!(tables.iter().any(|t| t.name == "item_inputs"));
        for t in tables {
            let n: N = diesel::sql_query(format!("SELECT count(*) AS n FROM \"{}\"", t.name))
                .get_result(&mut conn)
                .await
                .unwrap();
            // job_expiry_mark holds one row by design, started over.
            let left = i64::from(t.name == "job_expiry_mark");
            assert_eq!(n.n, left, "{} not emptied", t.name);
        }
    }
}
