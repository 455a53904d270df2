//! # invoice-pipeline
//!
//! A team's invoice pipeline on idemstage, `parse → vendor → book`, each stage
//! handing a typed value to the next:
//!
//! - [`Parse`] reads the item's input text (an invoice as `key: value` lines,
//!   see [`parse_invoice`]) and hands on the [`ParsedInvoice`].
//! - [`Vendor`] reads that invoice, asks the [`VendorDirectory`] (a stand-in for
//!   a paid service) about its vendor in `prepare`, finds or creates the vendor's
//!   row (insert-or-get on the normalized name; a `BIGSERIAL` id), and hands on
//!   [`Vendored`]: the vendor id with the invoice.
//! - [`Book`] reads that and writes the invoice and its lines (child rows,
//!   replaced as a whole).
//!
//! A stage reads exactly the output of the upstream attempt its run is bound to,
//! and the directory's answer is checkpointed: a vendor commit that fails is
//! retried without paying for the call again.
#![warn(missing_docs)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use diesel::prelude::*;
use idemstage::diesel_async::RunQueryDsl;
use idemstage::diesel_migrations::EmbeddedMigrations;
use idemstage::prelude::*;
use idemstage::serde_json::json;
use serde::{Deserialize, Serialize};

/// This pipeline's migrations (`vendors`, `invoices`, `invoice_lines`), run after
/// the core's: `idemstage::db::migrate_with(url, vec![MIGRATIONS])`.
pub const MIGRATIONS: EmbeddedMigrations = idemstage::embed_migrations!("migrations");

/// The Diesel schema of the tables in `migrations/`.
#[allow(missing_docs)]
pub mod schema {
    diesel::table! {
        vendors (id) {
            id -> Int8,
            tenant_id -> Text,
            name_key -> Text,
            name -> Text,
            tax_id -> Text,
            created_at -> Timestamptz,
        }
    }

    diesel::table! {
        invoices (tenant_id, item_id) {
            tenant_id -> Text,
            item_id -> Text,
            vendor_id -> Int8,
            number -> Text,
            total_cents -> Int8,
            booked_at -> Timestamptz,
        }
    }

    diesel::table! {
        invoice_lines (tenant_id, item_id, position) {
            tenant_id -> Text,
            item_id -> Text,
            position -> Int4,
            description -> Text,
            quantity -> Int8,
            unit_price_cents -> Int8,
        }
    }

    diesel::allow_tables_to_appear_in_same_query!(vendors, invoices, invoice_lines);
}

use schema::{invoice_lines, invoices, vendors};

/// One line of an invoice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// What was bought.
    pub description: String,
    /// How many.
    pub quantity: i64,
    /// The price of one, in cents.
    pub unit_price_cents: i64,
}

/// What `parse` hands on: the invoice as the input states it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParsedInvoice {
    /// The vendor's name as written.
    pub vendor: String,
    /// The invoice number.
    pub number: String,
    /// The lines, in order.
    pub lines: Vec<Line>,
}

impl ParsedInvoice {
    /// The sum of the lines, in cents.
    pub fn total_cents(&self) -> i64 {
        self.lines
            .iter()
            .map(|l| l.quantity * l.unit_price_cents)
            .sum()
    }
}

/// What `vendor` hands on: the vendor's id (found or created), with the invoice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vendored {
    /// The `vendors.id` of the invoice's vendor, in the item's tenant.
    pub vendor_id: i64,
    /// The invoice `parse` read.
    pub invoice: ParsedInvoice,
}

/// What `book` hands on: what it booked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Booked {
    /// The invoice's vendor.
    pub vendor_id: i64,
    /// Its total, in cents.
    pub total_cents: i64,
}

