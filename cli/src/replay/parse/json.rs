//! JSON lines: the configured (dotted) field paths read in one pass with
//! serde, without building a JSON value.

use super::{bad, put, LineParser, Malformed, Record, Slot, TimeCache};
use crate::replay::time::{self, TimeFormat};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use std::fmt;

impl LineParser {
    pub(super) fn parse_json(&mut self, line: &[u8], rec: &mut Record) -> Result<(), Malformed> {
        let mut out = JsonOut {
            time_format: self.time_format,
            time_cache: &mut self.time_cache,
            rec,
        };
        let mut de = serde_json::Deserializer::from_slice(line);
        MapSeed {
            paths: &self.json,
            out: &mut out,
        }
        .deserialize(&mut de)
        .map_err(|_| bad("not a JSON object"))?;
        de.end()
            .map_err(|_| bad("trailing characters after the JSON object"))?;
        Ok(())
    }
}

struct JsonOut<'r> {
    time_format: TimeFormat,
    time_cache: &'r mut TimeCache,
    rec: &'r mut Record,
}

/// A JSON object, reading the fields in `paths` (relative to this object).
struct MapSeed<'a, 'o, 'r, P> {
    paths: &'a [(P, Slot)],
    out: &'o mut JsonOut<'r>,
}

impl<'de, P: AsRef<str>> DeserializeSeed<'de> for MapSeed<'_, '_, '_, P> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, P: AsRef<str>> Visitor<'de> for MapSeed<'_, '_, '_, P> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(m) = map.next_key_seed(KeySeed { paths: self.paths })? {
            match m {
                KeyMatch::Leaf(slot) => map.next_value_seed(ValueSeed {
                    slot,
                    out: &mut *self.out,
                })?,
                KeyMatch::Prefix { mask, len } => map.next_value_seed(NestedSeed {
                    mask,
                    key_len: len,
                    paths: self.paths,
                    out: &mut *self.out,
                })?,
                KeyMatch::None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// A nested object under a key of `key_len` bytes that is the first segment
/// of the paths in `mask`.
struct NestedSeed<'a, 'o, 'r, P> {
    mask: u64,
    key_len: usize,
    paths: &'a [(P, Slot)],
    out: &'o mut JsonOut<'r>,
}

impl<'de, P: AsRef<str>> DeserializeSeed<'de> for NestedSeed<'_, '_, '_, P> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, P: AsRef<str>> Visitor<'de> for NestedSeed<'_, '_, '_, P> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let len = self.key_len;
        let sub: Vec<(&str, Slot)> = self
            .paths
            .iter()
            .enumerate()
            .filter(|(i, _)| *i < 64 && self.mask & (1 << i) != 0)
            .map(|(_, (p, s))| (&p.as_ref()[len + 1..], *s))
            .collect();
        MapSeed {
            paths: &sub,
            out: self.out,
        }
        .visit_map(map)
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

enum KeyMatch {
    Leaf(Slot),
    /// The key (this many bytes) is the first segment of the dotted paths
    /// in `mask` (by index).
    Prefix {
        mask: u64,
        len: usize,
    },
    None,
}

struct KeySeed<'a, P> {
    paths: &'a [(P, Slot)],
}

impl<'de, P: AsRef<str>> DeserializeSeed<'de> for KeySeed<'_, P> {
    type Value = KeyMatch;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<KeyMatch, D::Error> {
        // As bytes: serde_json then skips the UTF-8 check of every key (a
        // key is only compared with the configured names).
        d.deserialize_bytes(self)
    }
}

impl<'de, P: AsRef<str>> Visitor<'de> for KeySeed<'_, P> {
    type Value = KeyMatch;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E: de::Error>(self, k: &str) -> Result<KeyMatch, E> {
        self.visit_bytes(k.as_bytes())
    }
    fn visit_bytes<E: de::Error>(self, k: &[u8]) -> Result<KeyMatch, E> {
        let mut mask = 0u64;
        for (i, (p, s)) in self.paths.iter().enumerate() {
            let p = p.as_ref().as_bytes();
            // The cheap tests first: most keys differ from most names in
            // length, in the first byte, or in the byte after the prefix.
            if p.len() == k.len() {
                if p.first() == k.first() && p == k {
                    return Ok(KeyMatch::Leaf(*s));
                }
            } else if i < 64 && p.len() > k.len() && p[k.len()] == b'.' && p.starts_with(k) {
                mask |= 1 << i;
            }
        }
        Ok(if mask == 0 {
            KeyMatch::None
        } else {
            KeyMatch::Prefix { mask, len: k.len() }
        })
    }
}

struct ValueSeed<'o, 'r> {
    slot: Slot,
    out: &'o mut JsonOut<'r>,
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a number")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        let JsonOut {
            time_format,
            time_cache,
            rec,
        } = self.out;
        match self.slot {
            Slot::Time => rec.time_us = time_cache.parse(v.as_bytes(), *time_format),
            slot => put(*time_format, slot, v.as_bytes(), rec),
        }
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        let JsonOut {
            time_format, rec, ..
        } = self.out;
        match self.slot {
            Slot::Time => rec.time_us = time::epoch_u64_us(v),
            Slot::Status => rec.status = u16::try_from(v).ok(),
            s => put(*time_format, s, v.to_string().as_bytes(), rec),
        }
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => {
                let JsonOut {
                    time_format, rec, ..
                } = self.out;
                if !matches!(self.slot, Slot::Time | Slot::Status) {
                    put(*time_format, self.slot, v.to_string().as_bytes(), rec);
                }
                Ok(())
            }
        }
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        let JsonOut {
            time_format, rec, ..
        } = self.out;
        match self.slot {
            Slot::Time => rec.time_us = time::epoch_f64_us(v),
            Slot::Status => {}
            s => put(*time_format, s, v.to_string().as_bytes(), rec),
        }
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        let JsonOut {
            time_format, rec, ..
        } = self.out;
        if !matches!(self.slot, Slot::Time | Slot::Status) {
            put(
                *time_format,
                self.slot,
                if v { b"true" } else { b"false" },
                rec,
            );
        }
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}
