//! `[denylist]`: an [`AccessList`] and the status its clients get.
//! (`[allowlist]` is an [`AccessList`] alone.)

use crate::rollout::{AccessList, DenyStatus};
use crate::util::de::FieldIn;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// The `[denylist]` table: the fields of `[allowlist]` (`ips`, `api_keys`,
/// `api_key_header`, `users`) and `status`, what the builder's
/// [`denylist`](crate::RateLimitLayerBuilder::denylist) takes.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct DenylistPolicy {
    /// The clients refused: `ips` (CIDRs or addresses), `api_keys` (read
    /// from `api_key_header`, default `x-api-key`) and `users`.
    pub list: AccessList,
    /// `status`: `403` (the default) or `429`.
    pub status: DenyStatus,
}

/// [`AccessList::FIELDS`] and `status`.
const FIELDS: [&str; 5] = {
    let mut fields = ["status"; 5];
    let mut i = 0;
    while i < AccessList::FIELDS.len() {
        fields[i] = AccessList::FIELDS[i];
        i += 1;
    }
    fields
};

impl<'de> Deserialize<'de> for DenylistPolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = DenylistPolicy;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table of ips, api_keys, api_key_header, users and status")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<DenylistPolicy, A::Error> {
                let mut deny = DenylistPolicy::default();
                while let Some(field) = map.next_key_seed(FieldIn(&FIELDS))? {
                    match field {
                        "status" => deny.status = map.next_value()?,
                        list_field => deny.list = deny.list.read_field(list_field, &mut map)?,
                    }
                }
                Ok(deny)
            }
        }
        d.deserialize_struct("DenylistPolicy", &FIELDS, V)
    }
}
