//! Telling a truly empty catalog answer from one that Consul's ACLs emptied, so that a missing
//! or wrong token never drains a service.
//!
//! Consul 1.8.7 with `default_policy = "deny"` answers `/v1/health/service/<svc>` with 200 and
//! an empty list when no token is sent (the anonymous token may read nothing), and with 403
//! "ACL not found" for a token it does not know; nothing in the 200 says that ACLs filtered it.
//! So every empty answer is checked with `GET /v1/acl/token/self` and the same token:
//! * 200: Consul knows the token; then `POST /v1/internal/acl/authorize` (Consul 1.8 and later,
//!   what its UI asks) says whether the token may read the service, and for the catalog whether
//!   it may read nodes (`node:read` with the empty segment, what `node_prefix ""` grants: the
//!   health endpoint leaves out every instance on a node the token may not read): allowed, the
//!   empty answer is trusted; not allowed, [`AclDenial::NoServiceRead`] or
//!   [`AclDenial::NoNodeRead`] and the hosts are kept (the token is valid but its policy does
//!   not reach this service or its nodes); a 404 (a Consul without the endpoint) trusts the
//!   empty answer, as before it;
//! * 401 "ACL support disabled": no ACLs; the empty answer is trusted;
//! * 403: the token is refused (or none was sent): [`AclDenial`], the hosts are kept;
//! * anything else: a failed query, the hosts are kept.
//!
//! The token check's body is never read into an error or a log: with a valid token it holds the
//! token itself (`SecretID`).

use std::time::Duration;

use super::watch::{CatalogFetch, QueryError};
use crate::config::sources::consul::access::{SentToken, TokenOrigin};

/// The endpoint that says whether Consul knows a token.
pub(crate) const TOKEN_SELF: &str = "/v1/acl/token/self";

/// Why Consul's ACLs keep the catalog from this daemon. Never holds the token itself.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AclDenial {
    /// No token was sent and Consul shows nothing to the anonymous token.
    #[error(
        "no consul ACL token is set and consul's ACLs show the catalog only to a token (set \
         consul.token, consul.token_file, CONSUL_HTTP_TOKEN or CONSUL_HTTP_TOKEN_FILE)"
    )]
    NoToken,
    /// Consul does not know the token (403 "ACL not found").
    #[error(
        "consul does not know the ACL token from {origin} (ACL not found: a wrong, expired or \
         deleted token)"
    )]
    UnknownToken {
        /// Where the token came from.
        origin: TokenOrigin,
    },
    /// The token is known but its policy does not let it read the service: Consul empties the
    /// answer instead of refusing it.
    #[error(
        "the consul ACL token from {origin} may not read service {service:?} (its policy needs \
         service:read on it, and node:read on its nodes)"
    )]
    NoServiceRead {
        /// Where the token came from.
        origin: TokenOrigin,
        /// The service.
        service: String,
    },
    /// The token is known and may read the service, but not every node: Consul leaves out the
    /// instances on nodes it may not read, so an empty answer says nothing.
    #[error(
        "the consul ACL token from {origin} may read service {service:?} but not all nodes \
         (its policy needs node:read on the nodes the service runs on, e.g. node_prefix \"\" \
         {{ policy = \"read\" }}); consul hides the instances on the others"
    )]
    NoNodeRead {
        /// Where the token came from.
        origin: TokenOrigin,
        /// The service.
        service: String,
    },
    /// The token is known but not allowed (403 "Permission denied" or another 403).
    #[error(
        "consul refused the ACL token from {origin} (403: it needs service:read and node:read \
         on this service)"
    )]
    PermissionDenied {
        /// Where the token came from.
        origin: TokenOrigin,
    },
}

/// The endpoint that says what a token may do (a list of resource, segment and access).
pub(crate) const AUTHORIZE: &str = "/v1/internal/acl/authorize";

