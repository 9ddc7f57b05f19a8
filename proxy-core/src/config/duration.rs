//! Envoy JSON durations ("5s", "0.5s") and the "500ms" shorthand, for serde.
//!
//! Envoy's proto3 JSON mapping writes a `google.protobuf.Duration` as decimal seconds with an `s`
//! suffix and up to nine fractional digits. We accept that form and, as a convenience, an integer
//! or decimal number of milliseconds with an `ms` suffix. We always serialize the Envoy form.

use std::{fmt, time::Duration};

use serde::{Deserializer, Serializer, de};

/// Parses "5s", "0.5s", "1.000000001s" or "500ms" into a [`Duration`].
pub fn parse(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Some(ms) = text.strip_suffix("ms") {
        return parse_decimal(ms, 1_000_000);
    }
    parse_decimal(text.strip_suffix('s')?, 1_000_000_000)
}

/// Parses "12" or "12.345" where one whole unit is `unit_nanos` nanoseconds.
fn parse_decimal(number: &str, unit_nanos: u64) -> Option<Duration> {
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() {
        return None;
    }
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(whole) || !all_digits(frac) {
        return None;
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let mut frac_nanos: u64 = 0;
    let mut scale = unit_nanos;
    for digit in frac.bytes() {
        scale /= 10;
        if scale == 0 {
            // More precision than a nanosecond: Envoy rejects more than nine digits too.
            return None;
        }
        frac_nanos += u64::from(digit - b'0') * scale;
    }
    let nanos = u128::from(whole) * u128::from(unit_nanos) + u128::from(frac_nanos);
    let secs = u64::try_from(nanos / 1_000_000_000).ok()?;
    Some(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// Formats a duration the way protobuf's JSON mapping (and so Envoy) does: "5s", "0.500s",
/// "0.000050s", "1.000000001s" (0, 3, 6 or 9 fractional digits, as the precision needs).
pub fn format(duration: Duration) -> String {
    let nanos = duration.subsec_nanos();
    let secs = duration.as_secs();
    if nanos == 0 {
        format!("{secs}s")
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{secs}.{:03}s", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{secs}.{:06}s", nanos / 1_000)
    } else {
        format!("{secs}.{nanos:09}s")
    }
}
/// `#[serde(with = "duration")]` support: serialize.
pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format(*duration))
}

/// `#[serde(with = "duration")]` support: deserialize.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    deserializer.deserialize_str(DurationVisitor)
}

struct DurationVisitor;

impl de::Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration such as \"5s\", \"0.5s\" or \"500ms\"")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Duration, E> {
        parse(text).ok_or_else(|| E::invalid_value(de::Unexpected::Str(text), &self))
    }
}

/// `#[serde(with = "duration::option")]` support for optional durations.
pub mod option {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Serialize `Some(d)` as the Envoy string and `None` as null.
    pub fn serialize<S: Serializer>(
        duration: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match duration {
            Some(d) => super::serialize(d, serializer),
            None => serializer.serialize_none(),
        }
    }

    /// Deserialize an optional Envoy duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        #[derive(serde::Deserialize)]
        struct Wrapped(#[serde(with = "super")] Duration);
        Ok(Option::<Wrapped>::deserialize(deserializer)?.map(|Wrapped(d)| d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_envoy_and_millisecond_forms() {
        assert_eq!(parse("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse("0.5s"), Some(Duration::from_millis(500)));
        assert_eq!(parse(".25s"), Some(Duration::from_millis(250)));
        assert_eq!(parse("1.000000001s"), Some(Duration::new(1, 1)));
        assert_eq!(parse("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse("1.5ms"), Some(Duration::from_micros(1500)));
    }

    #[test]
    fn rejects_malformed_durations() {
        for bad in ["", "5", "s", "-1s", "1.0000000001s", "5 m", "1e3s", "ms"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn formats_like_envoy() {
        assert_eq!(format(Duration::from_secs(5)), "5s");
        assert_eq!(format(Duration::from_millis(500)), "0.500s");
        assert_eq!(format(Duration::new(1, 1)), "1.000000001s");
        assert_eq!(format(Duration::from_micros(50)), "0.000050s");
        assert_eq!(format(Duration::from_millis(1500)), "1.500s");
    }
}
