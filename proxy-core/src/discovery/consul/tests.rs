//! Unit tests of the Consul backend: a scripted [`CatalogFetch`] under paused tokio time for the
//! watch loop (index rules, mapping, failures, backoff), and a scripted HTTP server on loopback
//! for the wire format.

mod access;
mod acl;
mod config;
mod entries;
mod failure;
mod index;
mod mapping;
mod tls;
mod wire;

use std::{
    collections::VecDeque,
    io,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use serde_json::{Value, json};
use tokio::{sync::watch, time::Instant};

use super::{
    ConsulCluster,
    acl::TOKEN_SELF,
    http::{HttpError, HttpResponse},
    recovery::AgentSignal,
    spawn_with,
    watch::{BoxFuture, CatalogFetch},
};
use crate::{
    config::sources::consul::{ConsulConfig, access::ConsulToken},
    discovery::source::{DiscoverySource as _, SourceUpdate},
};

/// Bound of every wait in these tests (virtual time: costs nothing when met).
const WAIT: Duration = Duration::from_secs(600);

/// One scripted answer.
pub(super) enum Reply {
    /// 200 with `X-Consul-Index: index` and this JSON body.
    Ok(u64, Value),
    /// Any other status with a text body.
    Status(u16, &'static str),
    /// A response exactly as given.
    Raw(HttpResponse),
    /// Connection refused.
    Fail,
    /// Runs the closure when the request is answered (before the next one is sent), then
    /// answers with the reply.
    Then(Box<dyn FnOnce() + Send>, Box<Reply>),
}

/// How the scripted agent answers `/v1/acl/token/self` (not part of the reply list).
#[derive(Clone, Debug, Default)]
pub(super) enum Acls {
    /// 401 "ACL support disabled".
    #[default]
    Disabled,
    /// 200 for these tokens, 403 "ACL not found" for any other and for none.
    Known(Vec<&'static str>),
    /// As `Known`, but the tokens' policy does not let them read the service (the authorize
    /// endpoint answers `Allow: false`).
    KnownWithoutRead(Vec<&'static str>),
    /// As `Known`, but the tokens may read services and not nodes.
    KnownWithoutNodeRead(Vec<&'static str>),
    /// This status, always.
    Status(u16),
}

#[derive(Default)]
struct ScriptState {
    replies: VecDeque<Reply>,
    /// Each permission check: its target, token and body.
    authorizations: Vec<(String, Option<String>, String)>,
    log: Vec<(Instant, String, Option<String>)>,
    acls: Acls,
    /// The token of each `/v1/acl/token/self` request.
    acl_checks: Vec<Option<String>>,
}

/// Answers queries from a list; once the list is used up, queries block forever (a blocking
/// query with no change). Cloning shares the script.
#[derive(Clone)]
pub(super) struct Script {
    state: Arc<Mutex<ScriptState>>,
    requests: Arc<watch::Sender<usize>>,
    /// The agent's recovery signal, when the test shares one between scripts.
    agent: Option<AgentSignal>,
}

impl Script {
    pub(super) fn new(replies: Vec<Reply>) -> Self {
        Self {
            state: Arc::new(Mutex::new(ScriptState {
                replies: replies.into(),
                ..ScriptState::default()
            })),
            requests: Arc::new(watch::channel(0).0),
            agent: None,
        }
    }

    /// The script as one of the watches of an agent whose recovery signal is `agent`.
    pub(super) fn on_agent(mut self, agent: &AgentSignal) -> Self {
        self.agent = Some(agent.clone());
        self
    }

    /// Sets how `/v1/acl/token/self` is answered from now on.
    pub(super) fn authorizations(&self) -> Vec<(String, Option<String>, String)> {
        self.state().authorizations.clone()
    }

    pub(super) fn set_acls(&self, acls: Acls) {
        self.state().acls = acls;
    }

    /// The tokens of the `/v1/acl/token/self` requests so far.
    pub(super) fn acl_checks(&self) -> Vec<Option<String>> {
        self.state().acl_checks.clone()
    }

    fn state(&self) -> MutexGuard<'_, ScriptState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Request targets so far.
    pub(super) fn targets(&self) -> Vec<String> {
        self.state().log.iter().map(|(_, t, _)| t.clone()).collect()
    }

    /// Start times of the requests so far.
    pub(super) fn times(&self) -> Vec<Instant> {
        self.state().log.iter().map(|(t, _, _)| *t).collect()
    }

    /// `(target, X-Consul-Token)` of the requests so far.
    pub(super) fn sent(&self) -> Vec<(String, Option<String>)> {
        let state = self.state();
        state
            .log
            .iter()
            .map(|(_, t, k)| (t.clone(), k.clone()))
            .collect()
    }

    /// Waits until at least `n` requests were made.
    pub(super) async fn wait_requests(&self, n: usize) {
        let mut rx = self.requests.subscribe();
        let made = tokio::time::timeout(WAIT, rx.wait_for(|count| *count >= n)).await;
        assert!(
            matches!(made, Ok(Ok(_))),
            "expected {n} requests, got {:?}",
            self.targets()
        );
    }
}

impl CatalogFetch for Script {
    fn agent(&self) -> AgentSignal {
        self.agent.clone().unwrap_or_else(super::recovery::alone)
    }

    fn post<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        body: Vec<u8>,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>> {
        let mut state = self.state();
        state.authorizations.push((
            target.to_owned(),
            token.map(|t| t.expose().to_owned()),
            String::from_utf8_lossy(&body).into_owned(),
        ));
        // One answer per question, as Consul gives them.
        let asked: Vec<Value> = serde_json::from_slice(&body).unwrap_or_default();
        let answers: Vec<Value> = asked
            .into_iter()
            .map(|mut question| {
                let allow = !matches!(
                    (&state.acls, question["Resource"].as_str()),
                    (Acls::KnownWithoutRead(_), Some("service"))
                        | (Acls::KnownWithoutNodeRead(_), Some("node"))
                );
                question["Allow"] = Value::Bool(allow);
                question
            })
            .collect();
        let body = Value::from(answers).to_string();
        Box::pin(std::future::ready(Ok(HttpResponse {
            status: 200,
            headers: Vec::new(),
            body: body.into_bytes(),
        })))
    }

    fn get<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>> {
        let token = token.map(|t| t.expose().to_owned());
        if target == TOKEN_SELF {
            let mut state = self.state();
            let response = token_self(&state.acls, token.as_deref());
            state.acl_checks.push(token);
            return Box::pin(std::future::ready(Ok(response)));
        }
        let reply = {
            let mut state = self.state();
            state.log.push((Instant::now(), target.to_owned(), token));
            state.replies.pop_front()
        };
        self.requests.send_modify(|count| *count += 1);
        let reply = match reply {
            Some(Reply::Then(hook, reply)) => {
                hook();
                Some(*reply)
            }
            other => other,
        };
        Box::pin(async move {
            match reply {
                Some(Reply::Ok(index, body)) => Ok(HttpResponse {
                    status: 200,
                    headers: vec![("x-consul-index".to_owned(), index.to_string())],
                    body: body.to_string().into_bytes(),
                }),
                Some(Reply::Status(status, text)) => Ok(HttpResponse {
                    status,
                    headers: Vec::new(),
                    body: text.as_bytes().to_vec(),
                }),
                Some(Reply::Raw(response)) => Ok(response),
                Some(Reply::Fail) => Err(HttpError::Connect {
                    address: "127.0.0.1:8500".to_owned(),
                    source: io::ErrorKind::ConnectionRefused.into(),
                }),
                Some(Reply::Then(..)) => unreachable!("unwrapped above"),
                None => std::future::pending().await,
            }
        })
    }
}

/// The scripted agent's answer to `/v1/acl/token/self` with `token`.
fn token_self(acls: &Acls, token: Option<&str>) -> HttpResponse {
    let (status, text) = match acls {
        Acls::Disabled => (401, "ACL support disabled"),
        Acls::Known(known) if token.is_some_and(|t| known.contains(&t)) => {
            (200, "{\"AccessorID\": \"a\", \"SecretID\": \"s\"}")
        }
        Acls::KnownWithoutRead(known) | Acls::KnownWithoutNodeRead(known)
            if token.is_some_and(|t| known.contains(&t)) =>
        {
            (200, "{\"AccessorID\": \"a\", \"SecretID\": \"s\"}")
        }
        Acls::Known(_) | Acls::KnownWithoutRead(_) | Acls::KnownWithoutNodeRead(_) => {
            (403, "ACL not found")
        }
        Acls::Status(status) => (*status, "rpc error"),
    };
    HttpResponse {
        status,
        headers: Vec::new(),
        body: text.as_bytes().to_vec(),
    }
}

/// Starts a cluster named `web` on `script` with a fixed random seed and no `CONSUL_HTTP_*`
/// variables.
pub(super) fn start(config: ConsulConfig, script: &Script) -> ConsulCluster {
    let access =
        crate::config::sources::consul::access::resolve(&config, &|_| None).expect("valid config");
    spawn_with(
        "web".to_owned(),
        config,
        access,
        Arc::new(script.clone()),
        fastrand::Rng::with_seed(7),
    )
    .expect("valid config")
}

/// Waits until the published state satisfies `wanted`.
pub(super) async fn wait_state(
    cluster: &ConsulCluster,
    wanted: impl FnMut(&SourceUpdate) -> bool,
) -> SourceUpdate {
    let mut updates = cluster.updates();
    match tokio::time::timeout(WAIT, updates.wait_for(wanted)).await {
        Ok(Ok(update)) => update.clone(),
        _ => panic!("state never matched; last: {:?}", cluster.current()),
    }
}

/// The published addresses, in order.
pub(super) fn addrs(update: &SourceUpdate) -> Vec<String> {
    update.hosts.iter().map(|h| h.addr.to_string()).collect()
}

/// A catalog instance for [`body`].
#[derive(Clone)]
pub(super) struct Inst {
    pub node: &'static str,
    pub node_addr: &'static str,
    pub id: &'static str,
    pub addr: &'static str,
    pub port: u16,
    pub meta: Value,
    pub weights: Value,
    pub checks: Vec<&'static str>,
}

/// Instance `id` at `addr:port` on node n1 (127.0.0.1), weights 1/1, serfHealth and one service
/// check passing.
pub(super) fn inst(id: &'static str, addr: &'static str, port: u16) -> Inst {
    Inst {
        node: "n1",
        node_addr: "127.0.0.1",
        id,
        addr,
        port,
        meta: json!({}),
        weights: json!({"Passing": 1, "Warning": 1}),
        checks: vec!["passing", "passing"],
    }
}

impl Inst {
    /// Sets the service check's status (the node's serfHealth stays passing).
    pub(super) fn check(mut self, status: &'static str) -> Self {
        self.checks[1] = status;
        self
    }
}

/// A `/v1/health/service/web` body as Consul 1.8 writes it.
pub(super) fn body(instances: &[Inst]) -> Value {
    let entries: Vec<Value> = instances
        .iter()
        .map(|i| {
            let checks: Vec<Value> = i
                .checks
                .iter()
                .enumerate()
                .map(|(n, status)| {
                    let (id, service_id) = if n == 0 {
                        ("serfHealth".to_owned(), "")
                    } else {
                        (format!("service:{}:{n}", i.id), i.id)
                    };
                    json!({"Node": i.node, "CheckID": id, "Name": id, "Status": status,
                        "ServiceID": service_id, "ServiceName": "web", "Output": ""})
                })
                .collect();
            json!({
                "Node": {"ID": "", "Node": i.node, "Address": i.node_addr, "Datacenter": "dc1",
                    "TaggedAddresses": {"lan": i.node_addr}, "Meta": {"consul-network-segment": ""}},
                "Service": {"ID": i.id, "Service": "web", "Tags": [], "Address": i.addr,
                    "Meta": i.meta, "Port": i.port, "Weights": i.weights,
                    "EnableTagOverride": false},
                "Checks": checks,
            })
        })
        .collect();
    Value::Array(entries)
}
