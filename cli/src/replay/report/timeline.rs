//! The per-minute counts, and the report's timeline built from them.

use super::{Timeline, TimelinePoint, MINUTE_US};
use crate::replay::time::format_utc_minute;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default)]
pub(super) struct MinuteAcc {
    pub(super) requests: u64,
    pub(super) rejected: u64,
    pub(super) applied: Vec<u64>,
    pub(super) rejected_by: Vec<u64>,
}

impl MinuteAcc {
    pub(super) fn new(tiers: usize) -> Self {
        Self {
            requests: 0,
            rejected: 0,
            applied: vec![0; tiers],
            rejected_by: vec![0; tiers],
        }
    }
    pub(super) fn merge(&mut self, o: &MinuteAcc) {
        self.requests += o.requests;
        self.rejected += o.rejected;
        for (a, b) in self.applied.iter_mut().zip(&o.applied) {
            *a += b;
        }
        for (a, b) in self.rejected_by.iter_mut().zip(&o.rejected_by) {
            *a += b;
        }
    }
}

/// Bucket widths, in minutes, from which the timeline picks the smallest
/// giving at most [`MAX_POINTS`] buckets.
const BUCKETS_MIN: [u64; 10] = [1, 5, 10, 15, 30, 60, 180, 360, 720, 1440];
const MAX_POINTS: u64 = 720;

pub(super) fn timeline(minutes: &BTreeMap<u64, MinuteAcc>, tiers: usize) -> Timeline {
    let (Some(first), Some(last)) = (minutes.keys().next(), minutes.keys().next_back()) else {
        return Timeline::default();
    };
    let span = last - first + 1;
    let width = BUCKETS_MIN
        .iter()
        .copied()
        .find(|w| span.div_ceil(*w) <= MAX_POINTS)
        .unwrap_or(1440);
    let mut buckets: BTreeMap<u64, MinuteAcc> = BTreeMap::new();
    for (m, acc) in minutes {
        let b = m - m % width;
        buckets
            .entry(b)
            .or_insert_with(|| MinuteAcc::new(tiers))
            .merge(acc);
    }
    Timeline {
        bucket_seconds: width * 60,
        points: buckets
            .into_iter()
            .map(|(b, acc)| TimelinePoint {
                start: format_utc_minute(b * MINUTE_US),
                start_epoch: b * 60,
                requests: acc.requests,
                rejected: acc.rejected,
                requests_by_tier: acc.applied,
                rejected_by_tier: acc.rejected_by,
            })
            .collect(),
    }
}
