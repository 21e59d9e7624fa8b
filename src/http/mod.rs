//! The HTTP front door: the tower [`Layer`](tower_layer::Layer) and its
//! builder (`layer/`), the service and its response future, the request's
//! [`Facts`](crate::engine::Facts) (`front.rs`), the HTTP [`Tier`](tier::Tier),
//! the response body that carries a request's concurrency slots and priced
//! reservations (`priced.rs`: [`Tier::priced`](tier::Tier::priced)), and the
//! gRPC form of a rejection (feature `grpc`).

pub(crate) mod body;
pub(crate) mod front;
pub(crate) mod future;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;
pub(crate) mod json_body;
pub(crate) mod layer;
pub mod priced;
pub(crate) mod service;
pub(crate) mod tier;