/// Parses an invoice: `vendor: NAME`, `number: NO` and one `line: DESCRIPTION |
/// QUANTITY | UNIT PRICE` per line (price in units with up to two decimals, e.g.
/// `12.50`); blank lines and lines starting with `#` are ignored.
pub fn parse_invoice(text: &str) -> Result<ParsedInvoice, String> {
    let (mut vendor, mut number, mut lines) = (None, None, Vec::new());
    for (n, raw) in text.lines().enumerate().map(|(n, l)| (n + 1, l.trim())) {
        if raw.is_empty() || raw.starts_with('#') {
            continue;
        }
        let (key, value) = raw
            .split_once(':')
            .ok_or_else(|| format!("line {n}: expected `key: value`"))?;
        let value = value.trim();
        match key.trim() {
            "vendor" if !value.is_empty() => vendor = Some(value.to_owned()),
            "number" if !value.is_empty() => number = Some(value.to_owned()),
            "line" => {
                let parts: Vec<&str> = value.split('|').map(str::trim).collect();
                let [description, quantity, price] = parts[..] else {
                    return Err(format!(
                        "line {n}: expected `description | quantity | price`"
                    ));
                };
                lines.push(Line {
                    description: description.to_owned(),
                    quantity: quantity
                        .parse()
                        .map_err(|_| format!("line {n}: bad quantity {quantity:?}"))?,
                    unit_price_cents: cents(price)
                        .ok_or_else(|| format!("line {n}: bad price {price:?}"))?,
                });
            }
            other => return Err(format!("line {n}: unknown or empty field {other:?}")),
        }
    }
    let invoice = ParsedInvoice {
        vendor: vendor.ok_or("no vendor")?,
        number: number.ok_or("no number")?,
        lines,
    };
    if invoice.lines.is_empty() {
        return Err("no lines".into());
    }
    Ok(invoice)
}

/// `"12.5"` → 1250 cents.
fn cents(price: &str) -> Option<i64> {
    let (units, fraction) = price.split_once('.').unwrap_or((price, ""));
    if fraction.len() > 2 || !fraction.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let units: i64 = units.parse().ok()?;
    let fraction: i64 = format!("{fraction:0<2}").parse().ok()?;
    (units >= 0).then_some(units * 100 + fraction)
}

/// The stage `parse`: the input text into a [`ParsedInvoice`].
pub struct Parse;

#[async_trait]
impl Stage for Parse {
    const NAME: &'static str = "parse";
    type Input = String;
    type Prepared = ParsedInvoice;
    type Output = ParsedInvoice;

    /// A new text for the same item is parsed again, and what follows runs
    /// again on it.
    fn policy(&self) -> StagePolicy {
        StagePolicy::default().with_on_input_change(InputChangePolicy::Rerun)
    }

    async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<ParsedInvoice, StageError> {
        parse_invoice(ctx.input()).map_err(|e| StageError::Permanent(e.into()))
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _text: &String,
        invoice: &ParsedInvoice,
    ) -> Result<Done<ParsedInvoice>, StageError> {
        let item = tx.token().item.to_string();
        tx.audit(
            &item,
            "invoice.parsed",
            json!({ "number": invoice.number, "lines": invoice.lines.len() }),
        )
        .await?;
        Ok(Done::next(invoice.clone()))
    }
}

/// What the vendor directory knows about a vendor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VendorInfo {
    /// The name the vendor is filed under (the key of its row).
    pub name_key: String,
    /// Its tax id.
    pub tax_id: String,
}

/// A stand-in for a paid vendor service: deterministic, and it counts its calls.
#[derive(Debug, Default)]
pub struct VendorDirectory {
    calls: AtomicUsize,
}

impl VendorDirectory {
    /// One (paid) lookup of `name`.
    pub async fn lookup(&self, name: &str) -> VendorInfo {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let name_key = name
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_lowercase();
        let digits: u32 = name_key.bytes().map(u32::from).sum();
        VendorInfo {
            tax_id: format!("DE{:09}", digits % 1_000_000_000),
            name_key,
        }
    }

    /// The lookups paid so far.
    pub fn calls(&self) -> usize {
        AtomicUsize::load(&self.calls, Ordering::SeqCst)
    }
}

/// The stage `vendor`: the invoice's vendor found or created.
pub struct Vendor {
    directory: Arc<VendorDirectory>,
}

impl Vendor {
    /// Asks `directory` about the vendors.
    pub fn new(directory: Arc<VendorDirectory>) -> Self {
        Self { directory }
    }
}

#[async_trait]
impl Stage for Vendor {
    const NAME: &'static str = "vendor";
    type Input = ParsedInvoice;
    type Prepared = VendorInfo;
    type Output = Vendored;

