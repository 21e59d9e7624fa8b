//! Small shared helpers: rate-limited logging and serde helpers.

pub(crate) mod de;
pub(crate) mod throttle;
