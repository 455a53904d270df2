use diesel_async::AsyncPgConnection;
use idemstage_domain::{ItemId, TenantId};
use idemstage_persistence::items::register_item;

pub use idemstage_testkit::count;

pub async fn item(conn: &mut AsyncPgConnection, tenant: &TenantId, text: &str) -> (ItemId, String) {
    let id = ItemId::new();
    let registered = register_item(conn, tenant, &id, text).await.unwrap();
    (id, registered.input_sha256().to_owned())
}
