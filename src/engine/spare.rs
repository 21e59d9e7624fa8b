//! Storage-key buffers kept from one request to the next, per thread: a
//! check's key is written into a buffer a finished check gave back instead
//! of a new allocation (one per tier per request otherwise).

use crate::backend::TierCheck;
use std::cell::RefCell;

/// Buffers kept per thread, at most.
const MAX_SPARE: usize = 64;
/// Larger buffers (a key part is at most 128 bytes after escaping, plus the
/// prefix) are not worth keeping.
const MAX_CAPACITY: usize = 512;

thread_local! {
    static KEYS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// An empty key buffer: a spare one when there is one.
#[inline]
pub(crate) fn key() -> String {
    KEYS.try_with(|k| k.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Gives the keys of finished checks back (their buffers, emptied).
pub(crate) fn give_back(checks: &mut Vec<TierCheck>) {
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
            if key.capacity() <= MAX_CAPACITY {
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
        }];
        give_back(&mut checks);
        assert!(checks.is_empty());
        let again = super::key();
        assert!(again.is_empty());
        assert_eq!(again.capacity(), cap);
    }
}
