//! Decoding a response's resources by name and applying them to the held set of their type.

use std::{collections::BTreeMap, sync::Arc};

use envoy_types::pb::{
    envoy::config::{
        cluster::v3::Cluster as ProtoCluster, listener::v3::Listener, route::v3::RouteConfiguration,
    },
    google::protobuf::Any,
};
use prost::Message;

use super::ResponseError;
use crate::discovery::xds::{
    cds::{self, CLUSTER_TYPE_URL},
    hcm::{self, ROUTE_TYPE_URL, RouteTable},
    lds::{self, LISTENER_TYPE_URL},
    listener::ListenerForm,
};

/// The held CDS, LDS and RDS resources, checked and kept as one.
#[derive(Clone, Debug, Default)]
pub(super) struct Sets {
    /// Each cluster's file form as compact JSON text: what the file's rules check, shared by
    /// every set that holds it (a parsed form costs about 25 times its text, and every
    /// response copies the sets).
    pub(super) clusters: BTreeMap<String, Held<Arc<str>>>,
    pub(super) listeners: BTreeMap<String, Held<ListenerForm>>,
    pub(super) routes: BTreeMap<String, Held<RouteTable>>,
}

/// The resources of a response: index, name (delta), version, body.
pub(super) type Named<'a> = Vec<(usize, Option<String>, String, &'a Any)>;

impl Sets {
    /// The sets after a response of `type_url` (`whole`: state of the world).
    pub(super) fn next(
        &self,
        type_url: &str,
        resources: Named,
        removed: &[String],
        whole: bool,
    ) -> Result<Self, ResponseError> {
        let mut next = self.clone();
        match type_url {
            CLUSTER_TYPE_URL => update(
                &mut next.clusters,
                resources,
                removed,
                whole,
                type_url,
                decode_cluster,
            ),
            ROUTE_TYPE_URL => update(
                &mut next.routes,
                resources,
                removed,
                whole,
                type_url,
                decode_route,
            ),
            _ => update(
                &mut next.listeners,
                resources,
                removed,
                whole,
                type_url,
                decode_listener,
            ),
        }?;
        Ok(next)
    }
}

/// A held resource: its version and its file form.
#[derive(Clone, Debug)]
pub(super) struct Held<T> {
    pub(super) version: String,
    pub(super) form: T,
}

pub(super) fn versions<T>(
    held: &BTreeMap<String, Held<T>>,
) -> std::collections::HashMap<String, String> {
    held.iter()
        .map(|(n, h)| (n.clone(), h.version.clone()))
        .collect()
}

/// Decodes one resource (its index in the response) into its name and file form.
pub(super) type Decode<T> = fn(&Any, usize) -> Result<(String, T), ResponseError>;

/// Applies decoded resources (and removals) to `set`: `whole` replaces it.
fn update<T>(
    set: &mut BTreeMap<String, Held<T>>,
    resources: Named,
    removed: &[String],
    whole: bool,
    type_url: &str,
    decode: Decode<T>,
) -> Result<(), ResponseError> {
    let kind = match type_url {
        CLUSTER_TYPE_URL => "cluster",
        ROUTE_TYPE_URL => "route configuration",
        _ => "listener",
    };
    let next = decode_each(resources, type_url, kind, decode)?;
    for name in removed {
        if next.contains_key(name) {
            return Err(ResponseError::Duplicate {
                kind,
                name: name.clone(),
            });
        }
    }
    if whole {
        *set = next;
    } else {
        for name in removed {
            set.remove(name);
        }
        set.extend(next);
    }
    Ok(())
}

/// Decodes every resource of a response, by name; refuses another type and a name twice.
fn decode_each<T>(
    resources: Named,
    type_url: &str,
    kind: &'static str,
    decode: Decode<T>,
) -> Result<BTreeMap<String, Held<T>>, ResponseError> {
    let mut next = BTreeMap::new();
    for (index, name, version, any) in resources {
        if any.type_url != type_url {
            return Err(ResponseError::TypeUrl {
                expected: type_url.to_owned(),
                found: any.type_url.clone(),
                index,
            });
        }
        let (inner, form) = decode(any, index)?;
        if let Some(name) = name.filter(|n| *n != inner) {
            return Err(ResponseError::NameMismatch { kind, name, inner });
        }
        if next.insert(inner.clone(), Held { version, form }).is_some() {
            return Err(ResponseError::Duplicate { kind, name: inner });
        }
    }
    Ok(next)
}

fn decode_cluster(any: &Any, index: usize) -> Result<(String, Arc<str>), ResponseError> {
    let cluster =
        ProtoCluster::decode(any.value.as_slice()).map_err(|source| ResponseError::Decode {
            type_url: CLUSTER_TYPE_URL.to_owned(),
            index,
            source,
        })?;
    let form = cds::file_form(&cluster)?.to_string();
    Ok((cluster.name.clone(), Arc::from(form)))
}

fn decode_listener(any: &Any, index: usize) -> Result<(String, ListenerForm), ResponseError> {
    let listener =
        Listener::decode(any.value.as_slice()).map_err(|source| ResponseError::Decode {
            type_url: LISTENER_TYPE_URL.to_owned(),
            index,
            source,
        })?;
    Ok((listener.name.clone(), lds::file_form(&listener)?))
}

fn decode_route(any: &Any, index: usize) -> Result<(String, RouteTable), ResponseError> {
    let config = RouteConfiguration::decode(any.value.as_slice()).map_err(|source| {
        ResponseError::Decode {
            type_url: ROUTE_TYPE_URL.to_owned(),
            index,
            source,
        }
    })?;
    Ok((config.name.clone(), hcm::route_table(&config)?))
}
