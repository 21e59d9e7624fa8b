//! The gRPC front door (feature `grpc`).

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod grpc;
mod priced_grpc;
