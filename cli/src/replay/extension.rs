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

/// Where a string extension of the replayed request is: in the request's
/// extensions, or absent from them with its buffer kept here for the next
/// insert. Knowing it spares a lookup (a remove) on each line without the
/// value, the common case: most lines have no plan, most no user id.
#[derive(Debug)]
pub(super) enum Held {
    /// In the request's extensions.
    InExtensions,
    /// Not in them; the buffer of the last one removed.
    Absent(String),
}

impl Default for Held {
    fn default() -> Self {
        Held::Absent(String::new())
    }
}

/// Sets extension `T` to `value` (removed when `None`) in place where it
/// exists: an insert boxes its value, so a removed one's buffer is kept in
/// `held` for the next insert. `held` says where `T` is: only this function
/// adds or removes `T`.
pub(super) fn set_string_extension<T: StringExtension>(
    ext: &mut http::Extensions,
    value: Option<&[u8]>,
    held: &mut Held,
) {
    match (value, &mut *held) {
        (Some(v), Held::InExtensions) => match ext.get_mut::<T>() {
            Some(t) => set_lossy(t.string(), v),
            None => {
                let mut s = String::new();
                set_lossy(&mut s, v);
                ext.insert(T::wrap(s));
            }
        },
        (Some(v), Held::Absent(spare)) => {
            let mut s = std::mem::take(spare);
            set_lossy(&mut s, v);
            ext.insert(T::wrap(s));
            *held = Held::InExtensions;
        }
        (None, Held::InExtensions) => {
            let spare = ext.remove::<T>().map(T::unwrap).unwrap_or_default();
            *held = Held::Absent(spare);
        }
        (None, Held::Absent(_)) => {}
    }
}

/// `s` becomes `bytes` as `String::from_utf8_lossy` reads them, reusing its
/// buffer.
fn set_lossy(s: &mut String, bytes: &[u8]) {
    s.clear();
    s.push_str(&String::from_utf8_lossy(bytes));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The extension follows the values line after line, whatever the
    /// sequence of present and absent values, and `held` says where it is.
    #[test]
    fn follows_present_and_absent_values() {
        let mut ext = http::Extensions::new();
        let mut held = Held::default();
        let values: [Option<&[u8]>; 8] = [
            None,
            Some(b"alice"),
            Some(b"bob"),
            None,
            None,
            Some(b"carol\xff"),
            None,
            Some(b"dave"),
        ];
        for v in values {
            set_string_extension::<UserId>(&mut ext, v, &mut held);
            let want = v.map(|b| String::from_utf8_lossy(b).into_owned());
            assert_eq!(ext.get::<UserId>().map(|u| u.0.clone()), want);
            assert_eq!(matches!(held, Held::InExtensions), v.is_some());
            assert!(ext.get::<Plan>().is_none());
        }
    }
}
