//! A route's retry policy, from a service-router destination's `NumRetries`,
//! `RetryOnConnectFailure`, `RetryOnStatusCodes` and `RetryOn`, with the meaning Envoy gives each
//! condition; and Envoy's default jittered exponential back-off between attempts.
//!
//! Consul turns the destination into an Envoy route `retry_policy`: `retry_on` is `RetryOn`, plus
//! `connect-failure` for `RetryOnConnectFailure` and `retriable-status-codes` for
//! `RetryOnStatusCodes`; `num_retries` is `NumRetries` (Envoy's default of 1 when zero). Without
//! any condition nothing is retried, whatever `NumRetries` says.

use std::time::Duration;

use http::{HeaderMap, StatusCode};
use proxy_chain::entries::ServiceRouteDestination;

use super::error::RouteError;

/// Envoy's default retry back-off base interval (Consul configures none).
pub const RETRY_BACKOFF_BASE: Duration = Duration::from_millis(25);
/// Envoy's default maximum back-off: ten times the base.
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_millis(250);

/// gRPC status codes by Envoy's `retry_on` names (grpc-status in the response headers).
const GRPC_CONDITIONS: [(&str, u32); 5] = [
    ("cancelled", 1),
    ("deadline-exceeded", 4),
    ("resource-exhausted", 8),
    ("internal", 13),
    ("unavailable", 14),
];

/// Why an attempt produced no response, as far as retrying is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptFailure {
    /// No connection to the host (refused, unreachable, connect timeout); nothing was sent.
    ConnectFailure,
    /// The connection or stream ended before the response headers.
    Reset {
        /// An HTTP/2 `REFUSED_STREAM` reset: the upstream did not process the request.
        refused_stream: bool,
    },
}

/// When and how often a route's requests are tried again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (Envoy's `num_retries`).
    pub num_retries: u32,
    /// `connect-failure` (also `RetryOnConnectFailure`).
    pub connect_failure: bool,
    /// `reset`: no response because the upstream reset or closed the connection.
    pub reset: bool,
    /// `5xx`: any 5xx response, a reset or a connect failure.
    pub server_error: bool,
    /// `gateway-error`: 502, 503 or 504, a reset or a connect failure.
    pub gateway_error: bool,
    /// `retriable-4xx`: 409.
    pub retriable_4xx: bool,
    /// `refused-stream`: an HTTP/2 `REFUSED_STREAM` reset.
    pub refused_stream: bool,
    /// `envoy-ratelimited`: the response carries `x-envoy-ratelimited`.
    pub ratelimited: bool,
    /// `RetryOnStatusCodes` (Envoy's `retriable-status-codes`).
    pub status_codes: Vec<u16>,
    /// gRPC status codes from `cancelled`, `deadline-exceeded`, `internal`,
    /// `resource-exhausted` and `unavailable`.
    pub grpc_codes: Vec<u32>,
}

impl RetryPolicy {
    /// The policy of route `route`'s destination; an unknown condition or a status code that is
    /// not an HTTP status is an error, never ignored.
    pub fn from_destination(
        route: usize,
        dest: &ServiceRouteDestination,
    ) -> Result<Self, RouteError> {
        let mut p = Self {
            connect_failure: dest.retry_on_connect_failure,
            ..Self::default()
        };
        for condition in &dest.retry_on {
            match condition.as_str() {
                "connect-failure" => p.connect_failure = true,
                "reset" => p.reset = true,
                "5xx" => p.server_error = true,
                "gateway-error" => p.gateway_error = true,
                "retriable-4xx" => p.retriable_4xx = true,
                "refused-stream" => p.refused_stream = true,
                "envoy-ratelimited" => p.ratelimited = true,
                other => match GRPC_CONDITIONS.iter().find(|(name, _)| *name == other) {
                    Some((_, code)) => p.grpc_codes.push(*code),
                    None => {
                        return Err(RouteError::RetryCondition {
                            route,
                            condition: other.to_owned(),
                        });
                    }
                },
            }
        }
        for &code in &dest.retry_on_status_codes {
            let status = u16::try_from(code)
                .ok()
                .filter(|c| (100..=599).contains(c))
                .ok_or(RouteError::RetryStatus { route, code })?;
            p.status_codes.push(status);
        }
        if p.has_conditions() {
            // Envoy retries once when the policy gives no number.
            p.num_retries = dest.num_retries.max(1);
        }
        Ok(p)
    }

    /// Whether anything is ever retried.
    pub fn enabled(&self) -> bool {
        self.num_retries > 0 && self.has_conditions()
    }

    fn has_conditions(&self) -> bool {
        self.connect_failure
            || self.reset
            || self.server_error
            || self.gateway_error
            || self.retriable_4xx
            || self.refused_stream
            || self.ratelimited
            || !self.status_codes.is_empty()
            || !self.grpc_codes.is_empty()
    }

    /// Whether an attempt that failed this way is retried (retries left aside).
    pub fn retries_failure(&self, failure: AttemptFailure) -> bool {
        let any_reset = self.reset || self.server_error || self.gateway_error;
        match failure {
            AttemptFailure::ConnectFailure => self.connect_failure || any_reset,
            AttemptFailure::Reset { refused_stream } => {
                any_reset || (refused_stream && self.refused_stream)
            }
        }
    }

    /// Whether a response with these headers is retried (retries left aside).
    pub fn retries_response(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        let code = status.as_u16();
        (self.server_error && status.is_server_error())
            || (self.gateway_error && matches!(code, 502..=504))
            || (self.retriable_4xx && code == 409)
            || self.status_codes.contains(&code)
            || (self.ratelimited && headers.contains_key("x-envoy-ratelimited"))
            || (!self.grpc_codes.is_empty()
                && headers
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok()?.trim().parse::<u32>().ok())
                    .is_some_and(|c| self.grpc_codes.contains(&c)))
    }
}

