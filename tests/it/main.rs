//! Workspace-level tests: the seed's pattern against our corrections, and a product
//! team's own pipeline defined outside our crates.

mod seed_corrections;
mod support;
