//! Requests priced by their response (LLM tokens).

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod priced;
mod priced_cluster;
mod priced_combos;
mod priced_headers;
mod priced_json;
mod priced_load;
mod priced_model;
