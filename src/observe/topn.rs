//! Top-N blocked and near-limit keys per tier, in this process: a bounded
//! heavy-hitter sketch (Filtered Space-Saving, from the `topk` crate) per
//! tier and hour, the last 24 hours merged on query.
//!
//! Space-Saving keeps `capacity` counters; a key's count is overestimated by
//! at most the smallest counter, reported as `error`. Keys counted here are
//! storage key parts (escaped or hashed, never a raw header), and only on
//! the slow paths (a rejection or a near-limit decision).

use std::collections::VecDeque;
use std::sync::Mutex;
use topk::FilteredSpaceSaving;

/// One key of a top-N answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedKey {
    /// The key part, as stored (escaped, or hashed when long or secret).
    pub key: String,
    /// Cost blocked (or counted near the limit) in the window.
    pub count: u64,
    /// How much `count` may overestimate (0 when exact).
    pub error: u64,
}

/// One hour of one tier: (hour since epoch, blocked, near-limit).
type HourSketch = (
    u64,
    FilteredSpaceSaving<String>,
    FilteredSpaceSaving<String>,
);

/// Hour-bucketed sketches of one tier: blocked and near-limit.
pub(crate) struct TierSketch {
    capacity: usize,
    /// (hour since epoch, blocked, near-limit), newest last, at most 24.
    hours: Mutex<VecDeque<HourSketch>>,
}

/// What a sketch counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Blocked,
    NearLimit,
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
        if hours.back().is_none_or(|(h, _, _)| *h != hour) {
            hours.push_back((
                hour,
                FilteredSpaceSaving::new(self.capacity),
                FilteredSpaceSaving::new(self.capacity),
            ));
            while hours.len() > 24 {
                hours.pop_front();
            }
        }
        if let Some((_, blocked, near)) = hours.back_mut() {
            let sketch = match kind {
                Kind::Blocked => blocked,
                Kind::NearLimit => near,
            };
            sketch.insert(key.to_owned(), count);
        }
    }

    /// The `n` heaviest keys of the last `hours` hours (1-24) before `now_s`.
    pub(crate) fn top(&self, kind: Kind, n: usize, hours_back: u64, now_s: u64) -> Vec<BlockedKey> {
        let first = (now_s / 3600).saturating_sub(hours_back.clamp(1, 24) - 1);
        let hours = self.hours.lock().unwrap_or_else(|e| e.into_inner());
        let mut merged = FilteredSpaceSaving::new(self.capacity);
        for (h, blocked, near) in hours.iter() {
            if *h >= first {
                let s = match kind {
                    Kind::Blocked => blocked,
                    Kind::NearLimit => near,
                };
                // Same capacity everywhere: merging cannot fail.
                let _ = merged.merge(s);
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
}
