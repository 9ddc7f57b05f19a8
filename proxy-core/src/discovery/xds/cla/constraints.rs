//! The proto validation rules of a `ClusterLoadAssignment` (protoc-gen-validate's, which Envoy
//! applies as it decodes a resource), checked in field-number order with Envoy's texts.

use std::fmt;

use envoy_types::pb::envoy::config::{
    core::v3::{Address, address, socket_address::PortSpecifier},
    endpoint::v3::{ClusterLoadAssignment, lb_endpoint::HostIdentifier},
};

use super::{ClaError, MAX_PRIORITY};
use crate::health::drop_overload::Denominator;

/// A broken proto validation rule and where: Displays as Envoy's chain of
/// `<Type>ValidationError.<Field>` steps from the assignment down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Index in `endpoints`, when the rule is inside a locality.
    pub locality: Option<usize>,
    /// Index in that locality's `lb_endpoints`, when the rule is inside an endpoint.
    pub lb_endpoint: Option<usize>,
    /// The rule.
    pub rule: Rule,
}

/// The proto validation rules a `ClusterLoadAssignment` can break.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `cluster_name` is empty (`min_len: 1`).
    EmptyClusterName,
    /// A locality's `load_balancing_weight` is 0 (`gte: 1`).
    LocalityWeight,
    /// A locality's `priority` is above [`MAX_PRIORITY`] (`lte: 128`).
    Priority,
    /// An endpoint's `load_balancing_weight` is 0 (`gte: 1`).
    EndpointWeight,
    /// An `Address` with none of its kinds set (oneof `required`).
    AddressKind,
    /// A socket address with an empty `address` (`min_len: 1`).
    EmptyIp,
    /// A socket address without `port_value` or `named_port` (oneof `required`).
    PortSpecifier,
    /// `port_value` above 65535 (`lte: 65535`).
    PortRange,
    /// `health_check_config.port_value` above 65535 (`lte: 65535`).
    HealthCheckPort,
    /// `policy.overprovisioning_factor` is 0 (`gt: 0`).
    OverprovisioningFactor,
    /// `policy.endpoint_stale_after` is 0 or negative (`duration.gt: {}`).
    EndpointStaleAfter,
    /// `policy.drop_overloads[i].category` is empty (`min_len: 1`).
    DropCategory(usize),
    /// `policy.drop_overloads[i].drop_percentage.denominator` is not a defined value
    /// (`defined_only`).
    DropDenominator(usize),
}

const EMBEDDED: &str = "embedded message failed validation | caused by ";

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(index) = self.locality {
            write!(
                f,
                "ClusterLoadAssignmentValidationError.Endpoints[{index}]: {EMBEDDED}"
            )?;
        }
        if let Some(index) = self.lb_endpoint {
            write!(
                f,
                "LocalityLbEndpointsValidationError.LbEndpoints[{index}]: {EMBEDDED}"
            )?;
        }
        let address = format!(
            "LbEndpointValidationError.Endpoint: {EMBEDDED}EndpointValidationError.Address: {EMBEDDED}"
        );
        let socket = format!("{address}AddressValidationError.SocketAddress: {EMBEDDED}");
        let drop = format!(
            "ClusterLoadAssignmentValidationError.Policy: {EMBEDDED}PolicyValidationError.DropOverloads"
        );
        match self.rule {
            Rule::EmptyClusterName => f.write_str(
                "ClusterLoadAssignmentValidationError.ClusterName: value length must be at least 1 characters",
            ),
            Rule::LocalityWeight => f.write_str(
                "LocalityLbEndpointsValidationError.LoadBalancingWeight: value must be greater than or equal to 1",
            ),
            Rule::Priority => write!(
                f,
                "LocalityLbEndpointsValidationError.Priority: value must be less than or equal to {MAX_PRIORITY}"
            ),
            Rule::EndpointWeight => f.write_str(
                "LbEndpointValidationError.LoadBalancingWeight: value must be greater than or equal to 1",
            ),
            Rule::AddressKind => write!(f, "{address}field: \"address\", reason: is required"),
            Rule::EmptyIp => write!(
                f,
                "{socket}SocketAddressValidationError.Address: value length must be at least 1 characters"
            ),
            Rule::PortSpecifier => {
                write!(f, "{socket}field: \"port_specifier\", reason: is required")
            }
            Rule::PortRange => write!(
                f,
                "{socket}SocketAddressValidationError.PortValue: value must be less than or equal to 65535"
            ),
            Rule::OverprovisioningFactor => write!(
                f,
                "ClusterLoadAssignmentValidationError.Policy: {EMBEDDED}PolicyValidationError.OverprovisioningFactor: value must be greater than 0"
            ),
            Rule::EndpointStaleAfter => write!(
                f,
                "ClusterLoadAssignmentValidationError.Policy: {EMBEDDED}PolicyValidationError.EndpointStaleAfter: value must be greater than 0s"
            ),
            Rule::DropCategory(i) => write!(
                f,
                "{drop}[{i}]: {EMBEDDED}DropOverloadValidationError.Category: value length must be at least 1 characters"
            ),
            Rule::DropDenominator(i) => write!(
                f,
                "{drop}[{i}]: {EMBEDDED}DropOverloadValidationError.DropPercentage: {EMBEDDED}FractionalPercentValidationError.Denominator: value must be one of the defined enum values"
            ),
            Rule::HealthCheckPort => write!(
                f,
                "LbEndpointValidationError.Endpoint: {EMBEDDED}EndpointValidationError.HealthCheckConfig: {EMBEDDED}HealthCheckConfigValidationError.PortValue: value must be less than or equal to 65535"
            ),
        }
    }
}

