//! The connect loop a node's probe runs through a fault: round robin over services whose hosts
//! stay up, one connect per interval, each expected to reach the service's backend; it counts
//! attempts and failures until told to stop or until its bound.
//!
//! Lines: `loop INTERVAL_MS BOUND_S VIP:PORT=BACKEND_IP ...` answers `looping`; `stop`
//! answers `counts ATTEMPTS FAILED FIRST` (FIRST: `-`, or `NS,VIP:PORT,SEEN` of the first
//! failure, SEEN being the backend that answered or `refused`), then `bounded` if the loop
//! ended at its bound rather than at `stop`.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{probe::Expect, sys};

/// What a loop is told: its pace, its bound and its targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub interval: Duration,
    pub bound: Duration,
    pub targets: Vec<(SocketAddr, Ipv4Addr)>,
}

impl Plan {
    pub fn line(&self) -> String {
        let targets: Vec<String> = self
            .targets
            .iter()
            .map(|(a, b)| format!("{a}={b}"))
            .collect();
        format!(
            "loop {} {} {}",
            self.interval.as_millis(),
            self.bound.as_secs(),
            targets.join(" ")
        )
    }

    pub fn parse(line: &str) -> anyhow::Result<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let ["loop", ms, bound, targets @ ..] = &words[..] else {
            bail!("expected `loop INTERVAL_MS BOUND_S VIP:PORT=BACKEND ...`, got {line:?}");
        };
        let ms: u64 = ms.parse().with_context(|| format!("bad interval {ms:?}"))?;
        let bound: u64 = bound
            .parse()
            .with_context(|| format!("bad bound {bound:?}"))?;
        if ms == 0 || bound == 0 || targets.is_empty() {
            bail!("a loop needs an interval, a bound and at least one target: {line:?}");
        }
        let targets = targets
            .iter()
            .map(|t| {
                let (a, b) = t
                    .split_once('=')
                    .with_context(|| format!("bad target {t:?}"))?;
                Ok((a.parse()?, b.parse()?))
            })
            .collect::<anyhow::Result<_>>()
            .with_context(|| format!("in {line:?}"))?;
        Ok(Self {
            interval: Duration::from_millis(ms),
            bound: Duration::from_secs(bound),
            targets,
        })
    }
}

/// A loop's counts, as the probe reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub attempts: u64,
    pub failed: u64,
    /// The first failure: CLOCK_MONOTONIC, the service, what answered.
    pub first_failure: Option<String>,
    /// The loop reached its bound before `stop` (it did not cover the whole fault).
    pub bounded: bool,
}

impl Counts {
    pub fn line(&self) -> String {
        let first = self.first_failure.as_deref().unwrap_or("-");
        let end = if self.bounded { " bounded" } else { "" };
        format!("counts {} {} {first}{end}", self.attempts, self.failed)
    }

    pub fn parse(line: &str) -> anyhow::Result<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let ["counts", attempts, failed, first, rest @ ..] = &words[..] else {
            bail!("expected `counts ATTEMPTS FAILED FIRST`, got {line:?}");
        };
        let bounded = match rest {
            [] => false,
            ["bounded"] => true,
            _ => bail!("unexpected end of {line:?}"),
        };
        Ok(Self {
            attempts: attempts.parse().with_context(|| format!("in {line:?}"))?,
            failed: failed.parse().with_context(|| format!("in {line:?}"))?,
            first_failure: (*first != "-").then(|| (*first).to_owned()),
            bounded,
        })
    }
}

/// A running loop: its thread and the flag that stops it.
pub struct Running {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Counts>,
}

/// Handles `loop ...` and `stop`; returns the answer line.
pub fn command(
    line: &str,
    running: &mut Option<Running>,
    try_once: fn(SocketAddr) -> Option<String>,
) -> anyhow::Result<String> {
    if line == "stop" {
        let r = running.take().context("`stop` without a running loop")?;
        r.stop.store(true, Ordering::Relaxed);
        let counts = r
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("the connect loop panicked"))?;
        return Ok(counts.line());
    }
    if running.is_some() {
        bail!("a loop is already running");
    }
    let plan = Plan::parse(line)?;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::spawn(move || run(&plan, &flag, try_once));
    *running = Some(Running { stop, thread });
    Ok("looping".to_owned())
}

