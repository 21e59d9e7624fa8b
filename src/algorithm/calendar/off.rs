//! Without the `calendar` feature: no tier has a calendar, and a policy
//! file's calendar `period` is refused naming the feature
//! (`policy::calendar_of`). [`Calendar`] stands in for the real type in the
//! crate's own fields (`Option<Calendar>`, always `None`): it has no values,
//! so the code that reads them compiles unchanged and never runs.

use super::CalendarPeriod;

/// No calendar can exist without the `calendar` feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Calendar {}

impl Calendar {
    pub(crate) fn period(&self) -> CalendarPeriod {
        match *self {}
    }

    // Read by the descriptor front door's rules only.
    #[cfg_attr(not(feature = "descriptor"), allow(dead_code))]
    pub(crate) fn longest_us(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn bounds_around(&self, _now_us: u64) -> Option<[u64; 3]> {
        match *self {}
    }
}
