//! Buffers kept from one request to the next, per thread, instead of new
//! allocations: storage keys (a check's key is written into a buffer a
//! finished check gave back; one allocation per tier per request
//! otherwise), the vector of a request's checks, and the memory backend's
//! verdict (its decisions and charges).

use crate::backend::{TierCheck, Verdict};
use std::cell::RefCell;

/// Buffers kept per thread, at most.
const MAX_SPARE: usize = 64;
/// Larger buffers (a key part is at most 128 bytes after escaping, plus the
/// prefix) are not worth keeping.
const MAX_CAPACITY: usize = 512;

/// Check vectors and verdicts kept per thread, at most (one is in use per
/// request being decided; a memory check gives its verdict back before the
/// next starts).
const MAX_SPARE_VECS: usize = 8;

thread_local! {
    static KEYS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    static CHECKS: RefCell<Vec<Vec<TierCheck>>> = const { RefCell::new(Vec::new()) };
    static VERDICTS: RefCell<Vec<Verdict>> = const { RefCell::new(Vec::new()) };
}

/// An empty key buffer: a spare one when there is one.
#[inline]
pub(crate) fn key() -> String {
    KEYS.try_with(|k| k.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// An empty vector for a request's checks, with room for `n`: a spare one
/// when there is one.
#[inline]
pub(crate) fn checks(n: usize) -> Vec<TierCheck> {
    let mut checks = CHECKS
        .try_with(|c| c.try_borrow_mut().ok().and_then(|mut c| c.pop()))
        .ok()
        .flatten()
        .unwrap_or_default();
    checks.reserve(n);
    checks
}

/// A verdict to fill (its vectors empty): a spare one when there is one.
#[inline]
pub(crate) fn verdict() -> Verdict {
    VERDICTS
        .try_with(|v| v.try_borrow_mut().ok().and_then(|mut v| v.pop()))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Gives a verdict back once its request is decided (its vectors, emptied).
#[inline]
pub(crate) fn give_back_verdict(mut v: Verdict) {
    if v.decisions.capacity() == 0 || v.decisions.capacity() > crate::engine::MAX_TIERS {
        return;
    }
    v.decisions.clear();
    v.charges.clear();
    let _ = VERDICTS.try_with(|spare| {
        if let Ok(mut spare) = spare.try_borrow_mut() {
            if spare.len() < MAX_SPARE_VECS {
                spare.push(v);
            }
        }
    });
}

/// Gives the keys of finished checks back (their buffers, emptied), and the
/// vector that held them.
pub(crate) fn give_back(checks: &mut Vec<TierCheck>) {
    if checks.capacity() == 0 {
        return;
    }
    give_back_keys(checks);
    let mut checks = std::mem::take(checks);
    checks.clear();
    if checks.capacity() > crate::engine::MAX_TIERS {
        return;
    }
    let _ = CHECKS.try_with(|spare| {
        if let Ok(mut spare) = spare.try_borrow_mut() {
            if spare.len() < MAX_SPARE_VECS {
                spare.push(checks);
            }
        }
    });
}

fn give_back_keys(checks: &mut Vec<TierCheck>) {
    if checks.is_empty() {
        return;
    }
    let _ = KEYS.try_with(|k| {
        let Ok(mut spare) = k.try_borrow_mut() else {
            return;
        };
        for c in checks.drain(..) {
            if spare.len() >= MAX_SPARE {
                break;
            }
            let mut key = c.key;
            // An empty key (a candidate's on the memory backend) has no
            // buffer to give.
            if key.capacity() != 0 && key.capacity() <= MAX_CAPACITY {
                key.clear();
                spare.push(key);
            }
        }
    });
}

/// Gives one unused buffer back.
#[inline]
pub(crate) fn give_back_key(mut key: String) {
    if key.capacity() == 0 || key.capacity() > MAX_CAPACITY {
        return;
    }
    key.clear();
    let _ = KEYS.try_with(|k| {
        if let Ok(mut spare) = k.try_borrow_mut() {
            if spare.len() < MAX_SPARE {
                spare.push(key);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Limit, Window};

    #[test]
    fn a_given_back_buffer_is_reused_empty() {
        let mut key = key();
        key.push_str("rl:ip:203.0.113.7");
        let cap = key.capacity();
        let limit = Limit::FixedWindow(Window {
            limit: 1,
            window_us: 1,
        });
        let mut checks = vec![TierCheck {
            key,
            limit,
            cost: 1,
            home: None,
        }];
        give_back(&mut checks);
        assert!(checks.is_empty());
        let again = super::key();
        assert!(again.is_empty());
        assert_eq!(again.capacity(), cap);
    }
}
