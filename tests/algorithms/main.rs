//! The algorithms: model = memory = Redis, their HTTP scenarios, calendar quotas, the penalty box and the stored format.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod algorithms;
mod algorithms_http;
mod calendar;
mod calendar_descriptor;
mod candidates;
mod log_marker;
mod memory_paused_clock;
mod penalty;
mod refunds;
mod state_format;
