//! Compiling the chains of a composed configuration one at a time, so that an entry this
//! daemon cannot use (invalid by its rules though Consul took it, or defined both in the file
//! and in Consul) skips only the chains that read it, each reported with its reason.
//!
//! Precedence between the sources: none. An entry of one kind and name comes from the file
//! (`config_entries`, `config_entry_files`) or from Consul, never both: when both define it,
//! the Consul one is refused and every chain that reads that name is left out, with an error
//! that names both sources. Nothing is overridden silently.

use std::collections::{BTreeMap, BTreeSet};

use proxy_chain::{CompiledDiscoveryChain, ConfigEntry, Entries, EntryKind};

use super::{ChainExecError, ChainPlan, memo::ChainMemo, route_clusters};
use crate::config::{ClusterType, Config, Service, ServiceMode};

/// An entry no chain may use, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnusableEntry {
    /// Its kind.
    pub kind: EntryKind,
    /// Its `Name`.
    pub name: String,
    /// Why it cannot be used.
    pub reason: String,
}

/// A chain service left out of this configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainFailure {
    /// The service whose chain it is.
    pub service: String,
    /// Why its chain cannot run.
    pub reason: String,
}

/// The chains that compiled and the services whose chains did not.
#[derive(Clone, Debug, Default)]
pub struct CompiledChains {
    /// Compiled chains by service name.
    pub chains: BTreeMap<String, CompiledDiscoveryChain>,
    /// Chain services left out, in the order of `services`.
    pub failures: Vec<ChainFailure>,
    /// What was compiled from which entries, for the next composition.
    pub memo: ChainMemo,
}

