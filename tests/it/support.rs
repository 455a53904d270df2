use diesel_async::AsyncPgConnection;
use idemstage_domain::{AnfrageId, TenantId};
use idemstage_persistence::anfragen::register_anfrage;

pub use idemstage_testkit::count;

pub async fn anfrage(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    text: &str,
) -> (AnfrageId, String) {
    let id = AnfrageId::new();
    let registered = register_anfrage(conn, tenant, &id, text).await.unwrap();
    (id, registered.input_sha256().to_owned())
}
