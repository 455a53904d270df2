//! Executor tests.