/// The wait before retry number `retry` (1-based): uniformly random below
/// `(2^retry - 1) * RETRY_BACKOFF_BASE`, capped at `RETRY_BACKOFF_MAX` (Envoy's default
/// jittered exponential back-off). `random` is any uniformly distributed number.
pub fn backoff(retry: u32, random: u64) -> Duration {
    let factor = (1u64 << retry.clamp(1, 16)) - 1;
    let base = RETRY_BACKOFF_BASE.as_millis() as u64;
    let ceiling = (base * factor).min(RETRY_BACKOFF_MAX.as_millis() as u64);
    Duration::from_millis(random % ceiling.max(1))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn policy(json: &str) -> Result<RetryPolicy, RouteError> {
        let dest: ServiceRouteDestination = serde_json::from_str(json).unwrap();
        RetryPolicy::from_destination(2, &dest)
    }

    const REFUSED: AttemptFailure = AttemptFailure::Reset {
        refused_stream: true,
    };
    const RESET: AttemptFailure = AttemptFailure::Reset {
        refused_stream: false,
    };

    #[test]
    fn no_condition_means_no_retries() {
        let p = policy(r#"{"NumRetries": 5}"#).unwrap();
        assert!(!p.enabled());
        assert_eq!(p.num_retries, 0);
        assert!(!p.retries_failure(AttemptFailure::ConnectFailure));
    }

    #[test]
    fn consul_fields_and_envoy_defaults() {
        let p = policy(r#"{"RetryOnConnectFailure": true}"#).unwrap();
        assert_eq!(p.num_retries, 1, "Envoy's default");
        assert!(p.retries_failure(AttemptFailure::ConnectFailure));
        assert!(!p.retries_failure(RESET));
        let p = policy(r#"{"NumRetries": 3, "RetryOnStatusCodes": [503, 429]}"#).unwrap();
        assert_eq!(p.num_retries, 3);
        let h = HeaderMap::new();
        assert!(p.retries_response(StatusCode::SERVICE_UNAVAILABLE, &h));
        assert!(p.retries_response(StatusCode::TOO_MANY_REQUESTS, &h));
        assert!(!p.retries_response(StatusCode::BAD_GATEWAY, &h));
        assert!(!p.retries_failure(AttemptFailure::ConnectFailure));
    }

    #[test]
    fn envoy_conditions() {
        let h = HeaderMap::new();
        let p = policy(r#"{"RetryOn": ["5xx"]}"#).unwrap();
        assert!(p.retries_response(StatusCode::INTERNAL_SERVER_ERROR, &h));
        assert!(p.retries_failure(AttemptFailure::ConnectFailure) && p.retries_failure(RESET));
        let p = policy(r#"{"RetryOn": ["gateway-error"]}"#).unwrap();
        assert!(!p.retries_response(StatusCode::INTERNAL_SERVER_ERROR, &h));
        assert!(p.retries_response(StatusCode::GATEWAY_TIMEOUT, &h));
        assert!(p.retries_failure(RESET));
        let p = policy(r#"{"RetryOn": ["reset"]}"#).unwrap();
        assert!(p.retries_failure(RESET) && p.retries_failure(AttemptFailure::ConnectFailure));
        assert!(!p.retries_response(StatusCode::SERVICE_UNAVAILABLE, &h));
        let p = policy(r#"{"RetryOn": ["refused-stream"]}"#).unwrap();
        assert!(p.retries_failure(REFUSED) && !p.retries_failure(RESET));
        let p = policy(r#"{"RetryOn": ["retriable-4xx", "envoy-ratelimited"]}"#).unwrap();
        assert!(p.retries_response(StatusCode::CONFLICT, &h));
        assert!(!p.retries_response(StatusCode::TOO_MANY_REQUESTS, &h));
        let mut limited = HeaderMap::new();
        limited.insert("x-envoy-ratelimited", HeaderValue::from_static("true"));
        assert!(p.retries_response(StatusCode::TOO_MANY_REQUESTS, &limited));
    }

    #[test]
    fn grpc_conditions_read_grpc_status() {
        let p = policy(r#"{"RetryOn": ["unavailable", "cancelled"]}"#).unwrap();
        assert_eq!(p.grpc_codes, [14, 1]);
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_static("14"));
        assert!(p.retries_response(StatusCode::OK, &h));
        h.insert("grpc-status", HeaderValue::from_static("13"));
        assert!(!p.retries_response(StatusCode::OK, &h));
    }

    #[test]
    fn bad_conditions_and_codes_are_errors() {
        let err = policy(r#"{"RetryOn": ["5xx", "sometimes"]}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "route 2: retry condition \"sometimes\" is not supported (supported: 5xx, \
             gateway-error, reset, connect-failure, envoy-ratelimited, retriable-4xx, \
             refused-stream, cancelled, deadline-exceeded, internal, resource-exhausted, \
             unavailable)"
        );
        let err = policy(r#"{"RetryOnStatusCodes": [5030]}"#).unwrap_err();
        assert!(err.to_string().contains("5030"), "{err}");
    }

    #[test]
    fn backoff_is_jittered_exponential_and_capped() {
        assert!(backoff(1, u64::MAX) < Duration::from_millis(25));
        assert!(backoff(2, u64::MAX) < Duration::from_millis(75));
        assert_eq!(backoff(2, 74), Duration::from_millis(74));
        assert!(backoff(10, u64::MAX) < RETRY_BACKOFF_MAX);
        assert_eq!(backoff(3, 0), Duration::ZERO);
    }
}