fn run(plan: &Plan, stop: &AtomicBool, try_once: fn(SocketAddr) -> Option<String>) -> Counts {
    let mut counts = Counts::default();
    let deadline = Instant::now() + plan.bound;
    for (addr, backend) in plan.targets.iter().cycle() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        if Instant::now() > deadline {
            counts.bounded = true;
            break;
        }
        let t = sys::monotonic_ns();
        let seen = try_once(*addr);
        counts.attempts += 1;
        if !Expect::Up(*backend).holds(seen.as_deref()) {
            counts.failed += 1;
            if counts.first_failure.is_none() {
                let what = seen.map_or_else(|| "refused".to_owned(), |s| s.replace(' ', "_"));
                counts.first_failure = Some(format!("{t},{addr},{what}"));
            }
        }
        std::thread::sleep(plan.interval);
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_line_round_trips_and_bad_ones_are_refused() {
        let plan = Plan {
            interval: Duration::from_millis(20),
            bound: Duration::from_secs(600),
            targets: vec![
                (
                    "10.96.0.11:8080".parse().unwrap(),
                    Ipv4Addr::new(10, 220, 0, 3),
                ),
                (
                    "10.96.0.12:8080".parse().unwrap(),
                    Ipv4Addr::new(10, 220, 0, 4),
                ),
            ],
        };
        assert_eq!(
            plan.line(),
            "loop 20 600 10.96.0.11:8080=10.220.0.3 10.96.0.12:8080=10.220.0.4"
        );
        assert_eq!(Plan::parse(&plan.line()).unwrap(), plan);
        for bad in [
            "loop 20 600",
            "loop 0 600 10.96.0.1:8080=10.220.0.1",
            "loop 20 0 10.96.0.1:8080=10.220.0.1",
            "loop x 600 10.96.0.1:8080=10.220.0.1",
            "loop 20 600 10.96.0.1:8080",
            "loop 20 600 10.96.0.1=10.220.0.1",
            "spin 20 600 10.96.0.1:8080=10.220.0.1",
        ] {
            assert!(Plan::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn counts_round_trip_with_the_first_failure_and_the_bound() {
        let clean = Counts {
            attempts: 120,
            ..Counts::default()
        };
        assert_eq!(clean.line(), "counts 120 0 -");
        assert_eq!(Counts::parse(&clean.line()).unwrap(), clean);
        let failed = Counts {
            attempts: 7,
            failed: 2,
            first_failure: Some("99,10.96.0.1:8080,refused".into()),
            bounded: true,
        };
        assert_eq!(Counts::parse(&failed.line()).unwrap(), failed);
        for bad in ["counts 1 0", "counts a 0 -", "counts 1 0 - late", "seen 5"] {
            assert!(Counts::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    fn answers(addr: SocketAddr) -> Option<String> {
        (addr.port() == 1).then(|| "10.220.0.1".to_owned())
    }

    #[test]
    fn a_loop_counts_a_failure_for_each_connect_that_misses_its_backend() {
        let mut running = None;
        let line = "loop 1 60 127.0.0.1:1=10.220.0.1 127.0.0.1:2=10.220.0.1";
        assert_eq!(command(line, &mut running, answers).unwrap(), "looping");
        assert!(command(line, &mut running, answers).is_err(), "two loops");
        std::thread::sleep(Duration::from_millis(50));
        let counts = Counts::parse(&command("stop", &mut running, answers).unwrap()).unwrap();
        assert!(counts.attempts >= 2, "{counts:?}");
        // Round robin: every second connect went to the port that does not answer.
        assert_eq!(counts.failed, counts.attempts / 2, "{counts:?}");
        assert!(
            counts
                .first_failure
                .unwrap()
                .ends_with(",127.0.0.1:2,refused")
        );
        assert!(!counts.bounded);
        assert!(command("stop", &mut running, answers).is_err());
    }
}