/// The denial a 403 with `body` means for `token`.
pub(crate) fn denial(body: &[u8], token: &SentToken) -> AclDenial {
    let Some((_, origin)) = token else {
        return AclDenial::NoToken;
    };
    let origin = origin.clone();
    if String::from_utf8_lossy(body).contains("ACL not found") {
        AclDenial::UnknownToken { origin }
    } else {
        AclDenial::PermissionDenied { origin }
    }
}

/// Checks, after an empty answer for `service` (in `datacenter`, the agent's own when `None`),
/// whether Consul knows `token` and lets it read the service (see the module docs); `Ok` when
/// the empty answer is to be trusted.
///
/// `services` are the services whose read permission is in question: the catalog's one, or the
/// services of config entries an answer would drop (Consul hides a service's entries from a
/// token that may not read it). With none, a known token's answer is trusted. `nodes`: the
/// answer lists instances on nodes (the catalog), so node:read is in question too.
pub(crate) async fn check_empty(
    fetch: &dyn CatalogFetch,
    token: &SentToken,
    (services, nodes): (&[&str], bool),
    datacenter: Option<&str>,
    timeout: Duration,
) -> Result<(), QueryError> {
    let sent = token.as_ref().map(|(token, _)| token);
    let response = fetch.get(TOKEN_SELF, sent, timeout).await?;
    let disabled = || String::from_utf8_lossy(&response.body).contains("ACL support disabled");
    match response.status {
        200 if services.is_empty() => Ok(()),
        200 => may_read(fetch, token, (services, nodes), datacenter, timeout).await,
        401 if disabled() => Ok(()),
        403 => Err(denial(&response.body, token).into()),
        status => Err(QueryError::AclCheck { status }),
    }
}

/// One answer of the authorize endpoint.
#[derive(serde::Deserialize)]
struct Authorization {
    #[serde(rename = "Allow")]
    allow: bool,
}

/// Whether Consul lets the known `token` read every one of `services`, and nodes when `nodes`
/// (one request).
async fn may_read(
    fetch: &dyn CatalogFetch,
    token: &SentToken,
    (services, nodes): (&[&str], bool),
    datacenter: Option<&str>,
    timeout: Duration,
) -> Result<(), QueryError> {
    let Some((sent, origin)) = token else {
        // A known token was sent: `token` holds it. Nothing to ask otherwise.
        return Ok(());
    };
    let mut ask: Vec<serde_json::Value> = services
        .iter()
        .map(|s| serde_json::json!({"Resource": "service", "Segment": s, "Access": "read"}))
        .collect();
    if nodes {
        ask.push(serde_json::json!({"Resource": "node", "Segment": "", "Access": "read"}));
    }
    let target = match datacenter {
        Some(dc) => format!("{AUTHORIZE}?dc={}", super::http::encode(dc)),
        None => AUTHORIZE.to_owned(),
    };
    let asked = ask.len();
    let body = serde_json::Value::from(ask).to_string().into_bytes();
    let response = fetch.post(&target, Some(sent), body, timeout).await?;
    match response.status {
        200 => {}
        // A Consul before 1.8 cannot say; the empty answer is trusted, as there.
        404 => return Ok(()),
        status => return Err(QueryError::Authorize { status }),
    }
    let answers: Vec<Authorization> = serde_json::from_slice(&response.body)
        .map_err(|_| QueryError::Authorize { status: 200 })?;
    if answers.len() != asked {
        return Err(QueryError::Authorize { status: 200 });
    }
    if let Some((service, _)) = services.iter().zip(&answers).find(|(_, a)| !a.allow) {
        return Err(AclDenial::NoServiceRead {
            origin: origin.clone(),
            service: (*service).to_owned(),
        }
        .into());
    }
    match (nodes, answers.last(), services.first()) {
        (true, Some(node), Some(service)) if !node.allow => Err(AclDenial::NoNodeRead {
            origin: origin.clone(),
            service: (*service).to_owned(),
        }
        .into()),
        _ => Ok(()),
    }
}
