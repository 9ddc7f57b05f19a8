//! A scripted in-memory resolver for tests: answers set by the test, every query logged with its
//! (tokio, so pausable) time.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::time::Instant;

use super::resolver::{
    AddressFamily, AddressRecord, BoxFuture, DnsResolve, ResolveError, SrvRecord,
};

/// Which query a [`FakeResolver`] answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QueryType {
    /// A.
    A,
    /// AAAA.
    Aaaa,
    /// SRV.
    Srv,
}

impl From<AddressFamily> for QueryType {
    fn from(family: AddressFamily) -> Self {
        match family {
            AddressFamily::V4 => Self::A,
            AddressFamily::V6 => Self::Aaaa,
        }
    }
}

#[derive(Clone, Debug)]
enum Answer {
    Addresses(Vec<AddressRecord>),
    Srv(Vec<SrvRecord>),
    Fail,
}

#[derive(Default)]
struct State {
    answers: HashMap<(String, QueryType), Answer>,
    log: Vec<(Instant, String, QueryType)>,
    latency: Duration,
}

/// Scripted resolver. Unscripted queries get an empty (NXDOMAIN-like) answer. Cloning shares the
/// script and the log.
#[derive(Clone, Default)]
pub struct FakeResolver {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, thiserror::Error)]
#[error("scripted failure")]
struct ScriptedFailure;

impl FakeResolver {
    /// An empty script.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Answers `name`'s A (for IPv4 entries) and AAAA (for IPv6 entries) queries with these
    /// `(address, ttl seconds)` records, in this order. An empty slice makes both answers empty.
    pub fn set(&self, name: &str, records: &[(&str, u32)]) {
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        for (ip, ttl) in records {
            let ip: IpAddr = ip.parse().expect("fake resolver records take IP literals");
            let record = AddressRecord {
                ip,
                ttl: Duration::from_secs(u64::from(*ttl)),
            };
            if ip.is_ipv4() {
                v4.push(record);
            } else {
                v6.push(record);
            }
        }
        let mut state = self.state();
        state
            .answers
            .insert((name.to_owned(), QueryType::A), Answer::Addresses(v4));
        state
            .answers
            .insert((name.to_owned(), QueryType::Aaaa), Answer::Addresses(v6));
    }

    /// Answers `name`'s SRV query with these records.
    pub fn set_srv(&self, name: &str, records: Vec<SrvRecord>) {
        self.state()
            .answers
            .insert((name.to_owned(), QueryType::Srv), Answer::Srv(records));
    }

    /// Makes the given query of `name` fail (as a timeout or SERVFAIL would).
    pub fn fail(&self, name: &str, query: QueryType) {
        self.state()
            .answers
            .insert((name.to_owned(), query), Answer::Fail);
    }

    /// Makes every query type of `name` fail.
    pub fn fail_all(&self, name: &str) {
        for query in [QueryType::A, QueryType::Aaaa, QueryType::Srv] {
            self.fail(name, query);
        }
    }

    /// Makes every later answer (or failure) arrive this long after its query, in tokio time.
    pub fn set_latency(&self, latency: Duration) {
        self.state().latency = latency;
    }

    /// Times at which `name` was queried with `query`.
    pub fn query_times(&self, name: &str, query: QueryType) -> Vec<Instant> {
        let state = self.state();
        let matching = state
            .log
            .iter()
            .filter(|(_, n, q)| n == name && *q == query);
        matching.map(|(at, _, _)| *at).collect()
    }

    /// Every query so far as `(name, type)`, in order.
    pub fn queries(&self) -> Vec<(String, QueryType)> {
        self.state()
            .log
            .iter()
            .map(|(_, n, q)| (n.clone(), *q))
            .collect()
    }

    fn answer(&self, name: &str, query: QueryType) -> (Option<Answer>, Duration) {
        let mut state = self.state();
        state.log.push((Instant::now(), name.to_owned(), query));
        let answer = state.answers.get(&(name.to_owned(), query)).cloned();
        (answer, state.latency)
    }

    fn failure(name: &str, query: QueryType) -> ResolveError {
        let record_type = match query {
            QueryType::A => "A",
            QueryType::Aaaa => "AAAA",
            QueryType::Srv => "SRV",
        };
        ResolveError {
            name: name.to_owned(),
            record_type,
            source: Box::new(ScriptedFailure),
        }
    }
}

impl DnsResolve for FakeResolver {
    fn lookup_addresses<'a>(
        &'a self,
        name: &'a str,
        family: AddressFamily,
    ) -> BoxFuture<'a, Result<Vec<AddressRecord>, ResolveError>> {
        let query = QueryType::from(family);
        let (answer, latency) = self.answer(name, query);
        Box::pin(async move {
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            match answer {
                None => Ok(Vec::new()),
                Some(Answer::Addresses(records)) => Ok(records),
                Some(Answer::Srv(_)) => Ok(Vec::new()),
                Some(Answer::Fail) => Err(Self::failure(name, query)),
            }
        })
    }

    fn lookup_srv<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<SrvRecord>, ResolveError>> {
        let (answer, latency) = self.answer(name, QueryType::Srv);
        Box::pin(async move {
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            match answer {
                Some(Answer::Srv(records)) => Ok(records),
                Some(Answer::Fail) => Err(Self::failure(name, QueryType::Srv)),
                None | Some(Answer::Addresses(_)) => Ok(Vec::new()),
            }
        })
    }
}
