//! Configuration and start-up: policy files, the docs' examples, checked builds.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod config;
mod docs_examples;
mod startup;
