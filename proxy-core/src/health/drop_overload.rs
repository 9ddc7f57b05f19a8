//! `ClusterLoadAssignment.policy.drop_overloads` as Envoy 1.40 takes it
//! (`ClusterImplBase::parseDropOverloadConfig`): at most one category, whose `drop_percentage`
//! is a fraction of at most 1 over a denominator of 100, 10,000 or 1,000,000, kept here exactly
//! in parts per million. Envoy's runtime cap `load_balancing_policy.drop_overload_limit`
//! (0 to 100 percent, default 100) can only lower the fraction; this daemon has no runtime, so
//! the default applies and the fraction is the assignment's.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Parts per million of everything.
pub const PER_MILLION: u32 = 1_000_000;

/// The share of requests (proxy path) or connects (kernel path) that an assignment's
/// `drop_overloads` refuses, in parts per million (0, the default, refuses nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct DropOverload(u32);

impl DropOverload {
    /// Nothing dropped.
    pub const NONE: Self = Self(0);

    /// `numerator` over `denominator`; above 1 is refused with Envoy's text.
    pub fn new(numerator: u32, denominator: Denominator) -> Result<Self, DropOverloadError> {
        let whole = denominator.value();
        if numerator > whole {
            return Err(DropOverloadError::Ratio {
                numerator,
                denominator: whole,
            });
        }
        Ok(Self(numerator * (PER_MILLION / whole)))
    }

    /// The share in parts per million, 0 to [`PER_MILLION`].
    pub fn per_million(self) -> u32 {
        self.0
    }

    /// Whether nothing is dropped.
    pub fn is_none(self) -> bool {
        self.0 == 0
    }

    /// Whether everything is dropped: Envoy's "unconditional" drop (its own body and header).
    pub fn is_unconditional(self) -> bool {
        self.0 == PER_MILLION
    }

    /// Whether the draw `random` (uniform over all `u32`) falls in the dropped share: 0 never
    /// drops and the whole always does, whatever the draw.
    pub fn drops(self, random: u32) -> bool {
        let scaled = (u64::from(random) * u64::from(PER_MILLION)) >> 32;
        self.is_unconditional() || scaled < u64::from(self.0)
    }
}

/// `FractionalPercent.DenominatorType`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Denominator {
    /// 100 (the proto default).
    #[default]
    Hundred,
    /// 10,000.
    TenThousand,
    /// 1,000,000.
    Million,
}

impl Denominator {
    /// The proto enum number: 0, 1 or 2; anything else is `None`.
    pub fn from_proto(number: i32) -> Option<Self> {
        match number {
            0 => Some(Self::Hundred),
            1 => Some(Self::TenThousand),
            2 => Some(Self::Million),
            _ => None,
        }
    }

    /// The denominator's value.
    pub fn value(self) -> u32 {
        match self {
            Self::Hundred => 100,
            Self::TenThousand => 10_000,
            Self::Million => PER_MILLION,
        }
    }
}

/// Why `drop_overloads` is refused: Envoy 1.40's texts, and the proto rule on `category`.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DropOverloadError {
    /// More than one entry (Envoy's words, its grammar included).
    #[error("Cluster drop_overloads config has {count} categories. Envoy only support one.")]
    Categories {
        /// How many entries came.
        count: usize,
    },
    /// A fraction above 1.
    #[error(
        "Cluster drop_overloads config is invalid. drop_ratio={}(Numerator {numerator} / Denominator {denominator}). The valid range is 0~1.",
        ratio(*numerator, *denominator)
    )]
    Ratio {
        /// `drop_percentage.numerator`.
        numerator: u32,
        /// The denominator's value.
        denominator: u32,
    },
    /// An entry with an empty `category` (the proto's `min_len: 1`).
    #[error("drop_overloads[{index}].category: value length must be at least 1 characters")]
    EmptyCategory {
        /// The entry's index.
        index: usize,
    },
}

/// The ratio as Envoy prints it: single precision, shortest form.
#[expect(
    clippy::cast_precision_loss,
    reason = "Envoy divides in single precision; the text shows its value"
)]
fn ratio(numerator: u32, denominator: u32) -> f32 {
    numerator as f32 / denominator as f32
}

/// Envoy's checks over the entries as `(category, numerator, denominator)`, in its order:
/// every category (proto validation), then the count, then the fraction.
pub fn check(entries: &[(&str, u32, Denominator)]) -> Result<DropOverload, DropOverloadError> {
    if let Some(index) = entries
        .iter()
        .position(|(category, ..)| category.is_empty())
    {
        return Err(DropOverloadError::EmptyCategory { index });
    }
    match entries {
        [] => Ok(DropOverload::NONE),
        [(_, numerator, denominator)] => DropOverload::new(*numerator, *denominator),
        more => Err(DropOverloadError::Categories { count: more.len() }),
    }
}

