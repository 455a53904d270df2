//! Validated identifiers. Anything that does not parse is refused before a row is written.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use ulid::Ulid;

use crate::error::DomainError;

/// A tenant slug: `[a-z0-9][a-z0-9_-]{0,62}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TenantId(String);

impl TenantId {
    /// Validates a tenant slug; `DomainError::InvalidTenantId` otherwise.
    pub fn parse(s: &str) -> Result<Self, DomainError> {
        let bytes = s.as_bytes();
        let valid = !bytes.is_empty()
            && bytes.len() <= 63
            && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
            && bytes[1..]
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_' || *b == b'-');
        if valid {
            Ok(Self(s.to_owned()))
        } else {
            Err(DomainError::InvalidTenantId(truncate_for_error(s)))
        }
    }

    /// The slug.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A stage name: `[a-z][a-z0-9_]{0,62}`. Stages are an open set: a product team
/// defines its own names; they are not an enum of ours.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct StageName(String);

impl StageName {
    /// Validates a stage name; `DomainError::InvalidStageName` otherwise.
    pub fn parse(s: &str) -> Result<Self, DomainError> {
        let bytes = s.as_bytes();
        let valid = !bytes.is_empty()
            && bytes.len() <= 63
            && bytes[0].is_ascii_lowercase()
            && bytes[1..]
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_');
        if valid {
            Ok(Self(s.to_owned()))
        } else {
            Err(DomainError::InvalidStageName(truncate_for_error(s)))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A worker's identity as recorded in runs and attempts (host:pid:random, free text).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerId(pub String);

impl WorkerId {
    /// `host-pid-ulid`: unique per process start, readable in attempt history.
    pub fn generate() -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".to_owned());
        Self(format!("{host}-{}-{}", std::process::id(), Ulid::new()))
    }
    /// The identity as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// ULIDs from one process increase strictly, also within one millisecond
/// (`Ulid::new()` draws the low bits at random), so that id order is creation
/// order: the queue fetches "oldest first" by id.
fn monotonic_ulid() -> Ulid {
    static GENERATOR: std::sync::Mutex<ulid::Generator> =
        std::sync::Mutex::new(ulid::Generator::new());
    let mut generator = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    // Overflow needs 2^80 ids in one millisecond; fall back rather than fail.
    generator.generate().unwrap_or_else(|_| Ulid::new())
}

macro_rules! ulid_id {
    ($(#[$m:meta])* $name:ident, $err:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(Ulid);

        impl $name {
            /// A new id; ids made by one process increase strictly.
            pub fn new() -> Self {
                Self(monotonic_ulid())
            }
            /// Parses a canonical (upper-case) ULID; lower case is refused.
            pub fn parse(s: &str) -> Result<Self, DomainError> {
                // Ulid::from_string accepts lowercase; we store the canonical form only.
                // A first character above '7' would overflow 128 bits.
                if s.len() != 26
                    || !(b'0'..=b'7').contains(&s.as_bytes()[0])
                    || s.bytes().any(|b| b.is_ascii_lowercase())
                {
                    return Err(DomainError::$err(truncate_for_error(s)));
                }
                Ulid::from_string(s)
                    .map(Self)
                    .map_err(|_| DomainError::$err(truncate_for_error(s)))
            }
            /// The id as a [`Ulid`].
            pub fn ulid(&self) -> Ulid {
                self.0
            }
            /// The id of a [`Ulid`] made elsewhere (a derived one).
            pub fn from_ulid(ulid: Ulid) -> Self {
                Self(ulid)
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl FromStr for $name {
            type Err = DomainError;
            fn from_str(s: &str) -> Result<Self, DomainError> {
                Self::parse(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = DomainError;
            fn try_from(s: String) -> Result<Self, DomainError> {
                Self::parse(&s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0.to_string()
            }
        }
    };
}

ulid_id!(
    /// An item id: a ULID chosen by the caller.
    ItemId,
    InvalidItemId
);
ulid_id!(
    /// The id of a `stage_runs` row.
    RunId,
    InvalidRowId
);
ulid_id!(
    /// The id of a `jobs` row.
    JobId,
    InvalidRowId
);
ulid_id!(
    /// The id of a bulk action (`bulk_actions`: a rerun, retry or cancel of
    /// many items, resumable).
    BulkId,
    InvalidRowId
);
ulid_id!(
    /// The id of any other row we create (files, children, audit entries).
    RowId,
    InvalidRowId
);

macro_rules! string_id_impls {
    ($name:ident) => {
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl FromStr for $name {
            type Err = DomainError;
            fn from_str(s: &str) -> Result<Self, DomainError> {
                Self::parse(s)
            }
        }
        impl TryFrom<String> for $name {
            type Error = DomainError;
            fn try_from(s: String) -> Result<Self, DomainError> {
                Self::parse(&s)
            }
        }
        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}
string_id_impls!(TenantId);
string_id_impls!(StageName);

/// Error messages quote bad input, but never a megabyte of it.
fn truncate_for_error(s: &str) -> String {
    const MAX: usize = 80;
    if s.chars().count() <= MAX {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{head:?}… ({} bytes)", s.len())
    }
}

/// The hex SHA-256 of a stage's input, stored as `input_hash` at claim time.
pub fn input_hash_of(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_slugs() {
        for ok in ["t1", "acme-gmbh", "a", "0_x-y", &"a".repeat(63)] {
            assert!(TenantId::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "_a",
            "A",
            "acme gmbh",
            "t1'; DROP TABLE x;--",
            &"a".repeat(64),
            "tä",
        ] {
            assert!(
                matches!(TenantId::parse(bad), Err(DomainError::InvalidTenantId(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn item_ids_are_canonical_ulids() {
        let id = ItemId::new();
        assert_eq!(ItemId::parse(&id.to_string()).unwrap(), id);
        for bad in [
            "",
            "not-a-ulid",
            "01ARZ3NDEKTSV4RRFFQ69G5FA",   // 25 chars
            "01ARZ3NDEKTSV4RRFFQ69G5FAVX", // 27 chars
            "01arz3ndektsv4rrffq69g5fav",  // lowercase is not canonical
            "81ARZ3NDEKTSV4RRFFQ69G5FAV",  // overflows 128 bits
            "01ARZ3NDEKTSV4RRFFQ69G5FAU",  // U is not Crockford base32
        ] {
            assert!(
                matches!(ItemId::parse(bad), Err(DomainError::InvalidItemId(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn ids_of_one_process_increase_strictly() {
        let ids: Vec<RowId> = (0..10_000).map(|_| RowId::new()).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn stage_names() {
        assert!(StageName::parse("intake").is_ok());
        assert!(StageName::parse("ocr_v2").is_ok());
        for bad in ["", "Intake", "1x", "a-b", "a b", &"a".repeat(64)] {
            assert!(StageName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn long_bad_input_is_truncated_in_errors() {
        let huge = "X".repeat(1_000_000);
        let msg = TenantId::parse(&huge).unwrap_err().to_string();
        assert!(msg.len() < 300, "{}", msg.len());
    }
}
