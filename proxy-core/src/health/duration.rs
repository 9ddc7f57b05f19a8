//! Durations in Envoy's proto-JSON form: `"5s"`, `"0.25s"`, plus `"1500ms"` for convenience.
//!
//! Envoy's JSON mapping of `google.protobuf.Duration` is a decimal number of seconds followed by
//! `s`. We accept that, and also a whole number of milliseconds followed by `ms`, because humans
//! write it. Serialisation always produces the Envoy form, so `/config_dump` round-trips.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

/// Parses `"<decimal>s"` or `"<integer>ms"` into a [`Duration`].
pub fn parse(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse::<u64>().ok().map(Duration::from_millis);
    }
    let secs = text.strip_suffix('s')?;
    let (whole, frac) = secs.split_once('.').unwrap_or((secs, ""));
    if whole.is_empty() && frac.is_empty() || frac.len() > 9 {
        return None;
    }
    if !whole.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().ok()?
    };
    Some(Duration::new(whole, nanos))
}

/// Formats a [`Duration`] the way Envoy's JSON does: seconds, a fraction only when needed.
pub fn format(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        return format!("{}s", d.as_secs());
    }
    let frac = format!("{:09}", d.subsec_nanos());
    format!("{}.{}s", d.as_secs(), frac.trim_end_matches('0'))
}

/// `#[serde(with = "duration")]` for a required [`Duration`].
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format(*d))
}

/// `#[serde(with = "duration")]` for a required [`Duration`].
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse(&text).ok_or_else(|| {
        D::Error::custom(format!(
            "invalid duration {text:?}: expected \"5s\", \"0.25s\" or \"1500ms\""
        ))
    })
}

/// `#[serde(with = "duration::option")]` for an optional [`Duration`].
pub mod option {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Serialises `None` as `null` and `Some` in Envoy's form.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    /// Accepts `null`, or a duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        #[derive(Deserialize)]
        struct Wrap(#[serde(with = "super")] Duration);
        Ok(Option::<Wrap>::deserialize(d)?.map(|Wrap(d)| d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_envoy_and_millisecond_forms() {
        assert_eq!(parse("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse("0.25s"), Some(Duration::from_millis(250)));
        assert_eq!(parse("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse(".5s"), Some(Duration::from_millis(500)));
        assert_eq!(parse("1500ms"), Some(Duration::from_millis(1500)));
        for bad in ["", "s", "5", "-1s", "1.5ms", "abc", "1.0000000001s"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn formats_like_envoy() {
        assert_eq!(format(Duration::from_secs(60)), "60s");
        assert_eq!(format(Duration::from_millis(250)), "0.25s");
        assert_eq!(format(Duration::from_millis(1500)), "1.5s");
    }
}
