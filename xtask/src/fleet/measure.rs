//! The measurement: readiness of every node, then each kind of change, one at a time: every
//! node's probe is armed (it has seen the state before the change), the change is made, and
//! each probe reports when its node's kernel first served the new state.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{
    Fleet, Options, backend_of, consul, http, net,
    node::{LEGS, Node},
    probe::Expect,
    report::Kind,
    split, svc, sys,
};
use crate::util::{detail, step};

/// Every daemon answers /ready, then every node's kernel serves every registered service (one
/// connect each, through the node's probe) and refuses the ones not registered yet.
pub fn wait_ready(nodes: &mut [Node], opts: &Options) -> anyhow::Result<()> {
    step("waiting until every node is ready");
    let t = Instant::now();
    let deadline = t + Duration::from_secs(300);
    for node in nodes.iter_mut() {
        loop {
            sys::check_interrupted()?;
            node.check_alive()?;
            let admin = node.admin;
            let ready = net::with_netns(&node.netns, || http::call(admin, "GET", "/ready", None))?;
            if ready.is_ok_and(|(status, _)| status == 200) {
                break;
            }
            if Instant::now() > deadline {
                bail!("node {} was not ready within 300 s", node.index);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    detail(format!(
        "every daemon ready after {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let splits = opts.splits();
    for j in 0..opts.services + splits {
        // Split services (after the others) start on leg-a, on backend 0.
        let expect = match j {
            j if j < opts.changes => Expect::Down,
            j if j < opts.services => Expect::Up(backend_of(opts, j)),
            _ => Expect::Up(net::backend(0)),
        };
        let addr = SocketAddr::from((net::vip(j), net::VIP_PORT));
        for node in nodes.iter_mut() {
            if node.arm(addr, &expect, Duration::from_secs(120))? && node.seen()?.is_none() {
                bail!(
                    "node {} does not serve {} ({}) within 120 s",
                    node.index,
                    name_of(opts, j),
                    expect.word()
                );
            }
        }
    }
    detail(format!(
        "every node's kernel serves all {} services as registered, after {:.1} s",
        opts.services + splits,
        t.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Registration, deregistration and a check turning critical, `changes` each.
pub fn consul(fleet: &mut Fleet, opts: &Options) -> anyhow::Result<Vec<Kind>> {
    let k = opts.changes;
    let cluster = fleet.cluster.as_ref().context("no consul")?;
    let nodes = &mut fleet.nodes;
    let up = |j| Expect::Up(backend_of(opts, j));
    let register = |j| {
        let body = consul::registration(&svc(j), backend_of(opts, j));
        cluster.put(consul::REGISTER, Some(&body))
    };
    let reg = measure(nodes, opts, "register", 0..k, up, register)?;
    let deregister = |j| cluster.put(&format!("/v1/agent/service/deregister/{}", svc(j)), None);
    let dereg = measure(
        nodes,
        opts,
        "deregister",
        0..k,
        |_| Expect::Down,
        deregister,
    )?;
    let fail = |j| cluster.put(&format!("/v1/agent/check/fail/{}-ttl", svc(j)), None);
    let crit = measure(nodes, opts, "critical", k..2 * k, |_| Expect::Down, fail)?;
    // The split services' VIPs follow the others': service `services + m` is split-m.
    let s = opts.services;
    let to_b = |_| Expect::Up(net::backend(1));
    let write = |j: u32| {
        cluster.put(
            "/v1/config",
            Some(&consul::splitter(&split(j - s), LEGS[1])),
        )
    };
    let mut kinds = vec![reg, dereg, crit];
    if opts.splits() > 0 {
        kinds.push(measure(nodes, opts, "split-move", s..s + k, to_b, write)?);
    }
    Ok(kinds)
}

/// One kind: for each service in `range`, arm every node's probe, make the change, collect
/// each node's time.
fn measure(
    nodes: &mut [Node],
    opts: &Options,
    kind: &str,
    range: std::ops::Range<u32>,
    expect: impl Fn(u32) -> Expect,
    mut change: impl FnMut(u32) -> anyhow::Result<u64>,
) -> anyhow::Result<Kind> {
    step(format!("measuring {kind}: {} changes", range.len()));
    let bound = Duration::from_secs(opts.bound_s);
    let mut observed = Vec::new();
    for j in range {
        sys::check_interrupted()?;
        let addr = SocketAddr::from((net::vip(j), net::VIP_PORT));
        let want = expect(j);
        for node in nodes.iter_mut() {
            node.check_alive()?;
            if !node.arm(addr, &want, bound)? {
                bail!(
                    "{kind} of {}: node {} already saw {} before the change",
                    name_of(opts, j),
                    node.index,
                    want.word()
                );
            }
        }
        let t0 = change(j)?;
        let times: Vec<Option<f64>> = nodes
            .iter_mut()
            .map(|n| Ok(n.seen()?.map(|t| t.saturating_sub(t0) as f64 / 1e6)))
            .collect::<anyhow::Result<_>>()?;
        if times.iter().all(Option::is_none) {
            bail!(
                "{kind} of {}: no node saw it within {bound:?}",
                name_of(opts, j)
            );
        }
        observed.push(times);
    }
    let k = Kind::new(kind, observed);
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    detail(format!(
        "{kind}: every node p50 {} ms, p99 {} ms, max {} ms; {} timeouts",
        ms(k.every_node.p50_ms),
        ms(k.every_node.p99_ms),
        ms(k.every_node.max_ms),
        k.timeouts
    ));
    Ok(k)
}

/// An endpoint added by a push, then removed by one, `changes` each.
pub fn xds(fleet: &mut Fleet, opts: &Options) -> anyhow::Result<Vec<Kind>> {
    let k = opts.changes;
    let server = fleet.xds.as_mut().context("no xDS server")?;
    let add = measure(
        &mut fleet.nodes,
        opts,
        "eds-add",
        0..k,
        |j| Expect::Up(backend_of(opts, j)),
        |j| server.push_endpoints(j, Some(backend_of(opts, j))),
    )?;
    let remove = measure(
        &mut fleet.nodes,
        opts,
        "eds-remove",
        0..k,
        |_| Expect::Down,
        |j| server.push_endpoints(j, None),
    )?;
    Ok(vec![add, remove])
}

/// The name of the service on VIP `j`: `svc-<j>`, or a split service after them.
fn name_of(opts: &Options, j: u32) -> String {
    if j < opts.services {
        svc(j)
    } else {
        split(j - opts.services)
    }
}
