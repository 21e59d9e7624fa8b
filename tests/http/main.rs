//! The HTTP contract: headers, bodies, keys, never-fits, hostile input and the check's span.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod contract;
mod default_format;
mod headers;
mod hostile_inputs;
mod key_errors;
mod never_fits;
mod no_key;
mod readiness;
mod tracing_span;
