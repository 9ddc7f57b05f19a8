//! Go's `%q` verb (`strconv.Quote`), so error messages quote values exactly as Consul does.

use std::fmt;

/// Display wrapper that renders a string the way Go's `strconv.Quote` does.
pub struct GoQuoted<'a>(&'a str);

/// Quotes `s` like Go's `%q`.
pub fn go_quote(s: &str) -> GoQuoted<'_> {
    GoQuoted(s)
}

impl fmt::Display for GoQuoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write;
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                '\u{7}' => f.write_str("\\a")?,
                '\u{8}' => f.write_str("\\b")?,
                '\u{c}' => f.write_str("\\f")?,
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                '\u{b}' => f.write_str("\\v")?,
                c if (c as u32) < 0x20 || c == '\u{7f}' => write!(f, "\\x{:02x}", c as u32)?,
                c if c.is_control() && (c as u32) <= 0xffff => write!(f, "\\u{:04x}", c as u32)?,
                c if c.is_control() => write!(f, "\\U{:08x}", c as u32)?,
                c => f.write_char(c)?,
            }
        }
        f.write_char('"')
    }
}

#[cfg(test)]
mod tests {
    use super::go_quote;

    #[test]
    fn quotes_like_go() {
        assert_eq!(go_quote("v1").to_string(), "\"v1\"");
        assert_eq!(go_quote("a\"b\\c\n").to_string(), "\"a\\\"b\\\\c\\n\"");
        assert_eq!(go_quote("\u{1b}").to_string(), "\"\\x1b\"");
        assert_eq!(go_quote("µs").to_string(), "\"µs\"");
    }
}
