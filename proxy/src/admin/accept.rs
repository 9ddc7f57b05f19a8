//! The accept loop of one admin listener and its connection budget. Accepting never waits: at
//! the budget a new connection sheds the oldest one still waiting for its request head (else
//! the oldest of all), so idle or slow clients can delay nobody, and a request whose head
//! arrives is served at once. A connection is closed when its head is not complete within
//! [`HEAD_TIMEOUT`], and after [`CONNECTION_LIFETIME`] whatever it does.

use std::{
    collections::VecDeque,
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use hyper::{server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    task::AbortHandle,
};
use tracing::debug;

use super::{State, guard::Access, listen::Listener};

/// Connections the TCP listener keeps at once (about 1,000 file descriptors at most, well
/// within the daemon's limit next to the proxy path's).
pub(super) const CONNECTIONS: usize = 1024;
/// Connections the control socket keeps at once (only its owner connects).
pub(super) const CONTROL_CONNECTIONS: usize = 64;
/// Largest request head accepted (hyper's smallest read buffer); a larger one is answered 431.
pub(super) const MAX_REQUEST: usize = 8 * 1024;
/// A client whose request head is not complete after this long is dropped.
pub(super) const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a connection is kept, whatever it does (a client that does not read its answer
/// gives its slot back then). Generous: `proxy status` waits up to a minute for a large page.
pub(super) const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);
/// Pause after a failed `accept` (out of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A connection being served.
struct Live {
    task: AbortHandle,
    /// Set once its request head arrived.
    asked: Arc<AtomicBool>,
}

/// The connections being served; dropping this (the accept loop aborted) closes them all.
struct Serving(VecDeque<Live>);

impl Drop for Serving {
    fn drop(&mut self) {
        for conn in &self.0 {
            conn.task.abort();
        }
    }
}

/// Accepts on `listener` until aborted, keeping at most `budget` connections.
pub(super) async fn run(listener: Listener, budget: usize, access: Access, state: State) {
    let mut serving = Serving(VecDeque::with_capacity(budget));
    let live = &mut serving.0;
    loop {
        let asked = Arc::new(AtomicBool::new(false));
        let conn = Conn {
            asked: Arc::clone(&asked),
            access: access.clone(),
            state: state.clone(),
        };
        let accepted = match &listener {
            Listener::Tcp(tcp) => tcp.accept().await.map(|(stream, _)| {
                let local = stream.local_addr().ok();
                conn.spawn(stream, local)
            }),
            Listener::Unix { listener, .. } => listener
                .accept()
                .await
                .map(|(stream, _)| conn.spawn(stream, None)),
        };
        match accepted {
            Ok(task) => {
                make_room(live, budget);
                live.push_back(Live { task, asked });
            }
            Err(err) => {
                debug!(%err, "admin accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// Forgets finished connections; at the budget, closes the oldest connection still waiting
/// for its request head (else the oldest of all).
fn make_room(live: &mut VecDeque<Live>, budget: usize) {
    if live.len() < budget {
        return;
    }
    live.retain(|c| !c.task.is_finished());
    if live.len() < budget {
        return;
    }
    let oldest = live
        .iter()
        .position(|c| !c.asked.load(Ordering::Relaxed))
        .unwrap_or(0);
    if let Some(shed) = live.remove(oldest) {
        shed.task.abort();
        debug!(
            budget,
            "admin: at the connection budget; closed the oldest idle connection"
        );
    }
}

/// What serving one connection needs.
struct Conn {
    asked: Arc<AtomicBool>,
    access: Access,
    state: State,
}

impl Conn {
    /// Serves one connection (one request) in its own task; `local` is the address a TCP
    /// client connected to.
    fn spawn<S>(self, stream: S, local: Option<SocketAddr>) -> AbortHandle
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Self {
            asked,
            access,
            state,
        } = self;
        let flag = Arc::clone(&asked);
        let service = service_fn(move |request| {
            flag.store(true, Ordering::Relaxed);
            let (access, state) = (access.clone(), state.clone());
            async move {
                let answer = super::respond(&request, &access, local, &state).await;
                Ok::<_, Infallible>(answer.into_http())
            }
        });
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT)
            .max_buf_size(MAX_REQUEST)
            .keep_alive(false)
            .serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            let connection = tokio::time::timeout(CONNECTION_LIFETIME, connection);
            tokio::pin!(connection);
            let outcome = tokio::select! {
                outcome = &mut connection => outcome,
                () = tokio::time::sleep(HEAD_TIMEOUT) => {
                    if !asked.load(Ordering::Relaxed) {
                        debug!("admin: no request head within {HEAD_TIMEOUT:?}; closed");
                        return;
                    }
                    connection.await
                }
            };
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(err)) => debug!(%err, "admin connection failed"),
                Err(_) => debug!("admin connection closed after {CONNECTION_LIFETIME:?}"),
            }
        })
        .abort_handle()
    }
}
