//! Consul's discovery chain: config entries, validation and compilation.
//!
//! * [`entries`]: `service-defaults`, `proxy-defaults`, `service-router`, `service-splitter` and
//!   `service-resolver` entries in Consul's JSON/YAML shape, and the [`Entries`] set.
//! * [`validate`]: Consul's `Validate()` rules and error texts.
//! * [`filter`]: subset filter expressions (the go-bexpr subset Consul users write).
//! * [`compile`]: Consul's chain compiler; [`output`] is its `CompiledDiscoveryChain` JSON shape.
//! * [`legs`]: a compiled chain flattened into weighted legs for the data path.
//!
//! Behaviour follows Consul CE (see `compile` for tenancy and the customization hash).
//!
//! Known differences from Consul: `CustomizationHash` is FNV-1a, not `hashstructure`, so its
//! value differs; subset filters are checked against a fixed selector set when validated (Consul
//! only parses them then, and rejects bad selectors at query time); map-valued entry fields
//! (subsets, failover) are validated in sorted order, so with several errors the first one
//! reported may differ; `Meta` size limits, service-defaults/proxy-defaults field checks and
//! peer locality are not implemented.
#![forbid(unsafe_code)]

pub mod compile;
pub mod duration;
pub mod entries;
pub mod error;
pub mod filter;
pub mod legs;
pub mod output;
mod quote;
pub mod validate;

pub use crate::{
    compile::{CompileRequest, EntryReads, compile, compile_reading},
    duration::GoDuration,
    entries::{ConfigEntry, Entries, EntryKind, MeshGatewayMode},
    error::{ChainError, ValidationError},
    filter::{Filter, Host},
    legs::{Leg, RouteLegs, TargetLeg},
    output::CompiledDiscoveryChain,
};

/// Trust domain used by [`compile_json_cli`] when the caller has no CA to take one from.
pub const DEFAULT_TRUST_DOMAIN: &str = "consul";

/// The `--override-*` options of `proxy chain compile`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--override-protocol`: empty for none.
    pub protocol: String,
    /// `--override-connect-timeout`: zero for none.
    pub connect_timeout: GoDuration,
    /// `--override-mesh-gateway`: `Default` for none.
    pub mesh_gateway: MeshGatewayMode,
    /// Trust domain for SNI names; empty means [`DEFAULT_TRUST_DOMAIN`].
    pub trust_domain: String,
}

/// What `proxy chain compile --entries FILE --service NAME --datacenter DC` prints: parses
/// `entries_json` (a JSON array of entries in Consul's API shape), validates, compiles in the
/// `default` namespace and partition, and returns the chain as pretty-printed JSON.
pub fn compile_json_cli(
    entries_json: &str,
    service: &str,
    datacenter: &str,
    overrides: Overrides,
) -> Result<String, ChainError> {
    let entries = Entries::from_json(entries_json)?;
    let trust_domain = if overrides.trust_domain.is_empty() {
        DEFAULT_TRUST_DOMAIN
    } else {
        overrides.trust_domain.as_str()
    };
    let request = CompileRequest {
        override_protocol: overrides.protocol,
        override_connect_timeout: overrides.connect_timeout,
        override_mesh_gateway: overrides.mesh_gateway,
        ..CompileRequest::new(service, datacenter, trust_domain)
    };
    let chain = compile(&request, &entries)?;
    serde_json::to_string_pretty(&chain).map_err(ChainError::Serialize)
}
