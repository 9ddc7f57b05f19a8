//! The bound `--load` holds each node to: how many requests the daemon's way of following
//! Consul allows in a window, idle and with changes in it.

use serde::Serialize;

use crate::fleet::Options;

/// The daemon's `consul.wait` (its default: the fleet's configs do not set it), in seconds.
pub const DAEMON_WAIT_S: f64 = 30.0;
/// Config entry kinds the daemon watches when it reads config entries (one loop each).
pub const ENTRY_KINDS: u64 = 5;
/// Catalog writes one change may make: the backends agent syncs a service and its check with
/// one write, but may sync a check on its own as a second one.
pub const WRITES_PER_CHANGE: u64 = 2;

/// What the daemons are asked to follow, for the bound.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Design {
    /// `consul.wait`, seconds.
    pub wait_s: f64,
    /// Catalog watches per node (one per Consul cluster).
    pub services: u64,
    /// Config entry watches per node (one per kind, or none).
    pub kinds: u64,
    /// Services without an instance, at most: Consul answers their blocking queries at every
    /// deregistration of any service's last instance (it blocks a query on a service it does
    /// not know on that index), and the daemon checks each empty answer against the ACLs (one
    /// more request).
    pub empty: u64,
}

/// The changes made in a window, by what they wake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Changes {
    /// Catalog changes that leave the service an instance (registration, check status).
    pub catalog: u64,
    /// Deregistrations of a service's last instance.
    pub deregistrations: u64,
    /// Config entry writes.
    pub config: u64,
}

impl Changes {
    pub fn total(&self) -> u64 {
        self.catalog + self.deregistrations + self.config
    }
}

impl Design {
    /// The fleet's: every service and leg is a watch; the first `changes` services are the ones
    /// without an instance (before their registration, after their deregistration).
    pub fn of(opts: &Options) -> Self {
        let splits = opts.splits() > 0;
        Self {
            wait_s: DAEMON_WAIT_S,
            services: u64::from(opts.services) + if splits { 2 } else { 0 },
            kinds: if splits { ENTRY_KINDS } else { 0 },
            empty: u64::from(opts.changes),
        }
    }

    /// The most requests one node's daemon may make in `seconds` with `changes` in them
    /// (every answer counted with the ACL check an empty one adds):
    /// * idle, each watch's query returns at the latest after `wait` (Consul adds up to
    ///   wait/16, never less), so at most `floor(seconds / wait) + 1` queries finish per watch;
    /// * a catalog write returns the changed service's query; a deregistration also every
    ///   empty service's; a config entry write every kind's; a change is at most
    ///   [`WRITES_PER_CHANGE`] writes.
    pub fn bound(&self, seconds: f64, changes: Changes) -> u64 {
        let rounds = (seconds.max(0.0) / self.wait_s).floor() as u64 + 1;
        let idle = (self.services + self.kinds) * rounds + (self.empty + self.kinds) * rounds;
        let answers = changes.catalog
            + changes.deregistrations * (1 + self.empty)
            + changes.config * self.kinds;
        idle + WRITES_PER_CHANGE * 2 * answers
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// No change in the window.
    pub(in crate::fleet::load) const NONE: Changes = Changes {
        catalog: 0,
        deregistrations: 0,
        config: 0,
    };
    /// A node of 100 services, the five kinds of config entries, 10 of the services empty.
    pub(in crate::fleet::load) const DESIGN: Design = Design {
        wait_s: 30.0,
        services: 100,
        kinds: 5,
        empty: 10,
    };

    #[test]
    fn idle_each_watch_may_return_once_per_wait_and_once_more() {
        // (100 + 5) queries and (10 + 5) ACL checks per round; 31 s holds two rounds.
        assert_eq!(DESIGN.bound(29.9, NONE), 120);
        assert_eq!(DESIGN.bound(31.0, NONE), 240);
        assert_eq!(DESIGN.bound(0.0, NONE), 120);
    }

    #[test]
    fn a_change_may_return_its_service_and_a_deregistration_every_empty_one() {
        // Each answer may come with an ACL check, and a change may be two writes.
        let extra = |changes| DESIGN.bound(1.0, changes) - DESIGN.bound(1.0, NONE);
        let one = |catalog, deregistrations, config| Changes {
            catalog,
            deregistrations,
            config,
        };
        assert_eq!(extra(one(1, 0, 0)), 4);
        assert_eq!(extra(one(0, 1, 0)), 2 * 2 * (1 + 10));
        assert_eq!(extra(one(0, 0, 1)), 2 * 2 * 5);
        assert_eq!(one(3, 2, 1).total(), 6);
    }

    #[test]
    fn the_fleet_design_counts_the_legs_and_kinds_only_with_splits() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            opts: Options,
        }
        let mut opts = Cli::try_parse_from(["fleet", "--load"]).unwrap().opts;
        let design = |services, kinds| Design {
            wait_s: 30.0,
            services,
            kinds,
            empty: 100,
        };
        assert_eq!(Design::of(&opts), design(1002, 5));
        opts.no_split = true;
        assert_eq!(Design::of(&opts), design(1000, 0));
    }
}
