//! HTML escaping for the admin page and its chart.

use std::fmt;

/// HTML-escapes its contents when displayed.
pub(super) struct Esc<'a>(pub(super) &'a str);

impl fmt::Display for Esc<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = 0;
        for (i, c) in self.0.char_indices() {
            let rep = match c {
                '&' => "&amp;",
                '<' => "&lt;",
                '>' => "&gt;",
                '"' => "&quot;",
                '\'' => "&#39;",
                _ => continue,
            };
            f.write_str(&self.0[last..i])?;
            f.write_str(rep)?;
            last = i + c.len_utf8();
        }
        f.write_str(&self.0[last..])
    }
}