/// Why one service's chain cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ChainServiceError {
    /// Consul's compiler refused the chain (its text).
    #[error(transparent)]
    Compile(#[from] proxy_chain::ChainError),
    /// The chain cannot run on the path the service asks for.
    #[error(transparent)]
    Exec(#[from] ChainExecError),
}

/// Compiles the chain `chain` of `svc` from `entries` and checks that it can run in `config`
/// (each target has a cluster that discovers hosts; routers only on the proxy path; the proxy
/// path only for HTTP protocols).
pub fn compile_service(
    config: &Config,
    svc: &Service,
    chain: &str,
    entries: &Entries,
) -> Result<CompiledDiscoveryChain, ChainServiceError> {
    let compiled = proxy_chain::compile(&compile_request(config, svc, chain), entries)?;
    runs_in(config, svc, &compiled)?;
    Ok(compiled)
}

/// What compiling the chain `chain` of `svc` in `config` asks Consul's compiler.
fn compile_request(config: &Config, svc: &Service, chain: &str) -> proxy_chain::CompileRequest {
    proxy_chain::CompileRequest {
        allow_tcp_splitting: svc.chain_options.tcp_splits,
        ..proxy_chain::CompileRequest::new(
            chain,
            &config.datacenter,
            proxy_chain::DEFAULT_TRUST_DOMAIN,
        )
    }
}

/// Whether the compiled chain of `svc` can run in `config`: each target has a cluster that
/// discovers hosts, routers only on the proxy path, the proxy path only for HTTP protocols.
pub fn runs_in(
    config: &Config,
    svc: &Service,
    compiled: &CompiledDiscoveryChain,
) -> Result<(), ChainExecError> {
    super::unapplied::refuse_unapplied(compiled)?;
    // A target must map to a cluster that discovers hosts (not ORIGINAL_DST).
    let has_cluster = |c: &str| {
        config.cluster(c).is_some_and(|c| {
            c.cluster_type != ClusterType::OriginalDst || c.custom_cluster_type.is_some()
        })
    };
    match svc.mode {
        ServiceMode::Direct => {
            let plan = ChainPlan::new(
                compiled,
                &config.datacenter,
                svc.chain_options.clone(),
                has_cluster,
            )?;
            hashes_if_keyed(config, svc, &plan)
        }
        ServiceMode::Proxy => route_clusters(compiled, &config.datacenter, &has_cluster).map(drop),
    }
}

/// A direct chain service that sets `hash_key` must hash: its resolvers' policy, or else its
/// clusters', is MAGLEV or RING_HASH (a key nobody reads would be silently ignored).
fn hashes_if_keyed(config: &Config, svc: &Service, plan: &ChainPlan) -> Result<(), ChainExecError> {
    if svc.hash_key.is_none() {
        return Ok(());
    }
    let policies = crate::kernel::policies(svc, config, Some(plan));
    match policies.first() {
        Some(policy) if !policies.iter().any(|p| p.hashes()) => {
            Err(ChainExecError::HashKeyWithoutHashing(*policy))
        }
        _ => Ok(()),
    }
}

/// Compiles the chain of every service of `config` that names one, from the file's entries
/// (`file`, already validated when the file was loaded) and Consul's (`consul`). A Consul entry
/// that is invalid or also in `file` is unusable; a chain that reads an unusable entry, or that
/// fails to compile or to run, is left out with its reason and the others compile.
pub fn compile_each(
    config: &Config,
    file: &[ConfigEntry],
    consul: &[ConfigEntry],
) -> CompiledChains {
    compile_each_after(config, file, consul, None)
}

/// [`compile_each`], taking from `previous` (the memo of the composition in force) every chain
/// whose request and entries read did not change ([`ChainMemo`]): the result is the same as
/// compiling every chain again.
pub fn compile_each_after(
    config: &Config,
    file: &[ConfigEntry],
    consul: &[ConfigEntry],
    previous: Option<&ChainMemo>,
) -> CompiledChains {
    let (entries, unusable) = merge(file, consul);
    let mut out = CompiledChains {
        memo: ChainMemo::starting(entries),
        ..CompiledChains::default()
    };
    for svc in &config.services {
        let Some(chain) = &svc.chain else { continue };
        let request = compile_request(config, svc, chain);
        let result = out
            .memo
            .compile(previous, &svc.name, request)
            .and_then(|compiled| {
                runs_in(config, svc, &compiled).map_err(|e| e.to_string())?;
                Ok(compiled)
            })
            .and_then(|compiled| match reads_unusable(&compiled, &unusable) {
                Some(entry) => Err(format!(
                    "it reads {} {:?}, which cannot be used: {}",
                    entry.kind.as_str(),
                    entry.name,
                    entry.reason
                )),
                None => Ok(compiled),
            });
        match result {
            Ok(compiled) => drop(out.chains.insert(svc.name.clone(), compiled)),
            Err(reason) => out.failures.push(ChainFailure {
                service: svc.name.clone(),
                reason: format!("chain {chain:?}: {reason}"),
            }),
        }
    }
    out
}

/// The file's entries plus every Consul entry that is valid and not also in the file; the
/// others, unusable.
fn merge(file: &[ConfigEntry], consul: &[ConfigEntry]) -> (Entries, Vec<UnusableEntry>) {
    let mut entries = Entries::new();
    let mut unusable = Vec::new();
    for entry in file {
        // Validated when the file was loaded; a failure here is a duplicate within the file,
        // which the load refused too.
        if let Err(e) = entries.insert(entry.clone()) {
            unusable.push(unusable_entry(entry, e.to_string()));
        }
    }
    for entry in consul {
        if entries.get(entry.kind(), entry.name()).is_some() {
            unusable.push(unusable_entry(
                entry,
                "it is defined both in the configuration file and in Consul; delete one of them \
                 (neither overrides the other)"
                    .to_owned(),
            ));
            continue;
        }
        if let Err(e) = entries.insert(entry.clone()) {
            unusable.push(unusable_entry(entry, e.to_string()));
        }
    }
    (entries, unusable)
}

fn unusable_entry(entry: &ConfigEntry, reason: String) -> UnusableEntry {
    UnusableEntry {
        kind: entry.kind(),
        name: entry.name().to_owned(),
        reason,
    }
}

/// The first unusable entry `chain` would have read: one named for a service the chain visits,
/// or a proxy-defaults (every chain reads it). A service the chain visits is its own, one a
/// router or splitter node names, or a target's.
fn reads_unusable<'a>(
    chain: &CompiledDiscoveryChain,
    unusable: &'a [UnusableEntry],
) -> Option<&'a UnusableEntry> {
    let mut visited = BTreeSet::from([chain.service_name.as_str()]);
    visited.extend(chain.targets.values().map(|t| t.service.as_str()));
    for node in chain.nodes.values() {
        // Router and splitter nodes are named `<service>.<namespace>.<partition>`.
        let mut parts = node.name.rsplitn(3, '.');
        if let (Some(_), Some(_), Some(service)) = (parts.next(), parts.next(), parts.next()) {
            visited.insert(service);
        }
    }
    unusable
        .iter()
        .find(|u| u.kind == EntryKind::ProxyDefaults || visited.contains(u.name.as_str()))
}

#[cfg(test)]
mod tests;