    /// The paid call, outside any transaction; checkpointed, so the next attempt
    /// of this run on the same invoice does not pay for it again.
    async fn prepare(
        &self,
        ctx: &PrepareContext<'_, ParsedInvoice>,
    ) -> Result<VendorInfo, StageError> {
        Ok(self.directory.lookup(&ctx.input().vendor).await)
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        invoice: &ParsedInvoice,
        info: &VendorInfo,
    ) -> Result<Done<Vendored>, StageError> {
        let tenant = tx.token().tenant.to_string();
        let found = tx
            .insert_or_get_audited(
                &format!("vendor {:?}", info.name_key),
                ("vendor.created", "vendor.reused"),
                json!({ "name": invoice.vendor, "tax_id": info.tax_id }),
                || {
                    diesel::insert_into(vendors::table)
                        .values((
                            vendors::tenant_id.eq(tenant.clone()),
                            vendors::name_key.eq(info.name_key.clone()),
                            vendors::name.eq(invoice.vendor.clone()),
                            vendors::tax_id.eq(info.tax_id.clone()),
                        ))
                        .on_conflict((vendors::tenant_id, vendors::name_key))
                        .do_nothing()
                        .returning(vendors::id)
                },
                || {
                    vendors::table
                        .filter(vendors::tenant_id.eq(tenant.clone()))
                        .filter(vendors::name_key.eq(info.name_key.clone()))
                        .select(vendors::id)
                },
            )
            .await?;
        Ok(Done::next(Vendored {
            vendor_id: found.id,
            invoice: invoice.clone(),
        }))
    }
}

/// The stage `book`: the invoice and its lines, for the vendor found.
pub struct Book;

#[async_trait]
impl Stage for Book {
    const NAME: &'static str = "book";
    type Input = Vendored;
    type Prepared = ();
    type Output = Booked;

    async fn prepare(&self, _: &PrepareContext<'_, Vendored>) -> Result<(), StageError> {
        Ok(())
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &Vendored,
        _: &(),
    ) -> Result<Done<Booked>, StageError> {
        let (tenant, item) = (tx.token().tenant.to_string(), tx.token().item.to_string());
        let total_cents = input.invoice.total_cents();
        // Written idempotently: a rerun (new input) books over the old invoice.
        diesel::insert_into(invoices::table)
            .values((
                invoices::tenant_id.eq(&tenant),
                invoices::item_id.eq(&item),
                invoices::vendor_id.eq(input.vendor_id),
                invoices::number.eq(&input.invoice.number),
                invoices::total_cents.eq(total_cents),
            ))
            .on_conflict((invoices::tenant_id, invoices::item_id))
            .do_update()
            .set((
                invoices::vendor_id.eq(input.vendor_id),
                invoices::number.eq(&input.invoice.number),
                invoices::total_cents.eq(total_cents),
                invoices::booked_at.eq(diesel::dsl::now),
            ))
            .execute(tx.conn())
            .await?;
        let lines: Vec<_> = input
            .invoice
            .lines
            .iter()
            .zip(1..)
            .map(|(line, position): (&Line, i32)| {
                (
                    invoice_lines::tenant_id.eq(&tenant),
                    invoice_lines::item_id.eq(&item),
                    invoice_lines::position.eq(position),
                    invoice_lines::description.eq(&line.description),
                    invoice_lines::quantity.eq(line.quantity),
                    invoice_lines::unit_price_cents.eq(line.unit_price_cents),
                )
            })
            .collect();
        tx.replace_children(
            diesel::delete(
                invoice_lines::table
                    .filter(invoice_lines::tenant_id.eq(&tenant))
                    .filter(invoice_lines::item_id.eq(&item)),
            ),
            diesel::insert_into(invoice_lines::table).values(lines),
        )
        .await?;
        Ok(Done::next(Booked {
            vendor_id: input.vendor_id,
            total_cents,
        }))
    }
}

/// `parse → vendor → book`, with a directory of its own.
pub fn pipeline() -> Pipeline {
    pipeline_with(Arc::new(VendorDirectory::default()))
}

/// `parse → vendor → book`, asking `directory` about vendors.
pub fn pipeline_with(directory: Arc<VendorDirectory>) -> Pipeline {
    Pipeline::builder(Parse)
        .then(Vendor::new(directory))
        .then(Book)
        .build()
        .expect("parse → vendor → book is a valid pipeline")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invoice_parses_with_its_lines_and_total() {
        let invoice = parse_invoice(
            "# an invoice\nvendor: ACME  GmbH\nnumber: R-1\n\nline: Schrauben | 100 | 0.05\nline: Muttern | 3 | 12.5\n",
        )
        .unwrap();
        assert_eq!(invoice.vendor, "ACME  GmbH");
        assert_eq!(invoice.lines.len(), 2);
        assert_eq!(invoice.lines[1].unit_price_cents, 1250);
        assert_eq!(invoice.total_cents(), 500 + 3750);
        assert!(parse_invoice("vendor: x\nnumber: 1").is_err());
        assert!(parse_invoice("vendor: x\nnumber: 1\nline: a | 1 | 1.234").is_err());
        assert!(parse_invoice("number: 1\nline: a | 1 | 1").is_err());
    }
}
