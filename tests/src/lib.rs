//! Harness for the root-only integration tests: network namespaces, cgroups, real servers.
//!
//! Every helper here creates what it needs and removes it on drop, so a failing test leaves
//! nothing behind. Tests live in `tests/tests/`; run them with `cargo xtask test`.

pub mod consul;
#[allow(
    unsafe_code,
    reason = "the kernel feature probes' raw bpf(2) calls, each with its SAFETY note"
)]
pub mod features;
pub mod health_servers;
pub mod http_servers;
#[allow(
    unsafe_code,
    reason = "fork, setns, raw sockets and bpf(2) of the kernel fixtures, each with its SAFETY note"
)]
pub mod kernel;
pub mod pki;
pub mod slow_dns;
pub mod udp_echo;
pub mod unbound;
pub mod xds_server;

/// Starts a server with `start`, up to `attempts` times. The ports a start is given were free a
/// moment ago, and another process (a parallel test, a benchmark) may take one first: a start
/// whose log says so is tried again on fresh ports. Any other failure, or the last one, panics
/// with the server's log.
pub(crate) fn start_retrying<T>(
    what: &str,
    attempts: usize,
    mut start: impl FnMut() -> Result<T, String>,
) -> T {
    for attempt in 1.. {
        match start() {
            Ok(server) => return server,
            Err(log) => give_up_unless_port_taken(what, attempt, attempts, log),
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// [`start_retrying`] for a start that is async.
pub(crate) async fn start_retrying_async<T>(
    what: &str,
    attempts: usize,
    mut start: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    for attempt in 1.. {
        match start().await {
            Ok(server) => return server,
            Err(log) => give_up_unless_port_taken(what, attempt, attempts, log),
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// Panics with `log` unless attempt `attempt` of `attempts` failed for a taken port and another
/// one is left.
#[expect(
    clippy::needless_pass_by_value,
    reason = "the log is moved into the panic message"
)]
fn give_up_unless_port_taken(what: &str, attempt: usize, attempts: usize, log: String) {
    let port_taken = log.to_ascii_lowercase().contains("address already in use");
    assert!(
        port_taken && attempt < attempts,
        "{what} did not start (attempt {attempt} of {attempts}):\n{log}"
    );
}

#[cfg(test)]
mod tests {
    use super::start_retrying;

    #[test]
    fn a_start_that_lost_its_port_is_tried_again() {
        let mut tries = 0;
        let got = start_retrying("server", 3, || {
            tries += 1;
            match tries {
                1 => Err("bind: Address already in use".to_owned()),
                _ => Ok(tries),
            }
        });
        assert_eq!(got, 2);
    }

    #[test]
    #[should_panic(expected = "server did not start (attempt 1 of 3):\nconfig error")]
    fn another_failure_is_not_tried_again() {
        start_retrying::<()>("server", 3, || Err("config error".to_owned()));
    }

    #[test]
    #[should_panic(expected = "server did not start (attempt 2 of 2)")]
    fn the_last_attempt_gives_up_even_for_a_taken_port() {
        start_retrying::<()>("server", 2, || Err("address already in use".to_owned()));
    }
}
