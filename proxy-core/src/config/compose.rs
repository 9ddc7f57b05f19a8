//! One configuration from the file and the dynamic sources' overlays ([`crate::desired`]).
//!
//! The file's clusters, services and config entries come first, then each overlay's in the
//! order given. A name that two sources both define (a cluster, a service, a service's VIP and
//! port, a config entry's kind and name) is refused, naming both sources: no source overrides
//! another. The composition is then validated as a whole, with the rules the file gets, and the
//! chains are compiled from every source's entries.

use std::collections::HashMap;

use super::{ClusterIndex, Config, validate};
use crate::desired::{Overlay, Source};

/// Why the file and the overlays cannot make one configuration. The configuration in force
/// stays.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ComposeError {
    /// Two sources define the same name.
    #[error(
        "{what} is defined by both {first} and {second}: refused (no source overrides another)"
    )]
    Clash {
        /// The resource, e.g. `cluster "web"`.
        what: String,
        /// The source that defined it first (the file before any overlay).
        first: Source,
        /// The source that defined it again.
        second: Source,
    },
    /// The composition breaks a rule the file would be held to.
    #[error("{origin}: {field}: {message}")]
    Invalid {
        /// The source of the resource at fault (the file when the fault is not one resource's).
        origin: Source,
        /// The field, by the resource's name: `clusters["web"].connect_timeout`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// Who defined what, for the clash check and for naming a composed index.
#[derive(Default)]
struct Owners {
    /// Each composed cluster's name and source, in the composed order.
    clusters: Vec<(String, Source)>,
    services: Vec<(String, Source)>,
    /// The same, by name: the clash check at 10,000 resources.
    cluster_names: HashMap<String, Source>,
    service_names: HashMap<String, Source>,
}

impl Config {
    /// This configuration (a validated file) with every overlay's resources added, validated as
    /// a whole and its chains compiled from every source's entries. A chain that Consul's
    /// entries break keeps the one `previous` (the configuration in force) ran, or is left out,
    /// and is listed in `chain_failures`: one bad entry never refuses the rest. `self` is not
    /// changed.
    pub fn compose<'a>(
        &self,
        overlays: impl IntoIterator<Item = (Source, &'a Overlay)>,
        previous: Option<&Config>,
    ) -> Result<Config, ComposeError> {
        let mut composed = self.clone();
        let mut owners = Owners::default();
        for cluster in &self.clusters {
            owners.claim_cluster(&cluster.name, Source::File)?;
        }
        for service in &self.services {
            owners.claim_service(&service.name, Source::File)?;
        }
        // Who defined each entry outside Consul, by kind and name: the clash check stays
        // linear in the entries (Consul's may number tens of thousands).
        let mut entry_owners: HashMap<(proxy_chain::EntryKind, String), Source> = self
            .file_entries
            .iter()
            .map(|e| ((e.kind(), e.name().to_owned()), Source::File))
            .collect();
        let mut entries: Vec<(proxy_chain::ConfigEntry, Source)> = self
            .file_entries
            .iter()
            .map(|e| (e.clone(), Source::File))
            .collect();
        let mut addresses: HashMap<_, Source> = self
            .services
            .iter()
            .map(|s| ((s.address, s.port, s.protocol), Source::File))
            .collect();
        for (source, overlay) in overlays {
            for cluster in overlay.clusters.iter() {
                owners.claim_cluster(&cluster.name, source)?;
            }
            for service in overlay.services.iter() {
                owners.claim_service(&service.name, source)?;
                let addr = (service.address, service.port, service.protocol);
                if let Some(first) = addresses.insert(addr, source)
                    && first != source
                {
                    return Err(ComposeError::Clash {
                        what: format!(
                            "service address {}:{} {:?}",
                            service.address, service.port, service.protocol
                        ),
                        first,
                        second: source,
                    });
                }
            }
            for entry in &overlay.config_entries {
                // A Consul entry the file (or xDS) defines too makes only the chains that read
                // it unusable (`compile_chains`), as an entry Consul accepted that this daemon
                // cannot use does: Consul's entries never refuse a whole composition.
                if source != Source::ConsulEntries {
                    let key = (entry.kind(), entry.name().to_owned());
                    if let Some(&first) = entry_owners.get(&key) {
                        return Err(ComposeError::Clash {
                            what: format!("config entry {:?} {:?}", entry.kind(), entry.name()),
                            first,
                            second: source,
                        });
                    }
                    entry_owners.insert(key, source);
                }
                entries.push((entry.clone(), source));
            }
            composed.clusters.extend(overlay.clusters.iter().cloned());
            composed.services.extend(overlay.services.iter().cloned());
        }
        composed.cluster_index = ClusterIndex::default();
        let at = |invalid: super::error::Invalid| owners.name(invalid);
        validate::validate(&mut composed).map_err(at)?;
        compile_chains(&mut composed, entries, previous);
        super::sources::xds::clusters::validate_xds(&composed).map_err(at)?;
        composed.file_entries = self.file_entries.clone();
        Ok(composed)
    }
}

/// Compiles every chain of `composed` one at a time: the file's and xDS's entries (clashes
/// were refused above) with Consul's (an entry Consul accepted that this daemon cannot use, or
/// that the file defines too, is unusable). A chain that fails keeps the chain `previous` ran
/// for its service while that one still runs here; otherwise its service is left out. Either
/// way it is recorded in `chain_failures`, and the other chains compile.
fn compile_chains(
    composed: &mut Config,
    entries: Vec<(proxy_chain::ConfigEntry, Source)>,
    previous: Option<&Config>,
) {
    let (consul, others): (Vec<_>, Vec<_>) = entries
        .into_iter()
        .partition(|(_, source)| *source == Source::ConsulEntries);
    let strip = |list: Vec<(proxy_chain::ConfigEntry, Source)>| -> Vec<_> {
        list.into_iter().map(|(e, _)| e).collect()
    };
    let compiled = crate::chain::compile_each_after(
        composed,
        &strip(others),
        &strip(consul),
        previous.map(|p| p.chain_memo.as_ref()),
    );
    composed.chains = compiled.chains;
    composed.chain_memo = std::sync::Arc::new(compiled.memo);
    let mut left_out = Vec::new();
    for failure in &compiled.failures {
        let svc = composed.services.iter().find(|s| s.name == failure.service);
        let kept = previous
            .and_then(|p| {
                Some((
                    p.chains.get(&failure.service)?,
                    p.services.iter().find(|s| s.name == failure.service)?,
                ))
            })
            .filter(|(chain, was)| {
                svc.is_some_and(|svc| {
                    was.chain == svc.chain
                        && was.mode == svc.mode
                        && crate::chain::runs_in(composed, svc, chain).is_ok()
                })
            });
        match kept {
            Some((chain, _)) => {
                composed
                    .chains
                    .insert(failure.service.clone(), chain.clone());
            }
            None => left_out.push(failure.service.clone()),
        }
    }
    composed.services.retain(|s| !left_out.contains(&s.name));
    composed.chain_failures = compiled.failures;
}

impl Owners {
    /// Records that `source` defines cluster `name`, refusing a name another source defined.
    fn claim_cluster(&mut self, name: &str, source: Source) -> Result<(), ComposeError> {
        claim(&mut self.cluster_names, "cluster", name, source)?;
        self.clusters.push((name.to_owned(), source));
        Ok(())
    }

    /// As [`Owners::claim_cluster`], for a service.
    fn claim_service(&mut self, name: &str, source: Source) -> Result<(), ComposeError> {
        claim(&mut self.service_names, "service", name, source)?;
        self.services.push((name.to_owned(), source));
        Ok(())
    }

    /// The error with its composed index (`clusters[12]`) replaced by the resource's name and
    /// its source.
    fn name(&self, invalid: super::error::Invalid) -> ComposeError {
        let located = ["clusters", "services"].into_iter().find_map(|list| {
            let rest = invalid.field.strip_prefix(list)?.strip_prefix('[')?;
            let (index, tail) = rest.split_once(']')?;
            let owners = if list == "clusters" {
                &self.clusters
            } else {
                &self.services
            };
            let (name, source) = owners.get(index.parse::<usize>().ok()?)?;
            Some((format!("{list}[{name:?}]{tail}"), *source))
        });
        let (field, source) = located.unwrap_or((invalid.field, Source::File));
        ComposeError::Invalid {
            origin: source,
            field,
            message: invalid.message,
        }
    }
}

/// Records `name` for `source` in `names`, refusing a name another source defined (a name
/// the file repeats is left to validation, which names its position).
fn claim(
    names: &mut HashMap<String, Source>,
    kind: &str,
    name: &str,
    source: Source,
) -> Result<(), ComposeError> {
    match names.get(name) {
        Some(&first) if first != source => Err(ComposeError::Clash {
            what: format!("{kind} {name:?}"),
            first,
            second: source,
        }),
        Some(_) => Ok(()),
        None => {
            names.insert(name.to_owned(), source);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests;
