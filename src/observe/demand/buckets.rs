//! The log-spaced buckets of per-key demand: integer edges, one unit apart
//! up to 50, then each at most 2 % above the one before
//! (`e(b + 1) = max(e(b) + 1, ⌊1.02 × e(b)⌋)`), about 2 100 of them to
//! `u64::MAX`. A value `v` falls in the bucket of the smallest edge `≥ v`,
//! and is reported as that edge: never below `v`, at most 2 % (or one
//! request below 50) above it.

use std::sync::OnceLock;

fn edges() -> &'static [u64] {
    static EDGES: OnceLock<Vec<u64>> = OnceLock::new();
    EDGES.get_or_init(|| {
        let mut e = vec![0u64, 1];
        loop {
            let last = *e.last().unwrap_or(&1);
            if last == u64::MAX {
                break;
            }
            let next = last.saturating_add(last / 50).max(last.saturating_add(1));
            e.push(next);
        }
        e
    })
}

/// The bucket edge that reports `v`: the smallest edge `≥ v`.
#[must_use]
pub(crate) fn top(v: u64) -> u64 {
    let e = edges();
    match e.binary_search(&v) {
        Ok(_) => v,
        Err(i) => e.get(i).copied().unwrap_or(u64::MAX),
    }
}

/// The bucket's index (0 for 0).
#[cfg(test)]
fn index(v: u64) -> usize {
    let e = edges();
    match e.binary_search(&v) {
        Ok(i) | Err(i) => i,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edges_are_at_most_two_percent_apart() {
        let e = edges();
        assert!(e.len() < 2200, "{}", e.len());
        for w in e.windows(2).skip(1) {
            assert!(w[1] > w[0]);
            assert!(
                w[1] - w[0] == 1 || u128::from(w[1]) * 50 <= u128::from(w[0]) * 51,
                "{w:?}"
            );
        }
        for v in [0u64, 1, 2, 49, 50, 51, 99, 1000, 123_456, u64::MAX] {
            let t = top(v);
            assert!(
                t >= v && (t - v <= 1 || t as f64 <= v as f64 * 1.02),
                "{v} → {t}"
            );
            assert_eq!(top(t), t);
            assert_eq!(e[index(v)], t);
        }
    }
}
