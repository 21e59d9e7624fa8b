//! The top-N sketches ([`BlockedKey`] says what they count).

use std::collections::VecDeque;
use std::sync::Mutex;
use topk::FilteredSpaceSaving;

/// One key of a top-N answer.
///
/// Top-N blocked, shadow-limited and near-limit keys per tier, in this
/// process: a bounded heavy-hitter sketch (Filtered Space-Saving, from the
/// `topk` crate) per tier, kind and hour, the last 24 hours merged on query.
/// Blocked keys were refused (429); shadow-limited keys would have been (a
/// tier in shadow mode, or a canary tier not enforced for the key) and got
/// their answer: the two are counted apart.
///
/// Space-Saving keeps `capacity` counters; a key's count is overestimated by
/// at most the smallest counter, reported as `error`. Keys counted here are
/// storage key parts (escaped or hashed, never a raw header), and only on
/// the slow paths (a rejection or a near-limit decision).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedKey {
    /// The key part, as stored (escaped, or hashed when long or secret).
    pub key: String,
    /// Cost blocked (or counted near the limit) in the window.
    pub count: u64,
    /// How much `count` may overestimate (0 when exact).
    pub error: u64,
}

/// One hour of one tier: (hour since epoch, one sketch per [`Kind`], in
/// its order).
type HourSketch = (u64, [FilteredSpaceSaving<String>; 3]);

/// Hour-bucketed sketches of one tier, one per [`Kind`].
pub(crate) struct TierSketch {
    capacity: usize,
    /// (hour since epoch, sketches), newest last, at most 24.
    hours: Mutex<VecDeque<HourSketch>>,
}

/// What a sketch counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Refused by an enforced tier (a 429).
    Blocked,
    /// Allowed with less than a fifth of the limit left.
    NearLimit,
    /// Would have been refused, by a tier not enforced for the key (shadow
    /// mode, or a canary's unenforced keys): the request passed.
    ShadowLimited,
}

impl Kind {
    fn index(self) -> usize {
        match self {
            Kind::Blocked => 0,
            Kind::NearLimit => 1,
            Kind::ShadowLimited => 2,
        }
    }
}

impl TierSketch {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            hours: Mutex::new(VecDeque::new()),
        }
    }

    pub(crate) fn record(&self, kind: Kind, key: &str, count: u64, now_s: u64) {
        let hour = now_s / 3600;
        let mut hours = self.hours.lock().unwrap_or_else(|e| e.into_inner());
        if hours.back().is_none_or(|(h, _)| *h != hour) {
            let capacity = self.capacity;
            hours.push_back((
                hour,
                std::array::from_fn(|_| FilteredSpaceSaving::new(capacity)),
            ));
            while hours.len() > 24 {
                hours.pop_front();
            }
        }
        if let Some((_, sketches)) = hours.back_mut() {
            sketches[kind.index()].insert(key.to_owned(), count);
        }
    }

    /// The `n` heaviest keys of the last `hours` hours (1-24) before `now_s`.
    pub(crate) fn top(&self, kind: Kind, n: usize, hours_back: u64, now_s: u64) -> Vec<BlockedKey> {
        let first = (now_s / 3600).saturating_sub(hours_back.clamp(1, 24) - 1);
        let hours = self.hours.lock().unwrap_or_else(|e| e.into_inner());
        let mut merged = FilteredSpaceSaving::new(self.capacity);
        for (h, sketches) in hours.iter() {
            if *h >= first {
                // Same capacity everywhere: merging cannot fail.
                let _ = merged.merge(&sketches[kind.index()]);
            }
        }
        merged
            .into_sorted_vec()
            .into_iter()
            .take(n)
            .map(|(key, c)| BlockedKey {
                key,
                count: c.estimated_count(),
                error: c.associated_error(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_hitters_match_exact_counts() {
        let s = TierSketch::new(64);
        let now = 1_700_000_000;
        // 5 heavy keys with known counts among 5 000 light ones.
        let heavy = [
            ("a", 900u64),
            ("b", 700),
            ("c", 500),
            ("d", 300),
            ("e", 200),
        ];
        for (k, c) in heavy {
            for _ in 0..c {
                s.record(Kind::Blocked, k, 1, now);
            }
        }
        for i in 0..5_000 {
            s.record(Kind::Blocked, &format!("light{i}"), 1, now);
        }
        let top = s.top(Kind::Blocked, 5, 24, now);
        let keys: Vec<&str> = top.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c", "d", "e"]);
        for (b, (_, exact)) in top.iter().zip(heavy) {
            // The estimate brackets the true count.
            assert!(
                b.count >= exact && b.count - b.error <= exact,
                "{b:?} vs {exact}"
            );
        }
    }

    #[test]
    fn window_selects_hours() {
        let s = TierSketch::new(8);
        let now = 1_700_000_000;
        s.record(Kind::Blocked, "old", 10, now - 7200);
        s.record(Kind::Blocked, "new", 5, now);
        assert_eq!(s.top(Kind::Blocked, 5, 1, now).len(), 1);
        assert_eq!(s.top(Kind::Blocked, 5, 24, now)[0].key, "old");
        assert!(s.top(Kind::NearLimit, 5, 24, now).is_empty());
    }

    #[test]
    fn blocked_and_shadow_limited_are_counted_apart() {
        let s = TierSketch::new(8);
        let now = 1_700_000_000;
        s.record(Kind::Blocked, "refused", 3, now);
        s.record(Kind::ShadowLimited, "passed", 10, now);
        let keys = |kind| -> Vec<(String, u64)> {
            s.top(kind, 5, 1, now)
                .into_iter()
                .map(|b| (b.key, b.count))
                .collect()
        };
        assert_eq!(keys(Kind::Blocked), [("refused".to_owned(), 3)]);
        assert_eq!(keys(Kind::ShadowLimited), [("passed".to_owned(), 10)]);
        assert!(keys(Kind::NearLimit).is_empty());
    }
}
