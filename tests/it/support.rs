use diesel::sql_types::BigInt;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{AnfrageId, TenantId};
use idemstage_persistence::anfragen::register_anfrage;

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

pub async fn count(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    diesel::sql_query(format!("SELECT count(*) AS n FROM ({sql}) q"))
        .get_result::<Count>(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .n
}

pub async fn anfrage(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    text: &str,
) -> (AnfrageId, String) {
    let id = AnfrageId::new();
    let registered = register_anfrage(conn, tenant, &id, text).await.unwrap();
    (id, registered.input_sha256().to_owned())
}
