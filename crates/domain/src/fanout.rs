//! Fan-out and gather: what a fan-out stage hands on (its children), what a
//! gather stage reads (each child's result), and how a child's item id is
//! derived.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{DomainError, ItemId, StageName};

/// The most children one fan-out may have: their ids, inputs and jobs are
/// written in the fan-out's fenced transaction.
pub const MAX_CHILDREN: usize = 10_000;

/// The longest child key (bytes).
pub const MAX_CHILD_KEY_BYTES: usize = 200;

/// What a fan-out stage hands on: one child per key, each with the input of
/// the stages that run per child. Kept as the fan-out stage's output (a JSON
/// array of `{ "key", "input" }`).
///
/// ```
/// use idemstage::stage::Children;
/// let mut children = Children::new();
/// children.push("pos-1", 3_u32);
/// children.push("pos-2", 5_u32);
/// assert_eq!(children.len(), 2);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Children<C>(pub Vec<Child<C>>);

/// One child of a fan-out: its key (unique within the fan-out: a position's
/// number, a page, a file name) and its input.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Child<C> {
    /// Unique within the fan-out; 1 to [`MAX_CHILD_KEY_BYTES`] bytes.
    pub key: String,
    /// What the child's first stage reads.
    pub input: C,
}

impl<C> Children<C> {
    /// No children (a fan-out of none runs its gather at once).
    pub fn new() -> Self {
        Self(Vec::new())
    }

    /// Adds a child.
    pub fn push(&mut self, key: impl Into<String>, input: C) {
        self.0.push(Child {
            key: key.into(),
            input,
        });
    }

    /// How many children.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<C> Default for Children<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C, K: Into<String>> FromIterator<(K, C)> for Children<C> {
    fn from_iter<T: IntoIterator<Item = (K, C)>>(iter: T) -> Self {
        Self(
            iter.into_iter()
                .map(|(key, input)| Child {
                    key: key.into(),
                    input,
                })
                .collect(),
        )
    }
}

/// What a gather stage reads: every child of the fan-out its run is bound to,
/// in the fan-out's order, each with its result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gathered<O> {
    /// The children, in the order the fan-out listed them.
    pub children: Vec<GatheredChild<O>>,
}

impl<O> Gathered<O> {
    /// The outputs of the children that succeeded, with their keys.
    pub fn succeeded(&self) -> impl Iterator<Item = (&str, &O)> {
        self.children
            .iter()
            .filter_map(|c| c.result.as_ref().ok().map(|o| (c.key.as_str(), o)))
    }

    /// The children that did not succeed, with why.
    pub fn failed(&self) -> impl Iterator<Item = (&str, &ChildFailure)> {
        self.children
            .iter()
            .filter_map(|c| c.result.as_ref().err().map(|e| (c.key.as_str(), e)))
    }
}

/// One child as a gather reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatheredChild<O> {
    /// Its key in the fan-out.
    pub key: String,
    /// Its item.
    pub item: ItemId,
    /// The output of its last stage, or why it has none.
    pub result: Result<O, ChildFailure>,
}

/// Why a child has no output for the gather.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ChildFailure {
    /// A stage of the child ended `dead`.
    Dead {
        /// The stage.
        stage: StageName,
        /// Its last error.
        error: Option<String>,
    },
    /// A stage of the child was cancelled.
    Cancelled {
        /// The stage.
        stage: StageName,
    },
    /// A stage before the child's last one ended the child
    /// (`Done::stop`): its output is not the type the gather reads.
    Stopped {
        /// The stage that stopped.
        stage: StageName,
    },
}

impl std::fmt::Display for ChildFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChildFailure::Dead { stage, error } => match error {
                Some(e) => write!(f, "stage {stage} is dead: {e}"),
                None => write!(f, "stage {stage} is dead"),
            },
            ChildFailure::Cancelled { stage } => write!(f, "stage {stage} was cancelled"),
            ChildFailure::Stopped { stage } => write!(f, "stage {stage} ended the child"),
        }
    }
}

/// What a gather does when a child did not succeed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatherPolicy {
    /// The gather ends `dead` without running its body; its error names the
    /// child. An operator's retry of the child (or of the gather, once the
    /// child succeeded) lets it run.
    #[default]
    FailOnDead,
    /// The gather runs with every child: those that did not succeed as
    /// [`ChildFailure`].
    GatherSucceeded,
}

/// The item id of a fan-out's child: derived from the parent item, the
/// fan-out stage, the attempt whose success fanned out, and the child's key,
/// so that the same fan-out names the same children (a transaction run again
/// writes the same rows), and another attempt (a rerun of the parent) new
/// ones. The SHA-256 of those four, its first 128 bits as a ULID.
pub fn child_item_id(parent: &ItemId, stage: &StageName, attempt: i32, key: &str) -> ItemId {
    let mut hash = Sha256::new();
    for part in [
        parent.to_string().as_bytes(),
        stage.as_str().as_bytes(),
        &attempt.to_be_bytes(),
        key.as_bytes(),
    ] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    let digest = hash.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    ItemId::from_ulid(ulid::Ulid::from_bytes(bytes))
}

/// Checks a fan-out's keys: at most [`MAX_CHILDREN`], each 1 to
/// [`MAX_CHILD_KEY_BYTES`] bytes without a NUL, none twice.
pub fn validate_child_keys<'k>(
    keys: impl ExactSizeIterator<Item = &'k str>,
) -> Result<(), DomainError> {
    if keys.len() > MAX_CHILDREN {
        return Err(DomainError::InvalidFanOut(format!(
            "{} children; a fan-out has at most {MAX_CHILDREN}",
            keys.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for key in keys {
        if key.is_empty() || key.len() > MAX_CHILD_KEY_BYTES || key.contains('\0') {
            return Err(DomainError::InvalidFanOut(format!(
                "child key {key:?}: 1 to {MAX_CHILD_KEY_BYTES} bytes, no NUL"
            )));
        }
        if !seen.insert(key) {
            return Err(DomainError::InvalidFanOut(format!(
                "child key {key:?} appears twice"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_ids_are_stable_and_distinct() {
        let parent = ItemId::new();
        let stage = StageName::parse("extract").unwrap();
        let a = child_item_id(&parent, &stage, 1, "1");
        assert_eq!(a, child_item_id(&parent, &stage, 1, "1"));
        assert_ne!(a, child_item_id(&parent, &stage, 2, "1"));
        assert_ne!(a, child_item_id(&parent, &stage, 1, "2"));
        // Length-prefixed: ("1", "12") and ("11", "2") do not collide.
        assert_eq!(ItemId::parse(&a.to_string()).unwrap(), a);
    }

    #[test]
    fn keys_are_checked() {
        assert!(validate_child_keys(["a", "b"].into_iter()).is_ok());
        assert!(validate_child_keys(["a", "a"].into_iter()).is_err());
        assert!(validate_child_keys([""].into_iter()).is_err());
        let long = "x".repeat(MAX_CHILD_KEY_BYTES + 1);
        assert!(validate_child_keys([long.as_str()].into_iter()).is_err());
    }
}
