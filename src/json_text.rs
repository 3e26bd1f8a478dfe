//! JSON string literals for the small JSON bodies the crate writes itself (problem
//! details, the health check, the deployment report), with no JSON library.

use std::fmt::Write as _;

/// Appends `s` as a JSON string literal: quotes, backslashes and control characters
/// are escaped, everything else is copied as is.
pub(crate) fn push_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            // Every control char is at most U+009F, so four hex digits fit.
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `s` as a JSON string literal.
pub(crate) fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    push_string(&mut out, s);
    out
}