pub(super) fn violation(
    locality: Option<usize>,
    lb_endpoint: Option<usize>,
    rule: Rule,
) -> ClaError {
    ClaError::Constraint {
        violation: Violation {
            locality,
            lb_endpoint,
            rule,
        },
    }
}

/// Checks the proto validation rules, in field-number order (the first broken rule is
/// reported, as Envoy does).
pub fn check_constraints(cla: &ClusterLoadAssignment) -> Result<(), ClaError> {
    if cla.cluster_name.is_empty() {
        return Err(violation(None, None, Rule::EmptyClusterName));
    }
    for (index, locality) in cla.endpoints.iter().enumerate() {
        for (lb_index, lb_endpoint) in locality.lb_endpoints.iter().enumerate() {
            let broken = |rule| violation(Some(index), Some(lb_index), rule);
            if let Some(HostIdentifier::Endpoint(endpoint)) = &lb_endpoint.host_identifier
                && let Some(address) = &endpoint.address
            {
                check_address(address).map_err(broken)?;
            }
            if let Some(HostIdentifier::Endpoint(endpoint)) = &lb_endpoint.host_identifier
                && let Some(check) = &endpoint.health_check_config
            {
                if check.port_value > u32::from(u16::MAX) {
                    return Err(broken(Rule::HealthCheckPort));
                }
                if let Some(address) = &check.address {
                    check_address(address).map_err(broken)?;
                }
            }
            if lb_endpoint
                .load_balancing_weight
                .is_some_and(|w| w.value == 0)
            {
                return Err(broken(Rule::EndpointWeight));
            }
        }
        if locality.load_balancing_weight.is_some_and(|w| w.value == 0) {
            return Err(violation(Some(index), None, Rule::LocalityWeight));
        }
        if locality.priority > MAX_PRIORITY {
            return Err(violation(Some(index), None, Rule::Priority));
        }
    }
    let drops = cla.policy.iter().flat_map(|p| &p.drop_overloads);
    for (index, drop) in drops.enumerate() {
        if drop.category.is_empty() {
            return Err(violation(None, None, Rule::DropCategory(index)));
        }
        let denominator = drop.drop_percentage.as_ref().map_or(0, |p| p.denominator);
        if Denominator::from_proto(denominator).is_none() {
            return Err(violation(None, None, Rule::DropDenominator(index)));
        }
    }
    let factor = cla.policy.as_ref().and_then(|p| p.overprovisioning_factor);
    if factor.is_some_and(|f| f.value == 0) {
        return Err(violation(None, None, Rule::OverprovisioningFactor));
    }
    let stale = cla.policy.as_ref().and_then(|p| p.endpoint_stale_after);
    if stale.is_some_and(|d| d.seconds < 0 || (d.seconds == 0 && d.nanos <= 0)) {
        return Err(violation(None, None, Rule::EndpointStaleAfter));
    }
    Ok(())
}

pub(super) fn check_address(address: &Address) -> Result<(), Rule> {
    match &address.address {
        None => Err(Rule::AddressKind),
        Some(address::Address::SocketAddress(socket)) => {
            if socket.address.is_empty() {
                return Err(Rule::EmptyIp);
            }
            match socket.port_specifier {
                None => Err(Rule::PortSpecifier),
                Some(PortSpecifier::PortValue(port)) if port > u32::from(u16::MAX) => {
                    Err(Rule::PortRange)
                }
                Some(_) => Ok(()),
            }
        }
        Some(_) => Ok(()),
    }
}
