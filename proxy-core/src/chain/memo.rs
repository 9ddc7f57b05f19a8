//! What the last composition compiled, so that the next one compiles only the chains whose
//! entries changed.
//!
//! A chain's compilation depends on its request (service, datacenter, options) and on the
//! entries it looked up, found or not ([`proxy_chain::EntryReads`]): a service-splitter moved
//! by `consul config write` changes the chains that read that splitter, and no other. Each
//! chain's result (compiled, or Consul's compiler error) is kept with its request and its
//! reads; the next composition takes it again when the request is the same and every entry read
//! is the same in the new set, and compiles the chain otherwise. Whether the chain can run
//! here (its clusters, its path) and whether it reads an unusable entry are checked on every
//! composition, as before: they depend on the rest of the configuration.

use std::{collections::HashMap, sync::Arc};

use proxy_chain::{CompileRequest, CompiledDiscoveryChain, Entries, EntryReads};

/// One chain's last compilation.
#[derive(Clone)]
struct Compiled {
    request: CompileRequest,
    reads: EntryReads,
    /// The compiled chain, or the text of Consul's compiler error.
    result: Result<Arc<CompiledDiscoveryChain>, String>,
}

/// The entries a composition compiled its chains from, and each chain's compilation, by
/// service name.
#[derive(Clone, Default)]
pub struct ChainMemo {
    entries: Arc<Entries>,
    chains: HashMap<String, Compiled>,
    /// How many chains this composition compiled (the rest were taken from the last one).
    compiled: usize,
}

/// Opaque: a cache, not configuration (two configurations that differ only in how their chains
/// were reached look alike).
impl std::fmt::Debug for ChainMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainMemo").finish_non_exhaustive()
    }
}

impl ChainMemo {
    /// An empty memo for a composition that compiles from `entries`.
    pub(super) fn starting(entries: Entries) -> Self {
        ChainMemo {
            entries: Arc::new(entries),
            chains: HashMap::new(),
            compiled: 0,
        }
    }

    /// The chain of `service` for `request`: `previous`'s result when its request was the same
    /// and it read nothing that differs in this memo's entries, else a new compilation. Either
    /// way it is kept here for the next composition.
    pub(super) fn compile(
        &mut self,
        previous: Option<&ChainMemo>,
        service: &str,
        request: CompileRequest,
    ) -> Result<CompiledDiscoveryChain, String> {
        let kept = previous
            .and_then(|p| Some((p, p.chains.get(service)?)))
            .filter(|(p, last)| {
                last.request == request && last.reads.same_in(&p.entries, &self.entries)
            })
            .map(|(_, last)| last.clone());
        let compiled = kept.unwrap_or_else(|| {
            self.compiled += 1;
            let (result, reads) = proxy_chain::compile_reading(&request, &self.entries);
            Compiled {
                request,
                reads,
                result: result.map(Arc::new).map_err(|e| e.to_string()),
            }
        });
        let result = compiled.result.clone();
        self.chains.insert(service.to_owned(), compiled);
        result.map(Arc::unwrap_or_clone)
    }

    /// How many chains the composition that made this memo compiled; the others it took from
    /// the one before.
    pub fn compiled(&self) -> usize {
        self.compiled
    }
}

#[cfg(test)]
mod tests;
