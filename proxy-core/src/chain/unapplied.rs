//! Fields a compiled chain carries that neither path applies: a split's header changes, a
//! resolver's `RequestTimeout` (Consul 1.15's, which this daemon's routes do not read), a
//! failover `Policy` ordering by locality, and `EnvoyExtensions`. A chain that carries one does not run (only that chain, as any chain
//! that cannot run), rather than run without it.

use proxy_chain::CompiledDiscoveryChain;

use super::ChainExecError;

/// The first field of `compiled` that this daemon would not apply, as an error.
pub(super) fn refuse_unapplied(compiled: &CompiledDiscoveryChain) -> Result<(), ChainExecError> {
    let unapplied = |node: &str, field, advice| ChainExecError::Unapplied {
        node: node.to_owned(),
        field,
        advice,
    };
    if !compiled.envoy_extensions.is_empty() {
        return Err(unapplied(
            "service-defaults or proxy-defaults",
            "EnvoyExtensions",
            "they extend Envoy sidecars, and this daemon runs none; remove them",
        ));
    }
    for (key, node) in &compiled.nodes {
        let split = node.splits.iter().find_map(|s| {
            let d = &s.definition;
            let request = d
                .request_headers
                .as_ref()
                .map(|_| "Splits[].RequestHeaders");
            request.or_else(|| {
                d.response_headers
                    .as_ref()
                    .map(|_| "Splits[].ResponseHeaders")
            })
        });
        if let Some(field) = split {
            return Err(unapplied(
                key,
                field,
                "set header changes on a service-router route's Destination",
            ));
        }
        let policy = node
            .resolver
            .as_ref()
            .and_then(|r| r.failover.as_ref()?.policy.as_ref());
        if policy.is_some_and(|p| p.mode == "order-by-locality" || !p.regions.is_empty()) {
            return Err(unapplied(
                key,
                "Failover Policy order-by-locality",
                "failover goes to the targets in the order listed; list them in the order wanted",
            ));
        }
        if node
            .resolver
            .as_ref()
            .is_some_and(|r| !r.request_timeout.is_zero())
        {
            return Err(unapplied(
                key,
                "RequestTimeout",
                "set RequestTimeout on a service-router route's Destination",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;

    const HEAD: &str = "clusters:\n  - name: web\n  - name: canary\nconfig_entries:\n  - { Kind: service-defaults, Name: web, Protocol: http }\n  - { Kind: service-defaults, Name: canary, Protocol: http }\n";

    fn chain_error(entry: &str, mode: &str) -> String {
        let text = format!(
            "{HEAD}  - {entry}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web, mode: {mode} }}\n"
        );
        let err = Config::parse(&text, Path::new("t.yaml")).expect_err(entry);
        assert_eq!(err.field(), Some("services[0].chain"), "{err}");
        err.to_string()
    }

    #[test]
    fn a_chain_carrying_what_neither_path_applies_is_refused_naming_it() {
        let splitter = "{ Kind: service-splitter, Name: web, Splits: [{ Weight: 50 }, { Weight: 50, Service: canary, REQUEST }] }";
        for mode in ["direct", "proxy"] {
            for (entry, says) in [
                (
                    splitter.replace("REQUEST", "RequestHeaders: { Set: { x-canary: '1' } }"),
                    "splitter:web.default.default: Splits[].RequestHeaders is not applied by this daemon",
                ),
                (
                    splitter.replace("REQUEST", "ResponseHeaders: { Remove: [server] }"),
                    "Splits[].ResponseHeaders is not applied",
                ),
                (
                    "{ Kind: service-resolver, Name: web, RequestTimeout: 5s }".to_owned(),
                    "resolver:web.default.default.dc1: RequestTimeout is not applied by this daemon; set RequestTimeout on a service-router route's Destination",
                ),
                (
                    "{ Kind: proxy-defaults, Name: global, FailoverPolicy: { Regions: [eu] } }\n  - { Kind: service-resolver, Name: web, Failover: { '*': { Service: canary } } }".to_owned(),
                    "resolver:web.default.default.dc1: Failover Policy order-by-locality is not applied",
                ),
                (
                    "{ Kind: proxy-defaults, Name: global, EnvoyExtensions: [{ Name: builtin/lua }] }".to_owned(),
                    "EnvoyExtensions is not applied by this daemon",
                ),
            ] {
                let text = chain_error(&entry, mode);
                assert!(text.contains(says), "{mode} {entry}: {text}");
            }
        }
    }
}
