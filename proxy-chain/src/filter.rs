//! Subset `Filter` expressions: the subset of go-bexpr that Consul users write for service
//! resolver subsets, parsed once and evaluated over a [`Host`].
//!
//! Grammar: `or`/`and`/`not`, parentheses, and the matches `S == V`, `S != V`, `S is [not]
//! empty`, `V [not] in S`, `S [not] contains V`, `S [not] matches V`, where values are bare
//! words, numbers, `"double"` or `` `backtick` `` strings. Selectors follow Consul's health
//! (`CheckServiceNode`) shape — `Service.Meta.<key>`, `Service.Tags`, `Service.ID`,
//! `Service.Service`, `Service.Address`, `Service.Port`, `Node.Node`, `Node.Address`,
//! `Node.Datacenter`, `Node.Meta.<key>`, `Checks.Status` — plus the catalog's flat spellings
//! (`ServiceMeta.<key>`, `ServiceTags`, `ServiceID`, `ServiceName`, `ServiceAddress`,
//! `ServicePort`, `NodeMeta.<key>`, `Address`, `Datacenter`). Anything else, and any operator a
//! selector cannot support (such as `==` on a list), is an error when the filter is parsed, so a
//! filter never silently matches everything.

mod parse;

use std::collections::BTreeMap;

use regex::Regex;

/// A parsed filter.
#[derive(Debug, Clone)]
pub struct Filter {
    source: String,
    expr: Expr,
}

impl Filter {
    /// Parses `source`.
    pub fn parse(source: &str) -> Result<Self, FilterError> {
        Ok(Filter {
            source: source.to_owned(),
            expr: parse::parse(source)?,
        })
    }

    /// The expression text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether `host` satisfies the expression.
    pub fn matches(&self, host: &Host) -> bool {
        self.expr.eval(host)
    }
}

impl PartialEq for Filter {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

/// Health of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthStatus {
    /// `passing`.
    Passing,
    /// `warning`.
    Warning,
    /// `critical`.
    Critical,
    /// `maintenance`.
    Maintenance,
}

impl HealthStatus {
    /// Consul's spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            HealthStatus::Passing => "passing",
            HealthStatus::Warning => "warning",
            HealthStatus::Critical => "critical",
            HealthStatus::Maintenance => "maintenance",
        }
    }
}

/// What a filter can see of one service instance: node, service and health checks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Host {
    /// Node name (`Node.Node`).
    pub node: String,
    /// Node address (`Node.Address`).
    pub node_address: String,
    /// Datacenter (`Node.Datacenter`).
    pub datacenter: String,
    /// Node metadata (`Node.Meta`).
    pub node_meta: BTreeMap<String, String>,
    /// Service instance ID (`Service.ID`).
    pub service_id: String,
    /// Service name (`Service.Service`).
    pub service_name: String,
    /// Service address (`Service.Address`).
    pub service_address: String,
    /// Service port (`Service.Port`).
    pub service_port: u16,
    /// Service metadata (`Service.Meta`).
    pub service_meta: BTreeMap<String, String>,
    /// Service tags (`Service.Tags`).
    pub service_tags: Vec<String>,
    /// Status of every check (`Checks.Status`).
    pub checks: Vec<HealthStatus>,
}

/// Why a filter expression was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FilterError {
    /// Nothing but whitespace.
    #[error("empty expression")]
    Empty,
    /// The input ended inside an expression.
    #[error("unexpected end of expression, expected {0}")]
    UnexpectedEnd(&'static str),
    /// A token that does not fit the grammar.
    #[error("unexpected {found:?} at offset {offset}, expected {expected}")]
    UnexpectedToken {
        found: String,
        offset: usize,
        expected: &'static str,
    },
    /// Parentheses and `not`s nested too deep.
    #[error("nested deeper than {0} levels of parentheses and `not`")]
    TooDeep(usize),
    /// Too many tokens.
    #[error("longer than {0} tokens")]
    TooLong(usize),
    /// A quoted string without its closing quote.
    #[error("unterminated string starting at offset {0}")]
    UnterminatedString(usize),
    /// A character that starts no token.
    #[error("invalid character {found:?} at offset {offset}")]
    InvalidCharacter { found: char, offset: usize },
    /// A selector naming nothing a host has.
    #[error("unknown selector {0:?}")]
    UnknownSelector(String),
    /// An operator the selector's type cannot support.
    #[error("operator {op:?} is not supported on selector {selector:?} ({hint})")]
    UnsupportedOperator {
        op: &'static str,
        selector: String,
        hint: &'static str,
    },
    /// A `matches` pattern that does not compile.
    #[error("invalid regular expression {pattern:?}: {reason}")]
    InvalidRegex { pattern: String, reason: String },
}

/// A boolean expression tree.
#[derive(Debug, Clone)]
enum Expr {
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Not(Box<Expr>),
    Match { field: Field, op: Op, negated: bool },
}

