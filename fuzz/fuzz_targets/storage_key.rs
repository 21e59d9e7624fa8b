//! The key escaper, `storage_key_part`: every request-derived key part goes
//! through it before it reaches Redis or memory.
//!
//! Checked: at most 128 bytes of printable ASCII without `{` or `}` (so no
//! request byte can change a key's structure or its Redis Cluster slot);
//! either `#` and 32 hex digits (hashed) or an escaped form that decodes back
//! to the input (so two different inputs never share a key, up to XXH3
//! collisions); `storage_key_part_into` agrees.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tiered_ratelimit::key::{storage_key_part, storage_key_part_into, MAX_KEY_PART};

fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).expect("ascii");
            out.push(u8::from_str_radix(hex, 16).expect("hex escape"));
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let part = storage_key_part(data);
    assert!(part.len() <= MAX_KEY_PART, "{} bytes", part.len());
    assert!(
        part.bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}'),
        "{part:?}"
    );
    if let Some(hash) = part.strip_prefix('#') {
        assert_eq!(hash.len(), 32);
        assert!(hash
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    } else {
        assert_eq!(unescape(&part), data);
    }
    let mut appended = String::from("rl:tier:");
    storage_key_part_into(&mut appended, data);
    assert_eq!(appended.strip_prefix("rl:tier:"), Some(part.as_str()));
    // Split the input in two: different halves never share a key part.
    let mid = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let (a, b) = data.split_at(mid);
    if a != b {
        assert_ne!(storage_key_part(a), storage_key_part(b));
    }
});
