//! The state machine, interval selection and jitter bounds.

use std::time::Duration;

use super::support::{secs, spec};
use crate::health::{
    random::{ExtremeRandom, SeededRandom},
    state::{
        CheckOutcome::{self, Degraded, Failed, Healthy},
        FailureKind::{Immediate, Network, Retriable, Timeout},
        HealthState, Transition, base_interval, initial_delay, with_jitter,
    },
};

fn run(state: &mut HealthState, outcomes: &[CheckOutcome]) -> Vec<Transition> {
    let spec = spec();
    outcomes.iter().map(|o| state.apply(*o, &spec)).collect()
}

#[test]
fn first_success_marks_healthy_at_once() {
    let mut s = HealthState::default();
    assert!(s.health().failed && s.health().pending);
    assert_eq!(run(&mut s, &[Healthy]), vec![Transition::Changed]);
    assert!(!s.health().failed && !s.health().pending);
}

#[test]
fn first_failure_publishes_but_stays_failed() {
    let mut s = HealthState::default();
    assert_eq!(run(&mut s, &[Failed(Network)]), vec![Transition::Changed]);
    assert!(s.health().failed && !s.health().pending);
    // Afterwards, healthy_threshold (2) successes are needed.
    assert_eq!(
        run(&mut s, &[Healthy, Healthy]),
        vec![Transition::ChangePending, Transition::Changed]
    );
    assert!(!s.health().failed);
}

#[test]
fn unhealthy_threshold_counts_network_timeout_and_retriable() {
    let mut s = HealthState::default();
    run(&mut s, &[Healthy]);
    let t = run(
        &mut s,
        &[Failed(Network), Failed(Retriable), Failed(Timeout)],
    );
    assert_eq!(
        t,
        vec![
            Transition::ChangePending,
            Transition::ChangePending,
            Transition::Changed
        ]
    );
    assert!(s.health().failed);
    assert!(s.health().timeout, "last failure was a timeout");
}

#[test]
fn a_success_resets_the_failure_count() {
    let mut s = HealthState::default();
    run(
        &mut s,
        &[
            Healthy,
            Failed(Network),
            Failed(Network),
            Healthy,
            Failed(Network),
        ],
    );
    assert!(!s.health().failed);
    run(&mut s, &[Failed(Network), Failed(Network)]);
    assert!(s.health().failed);
}

#[test]
fn immediate_failure_ignores_the_threshold() {
    let mut s = HealthState::default();
    run(&mut s, &[Healthy]);
    assert_eq!(run(&mut s, &[Failed(Immediate)]), vec![Transition::Changed]);
    assert!(s.health().failed);
    assert!(!s.health().timeout);
    // Healing still takes healthy_threshold successes.
    run(&mut s, &[Healthy]);
    assert!(s.health().failed);
    run(&mut s, &[Healthy]);
    assert!(!s.health().failed);
}

#[test]
fn degraded_flips_are_transitions() {
    let mut s = HealthState::default();
    run(&mut s, &[Healthy]);
    assert_eq!(run(&mut s, &[Degraded]), vec![Transition::Changed]);
    assert!(s.health().degraded && !s.health().failed);
    assert_eq!(
        run(&mut s, &[Degraded, Healthy]),
        vec![Transition::Unchanged, Transition::Changed]
    );
    assert!(!s.health().degraded);
}

#[test]
fn interval_selection() {
    use Transition::{ChangePending, Changed, Unchanged};
    let mut sp = spec();
    sp.interval = secs(5);
    sp.unhealthy_interval = secs(7);
    sp.unhealthy_edge_interval = secs(2);
    sp.healthy_edge_interval = secs(3);
    sp.no_traffic_interval = secs(60);
    sp.no_traffic_healthy_interval = secs(90);
    // Before traffic.
    assert_eq!(base_interval(&sp, false, true, Unchanged), secs(90));
    assert_eq!(base_interval(&sp, false, true, Changed), secs(90));
    assert_eq!(base_interval(&sp, false, true, ChangePending), secs(60));
    assert_eq!(base_interval(&sp, false, false, Unchanged), secs(60));
    // With traffic.
    assert_eq!(base_interval(&sp, true, true, Unchanged), secs(5));
    assert_eq!(base_interval(&sp, true, true, Changed), secs(5));
    assert_eq!(base_interval(&sp, true, true, ChangePending), secs(3));
    assert_eq!(base_interval(&sp, true, false, ChangePending), secs(2));
    assert_eq!(base_interval(&sp, true, false, Unchanged), secs(7));
    assert_eq!(base_interval(&sp, true, false, Changed), secs(7));
}

#[test]
fn jitter_bounds() {
    let mut sp = spec();
    sp.interval_jitter = Duration::from_millis(300);
    sp.interval_jitter_percent = 10;
    sp.initial_jitter = Duration::from_millis(700);
    let base = secs(5);
    let min = with_jitter(base, &sp, &ExtremeRandom { max: false });
    let max = with_jitter(base, &sp, &ExtremeRandom { max: true });
    assert_eq!(min, secs(5));
    // Both add: [0, 500 ms) from 10 % of 5 s, plus [0, 300 ms).
    assert_eq!(max, Duration::from_millis(5000 + 499 + 299));
    assert_eq!(
        initial_delay(&sp, &ExtremeRandom { max: true }),
        Duration::from_millis(699)
    );
    assert_eq!(
        initial_delay(&sp, &ExtremeRandom { max: false }),
        Duration::ZERO
    );
    let rng = SeededRandom::with_seed(7);
    for _ in 0..1000 {
        let d = with_jitter(base, &sp, &rng);
        assert!(d >= secs(5) && d < Duration::from_millis(5800), "{d:?}");
        assert!(initial_delay(&sp, &rng) < Duration::from_millis(700));
    }
    // No jitter configured: exactly the base, and no initial delay.
    let plain = spec();
    assert_eq!(with_jitter(base, &plain, &rng), base);
    assert_eq!(initial_delay(&plain, &rng), Duration::ZERO);
}
