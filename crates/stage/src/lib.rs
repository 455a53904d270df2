//! The Stage trait and the executor.
