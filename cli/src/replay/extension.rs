//! The user id and plan extensions of the replayed request, updated in
//! place from line to line.

use tiered_ratelimit::key::UserId;
use tiered_ratelimit::rollout::Plan;

/// A request extension that is a string (the user id, the plan).
pub(super) trait StringExtension: Clone + Send + Sync + 'static {
    fn wrap(s: String) -> Self;
    fn string(&mut self) -> &mut String;
    fn unwrap(self) -> String;
}

impl StringExtension for UserId {
    fn wrap(s: String) -> Self {
        UserId(s)
    }
    fn string(&mut self) -> &mut String {
        &mut self.0
    }
    fn unwrap(self) -> String {
        self.0
    }
}

impl StringExtension for Plan {
    fn wrap(s: String) -> Self {
        Plan(s)
    }
    fn string(&mut self) -> &mut String {
        &mut self.0
    }
    fn unwrap(self) -> String {
        self.0
    }
}

/// Sets extension `T` to `value` (removed when `None`) in place where it
/// exists: an insert boxes its value, so a removed one's buffer is kept in
/// `spare` for the next insert.
pub(super) fn set_string_extension<T: StringExtension>(
    ext: &mut http::Extensions,
    value: Option<&[u8]>,
    spare: &mut Option<String>,
) {
    match value {
        Some(v) => match ext.get_mut::<T>() {
            Some(t) => set_lossy(t.string(), v),
            None => {
                let mut s = spare.take().unwrap_or_default();
                set_lossy(&mut s, v);
                ext.insert(T::wrap(s));
            }
        },
        None => {
            if let Some(t) = ext.remove::<T>() {
                *spare = Some(t.unwrap());
            }
        }
    }
}

/// `s` becomes `bytes` as `String::from_utf8_lossy` reads them, reusing its
/// buffer.
fn set_lossy(s: &mut String, bytes: &[u8]) {
    s.clear();
    s.push_str(&String::from_utf8_lossy(bytes));
}