/// A resolved selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Field {
    Scalar(Scalar),
    MetaValue(MetaMap, String),
    Meta(MetaMap),
    Tags,
    CheckStatuses,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scalar {
    ServiceId,
    ServiceName,
    ServiceAddress,
    ServicePort,
    NodeName,
    NodeAddress,
    Datacenter,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MetaMap {
    Service,
    Node,
}

/// A match operator; negation is kept beside it in [`Expr::Match`].
#[derive(Debug, Clone)]
enum Op {
    Equal(String),
    IsEmpty,
    Contains(String),
    Matches(Regex),
}

/// The value a selector yields on one host.
enum Value<'a> {
    Missing,
    Text(std::borrow::Cow<'a, str>),
    List(Vec<&'a str>),
    Keys(&'a BTreeMap<String, String>),
}

impl Expr {
    fn eval(&self, host: &Host) -> bool {
        match self {
            Expr::And(a, b) => a.eval(host) && b.eval(host),
            Expr::Or(a, b) => a.eval(host) || b.eval(host),
            Expr::Not(e) => !e.eval(host),
            Expr::Match { field, op, negated } => op.eval(field.value(host)) != *negated,
        }
    }
}

impl Op {
    /// The positive form of the match; a missing map key satisfies no positive form.
    fn eval(&self, value: Value<'_>) -> bool {
        match (self, value) {
            (Op::IsEmpty, Value::Missing) => true,
            (_, Value::Missing) => false,
            (Op::Equal(want), Value::Text(t)) => t == want.as_str(),
            (Op::IsEmpty, Value::Text(t)) => t.is_empty(),
            (Op::IsEmpty, Value::List(l)) => l.is_empty(),
            (Op::IsEmpty, Value::Keys(m)) => m.is_empty(),
            (Op::Contains(want), Value::Text(t)) => t.contains(want.as_str()),
            (Op::Contains(want), Value::List(l)) => l.contains(&want.as_str()),
            (Op::Contains(want), Value::Keys(m)) => m.contains_key(want),
            (Op::Matches(re), Value::Text(t)) => re.is_match(&t),
            // Rejected when parsing (see `Field::check`).
            (Op::Equal(_) | Op::Matches(_), Value::List(_) | Value::Keys(_)) => false,
        }
    }
}

impl Field {
    /// Resolves a dotted selector.
    fn resolve(parts: &[String]) -> Option<Field> {
        let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        let field = match parts.as_slice() {
            ["Service", "Meta"] | ["ServiceMeta"] => Field::Meta(MetaMap::Service),
            ["Service", "Meta", key] | ["ServiceMeta", key] => {
                Field::MetaValue(MetaMap::Service, (*key).to_owned())
            }
            ["Node", "Meta"] | ["NodeMeta"] => Field::Meta(MetaMap::Node),
            ["Node", "Meta", key] | ["NodeMeta", key] => {
                Field::MetaValue(MetaMap::Node, (*key).to_owned())
            }
            ["Service", "Tags"] | ["ServiceTags"] => Field::Tags,
            ["Checks", "Status"] => Field::CheckStatuses,
            ["Service", "ID"] | ["ServiceID"] => Field::Scalar(Scalar::ServiceId),
            ["Service", "Service"] | ["ServiceName"] => Field::Scalar(Scalar::ServiceName),
            ["Service", "Address"] | ["ServiceAddress"] => Field::Scalar(Scalar::ServiceAddress),
            ["Service", "Port"] | ["ServicePort"] => Field::Scalar(Scalar::ServicePort),
            ["Node", "Node"] => Field::Scalar(Scalar::NodeName),
            ["Node", "Address"] | ["Address"] => Field::Scalar(Scalar::NodeAddress),
            ["Node", "Datacenter"] | ["Datacenter"] => Field::Scalar(Scalar::Datacenter),
            _ => return None,
        };
        Some(field)
    }

    /// Rejects operators the field's type cannot support.
    fn check(&self, op: &Op, op_text: &'static str, selector: &str) -> Result<(), FilterError> {
        let collection = matches!(self, Field::Meta(_) | Field::Tags | Field::CheckStatuses);
        if collection && matches!(op, Op::Equal(_) | Op::Matches(_)) {
            return Err(FilterError::UnsupportedOperator {
                op: op_text,
                selector: selector.to_owned(),
                hint: "it is a collection: use `in`, `contains` or `is empty`",
            });
        }
        Ok(())
    }

    fn value<'h>(&self, host: &'h Host) -> Value<'h> {
        use std::borrow::Cow;
        let meta = |m: MetaMap| match m {
            MetaMap::Service => &host.service_meta,
            MetaMap::Node => &host.node_meta,
        };
        match self {
            Field::Scalar(s) => Value::Text(match s {
                Scalar::ServiceId => Cow::Borrowed(host.service_id.as_str()),
                Scalar::ServiceName => Cow::Borrowed(host.service_name.as_str()),
                Scalar::ServiceAddress => Cow::Borrowed(host.service_address.as_str()),
                Scalar::ServicePort => Cow::Owned(host.service_port.to_string()),
                Scalar::NodeName => Cow::Borrowed(host.node.as_str()),
                Scalar::NodeAddress => Cow::Borrowed(host.node_address.as_str()),
                Scalar::Datacenter => Cow::Borrowed(host.datacenter.as_str()),
            }),
            Field::MetaValue(m, key) => match meta(*m).get(key) {
                Some(v) => Value::Text(Cow::Borrowed(v.as_str())),
                None => Value::Missing,
            },
            Field::Meta(m) => Value::Keys(meta(*m)),
            Field::Tags => Value::List(host.service_tags.iter().map(String::as_str).collect()),
            Field::CheckStatuses => Value::List(host.checks.iter().map(|c| c.as_str()).collect()),
        }
    }
}

#[cfg(test)]
mod tests;