/// `FractionalPercent` in the file's form.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FractionalPercentConfig {
    /// The numerator (default 0).
    #[serde(default)]
    pub numerator: u32,
    /// `HUNDRED` (default), `TEN_THOUSAND` or `MILLION`.
    #[serde(default)]
    pub denominator: Denominator,
}

/// One `Policy.DropOverload` in the file's form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DropOverloadConfig {
    /// Names the drop (Envoy reports it in its load reports); must not be empty.
    pub category: String,
    /// The share of traffic dropped (default 0).
    #[serde(default)]
    pub drop_percentage: FractionalPercentConfig,
}

/// `policy.drop_overloads` in the file's form: at most one entry, checked as Envoy checks it
/// when the file is read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<DropOverloadConfig>", into = "Vec<DropOverloadConfig>")]
pub struct DropOverloadsConfig {
    /// The one entry, if any.
    entry: Option<DropOverloadConfig>,
    /// Its share.
    share: DropOverload,
}

impl DropOverloadsConfig {
    /// Whether no entry was given.
    pub fn is_empty(&self) -> bool {
        self.entry.is_none()
    }

    /// The share dropped.
    pub fn share(&self) -> DropOverload {
        self.share
    }
}

impl TryFrom<Vec<DropOverloadConfig>> for DropOverloadsConfig {
    type Error = DropOverloadError;

    fn try_from(entries: Vec<DropOverloadConfig>) -> Result<Self, Self::Error> {
        let checked: Vec<(&str, u32, Denominator)> = entries
            .iter()
            .map(|e| {
                let p = e.drop_percentage;
                (e.category.as_str(), p.numerator, p.denominator)
            })
            .collect();
        let share = check(&checked)?;
        Ok(Self {
            entry: entries.into_iter().next(),
            share,
        })
    }
}

impl From<DropOverloadsConfig> for Vec<DropOverloadConfig> {
    fn from(config: DropOverloadsConfig) -> Self {
        config.entry.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_denominator_gives_its_exact_share_in_parts_per_million() {
        let share = |n, d| DropOverload::new(n, d).unwrap().per_million();
        assert_eq!(share(25, Denominator::Hundred), 250_000);
        assert_eq!(share(25, Denominator::TenThousand), 2_500);
        assert_eq!(share(25, Denominator::Million), 25);
        assert_eq!(share(100, Denominator::Hundred), PER_MILLION);
        assert_eq!(share(0, Denominator::Million), 0);
    }

    #[test]
    fn envoys_errors_come_in_envoys_order() {
        let hundred = Denominator::Hundred;
        assert_eq!(
            check(&[("a", 150, hundred)]).unwrap_err().to_string(),
            "Cluster drop_overloads config is invalid. drop_ratio=1.5(Numerator 150 / Denominator 100). The valid range is 0~1."
        );
        assert_eq!(
            check(&[("a", 1, hundred), ("b", 1, hundred)])
                .unwrap_err()
                .to_string(),
            "Cluster drop_overloads config has 2 categories. Envoy only support one."
        );
        // The proto rule on every category comes before the count.
        assert_eq!(
            check(&[("a", 1, hundred), ("", 1, hundred)]).unwrap_err(),
            DropOverloadError::EmptyCategory { index: 1 }
        );
        assert_eq!(check(&[]), Ok(DropOverload::NONE));
        let over = DropOverload::new(1_000_001, Denominator::Million).unwrap_err();
        assert!(over.to_string().contains("drop_ratio=1.000001("), "{over}");
    }

    #[test]
    fn none_never_drops_and_the_whole_always_does() {
        let whole = DropOverload::new(100, Denominator::Hundred).unwrap();
        let half = DropOverload::new(50, Denominator::Hundred).unwrap();
        for draw in [0, 1, u32::MAX / 2, u32::MAX] {
            assert!(!DropOverload::NONE.drops(draw));
            assert!(whole.drops(draw));
        }
        assert!(whole.is_unconditional() && !half.is_unconditional());
        // Half the draws: those below 2^31.
        assert!(half.drops(u32::MAX / 2) && !half.drops(u32::MAX / 2 + 1));
        let least = DropOverload::new(1, Denominator::Million).unwrap();
        assert!(least.drops(0) && !least.drops(4_295));
    }

    #[test]
    fn the_files_form_is_checked_when_read_and_shows_as_given() {
        let config: DropOverloadsConfig = serde_norway::from_str(
            "[{ category: throttle, drop_percentage: { numerator: 3, denominator: TEN_THOUSAND } }]",
        )
        .unwrap();
        assert_eq!(config.share().per_million(), 300);
        let shown = serde_json::to_value(&config).unwrap();
        assert_eq!(shown[0]["drop_percentage"]["denominator"], "TEN_THOUSAND");
        let empty: DropOverloadsConfig = serde_norway::from_str("[]").unwrap();
        assert!(empty.is_empty() && empty.share().is_none());
        let two =
            serde_norway::from_str::<DropOverloadsConfig>("[{ category: a }, { category: b }]")
                .unwrap_err()
                .to_string();
        assert!(two.contains("has 2 categories"), "{two}");
    }
}
