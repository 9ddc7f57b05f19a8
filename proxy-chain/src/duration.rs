//! Go `time.Duration` as Consul writes it: parsed from `"15s"`-style strings (or integer
//! nanoseconds) and printed exactly like Go's `Duration.String()` (`"5s"`, `"1m0s"`, `"1.5ms"`).

use std::fmt::{self, Write as _};

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

const NANOS_PER_MICRO: u64 = 1_000;
const NANOS_PER_MILLI: u64 = 1_000_000;
const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A signed span of nanoseconds with Go's text form; negative values are representable so that
/// validation can reject them with Consul's message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration(pub i64);

impl GoDuration {
    /// Zero, Consul's "unset".
    pub const ZERO: GoDuration = GoDuration(0);

    /// Whole seconds.
    pub const fn from_secs(secs: i64) -> Self {
        GoDuration(secs * NANOS_PER_SEC as i64)
    }

    /// Nanoseconds.
    pub const fn as_nanos(self) -> i64 {
        self.0
    }

    /// True when the duration is zero (Go's `omitempty` test).
    pub const fn is_zero(&self) -> bool {
        self.0 == 0
    }

    /// Parses Go's `time.ParseDuration` syntax: `[-+]?([0-9]*(\.[0-9]*)?unit)+` or a bare `0`.
    pub fn parse(text: &str) -> Result<Self, DurationError> {
        let bad = || DurationError(text.to_owned());
        let (negative, mut rest) = match text.as_bytes().first() {
            Some(b'-') => (true, &text[1..]),
            Some(b'+') => (false, &text[1..]),
            _ => (false, text),
        };
        if rest == "0" {
            return Ok(GoDuration::ZERO);
        }
        if rest.is_empty() {
            return Err(bad());
        }
        let mut total: f64 = 0.0;
        while !rest.is_empty() {
            let number_len = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(bad)?;
            let number = &rest[..number_len];
            if number.is_empty() || number == "." {
                return Err(bad());
            }
            let value: f64 = number.parse().map_err(|_| bad())?;
            rest = &rest[number_len..];
            let unit_len = rest
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(rest.len());
            let unit = unit_nanos(&rest[..unit_len]).ok_or_else(bad)?;
            rest = &rest[unit_len..];
            total += value * unit as f64;
        }
        if total > i64::MAX as f64 {
            return Err(bad());
        }
        let nanos = total.round() as i64;
        Ok(GoDuration(if negative { -nanos } else { nanos }))
    }
}

fn unit_nanos(unit: &str) -> Option<u64> {
    Some(match unit {
        "ns" => 1,
        "us" | "µs" | "μs" => NANOS_PER_MICRO,
        "ms" => NANOS_PER_MILLI,
        "s" => NANOS_PER_SEC,
        "m" => 60 * NANOS_PER_SEC,
        "h" => 3600 * NANOS_PER_SEC,
        _ => return None,
    })
}

/// A duration string Go's `time.ParseDuration` would reject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("time: invalid duration {}", crate::quote::go_quote(.0))]
pub struct DurationError(pub String);

/// Integer part and up to `digits` fractional digits (trailing zeros dropped) of
/// `value / 10^digits`, like Go's `fmtFrac`/`fmtInt` pair.
fn push_scaled(out: &mut String, value: u64, digits: u32) {
    let scale = 10u64.pow(digits);
    out.push_str(&(value / scale).to_string());
    let frac = value % scale;
    if frac != 0 {
        let text = format!("{frac:0width$}", width = digits as usize);
        out.push('.');
        out.push_str(text.trim_end_matches('0'));
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        if self.0 < 0 {
            out.push('-');
        }
        let nanos = self.0.unsigned_abs();
        if nanos == 0 {
            return f.write_str("0s");
        }
        if nanos < NANOS_PER_SEC {
            let (digits, unit) = match nanos {
                n if n < NANOS_PER_MICRO => (0, "ns"),
                n if n < NANOS_PER_MILLI => (3, "µs"),
                _ => (6, "ms"),
            };
            push_scaled(&mut out, nanos, digits);
            out.push_str(unit);
            return f.write_str(&out);
        }
        let secs = nanos / NANOS_PER_SEC;
        let (hours, minutes) = (secs / 3600, (secs / 60) % 60);
        if hours > 0 {
            let _ = write!(out, "{hours}h{minutes}m");
        } else if minutes > 0 {
            let _ = write!(out, "{minutes}m");
        }
        push_scaled(
            &mut out,
            (secs % 60) * NANOS_PER_SEC + nanos % NANOS_PER_SEC,
            9,
        );
        out.push('s');
        f.write_str(&out)
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(DurationVisitor)
    }
}

struct DurationVisitor;

impl de::Visitor<'_> for DurationVisitor {
    type Value = GoDuration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Go duration string such as \"15s\" or an integer of nanoseconds")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<GoDuration, E> {
        GoDuration::parse(v).map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<GoDuration, E> {
        Ok(GoDuration(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<GoDuration, E> {
        i64::try_from(v).map(GoDuration).map_err(E::custom)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<GoDuration, E> {
        Ok(GoDuration(v as i64))
    }
}

/// Serializes a duration as Go's default `encoding/json` form: an integer of nanoseconds (used
/// where Consul does not re-marshal the field as a string).
pub(crate) fn serialize_nanos<S: Serializer>(d: &GoDuration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_i64(d.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_go() {
        let cases = [
            (0, "0s"),
            (1, "1ns"),
            (1_500, "1.5µs"),
            (1_500_000, "1.5ms"),
            (5 * NANOS_PER_SEC as i64, "5s"),
            (33 * NANOS_PER_SEC as i64, "33s"),
            (60 * NANOS_PER_SEC as i64, "1m0s"),
            (90 * NANOS_PER_SEC as i64, "1m30s"),
            (3600 * NANOS_PER_SEC as i64, "1h0m0s"),
            (1_500_000_000, "1.5s"),
            (-2_000_000_000, "-2s"),
        ];
        for (nanos, text) in cases {
            assert_eq!(GoDuration(nanos).to_string(), text, "{nanos}");
        }
    }

    #[test]
    fn parses_like_go() {
        assert_eq!(GoDuration::parse("15s").unwrap(), GoDuration::from_secs(15));
        assert_eq!(
            GoDuration::parse("1m30s").unwrap(),
            GoDuration::from_secs(90)
        );
        assert_eq!(
            GoDuration::parse("1.5s").unwrap(),
            GoDuration(1_500_000_000)
        );
        assert_eq!(GoDuration::parse("-1s").unwrap(), GoDuration::from_secs(-1));
        assert_eq!(GoDuration::parse("0").unwrap(), GoDuration::ZERO);
        assert_eq!(GoDuration::parse("250ms").unwrap(), GoDuration(250_000_000));
        for bad in ["", "5", "s", "1x", "1.s2"] {
            assert!(GoDuration::parse(bad).is_err(), "{bad:?}");
        }
    }
}
