//! Concurrency slots: limits, release on every path, renewal.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod concurrency;
mod concurrency_release;
