//! Starting one control-plane connection: its state, its stream or poll task, and its
//! `initial_fetch_timeout` timer.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use tokio::sync::{Notify, watch};

use super::{
    Backoff, ClusterStats, ControlPlaneStats, EdsClient, Output,
    grpc::{self, GrpcSubscription},
    node,
    resources::ResourceState,
    rest::{self, RestSubscription},
    state::{self, EdsState, Sink},
};
use crate::{
    config::sources::xds::{EdsWatch, GrpcApi, Transport, XdsConfigError, XdsSource},
    discovery::SourceUpdate,
};

/// Starts the subscriptions of `watches` on `source`. Must be called within a tokio runtime.
/// A cluster name may appear once; several clusters may share a resource name.
pub fn spawn_eds(source: XdsSource, watches: Vec<EdsWatch>) -> Result<EdsClient, XdsConfigError> {
    spawn_eds_within(source, watches, None)
}

/// [`spawn_eds`], NACKing an assignment with more hosts than `maps` take (`None`: no limit).
pub fn spawn_eds_within(
    source: XdsSource,
    watches: Vec<EdsWatch>,
    maps: Option<crate::config::MapSizes>,
) -> Result<EdsClient, XdsConfigError> {
    spawn(source, watches, maps, None)
}

/// [`spawn_eds_within`] on an ADS `source` that also subscribes CDS and LDS into `resources`
/// (which publishes the accepted clusters and listeners on its feed). Refused for a source
/// that is not ADS over gRPC.
pub fn spawn_ads(
    source: XdsSource,
    watches: Vec<EdsWatch>,
    maps: Option<crate::config::MapSizes>,
    resources: ResourceState,
) -> Result<EdsClient, XdsConfigError> {
    if !matches!(
        source.transport,
        Transport::Grpc {
            api: GrpcApi::Aggregated,
            ..
        }
    ) {
        return Err(XdsConfigError::Server {
            field: "ads_config".into(),
            reason: "CDS and LDS come over ADS only (api_type GRPC or DELTA_GRPC)".into(),
        });
    }
    spawn(source, watches, maps, Some(Arc::new(Mutex::new(resources))))
}

fn spawn(
    source: XdsSource,
    watches: Vec<EdsWatch>,
    maps: Option<crate::config::MapSizes>,
    resources: Option<Arc<Mutex<ResourceState>>>,
) -> Result<EdsClient, XdsConfigError> {
    let mut outputs = BTreeMap::new();
    let mut sinks = Vec::new();
    for watch in watches {
        let (tx, rx) = watch::channel(SourceUpdate::default());
        let stats = Arc::new(ClusterStats::default());
        let output = Output {
            rx,
            stats: Arc::clone(&stats),
            resource: watch.resource.clone(),
        };
        if outputs.insert(watch.cluster.clone(), output).is_some() {
            return Err(XdsConfigError::Server {
                field: format!("clusters.{}", watch.cluster),
                reason: "cluster subscribed twice on one connection".into(),
            });
        }
        let cluster = watch.cluster;
        sinks.push((watch.resource, Sink { cluster, tx, stats }));
    }
    let state = Arc::new(Mutex::new(EdsState::new(sinks).within(maps)));
    let control = Arc::new(ControlPlaneStats::default());
    let resources_changed = Arc::new(Notify::new());
    let kept_source = source.clone();
    let backoff = Backoff::new(source.backoff.0, source.backoff.1);
    let node = node::to_proto(&source.node);
    let tls = source.tls.map(Arc::new);
    let main = match source.transport {
        Transport::Grpc { uri, api, delta } => {
            let sub = GrpcSubscription {
                uri,
                api,
                delta,
                node,
                tls: tls.clone(),
                state: Arc::clone(&state),
                resources: resources.clone(),
                control: Arc::clone(&control),
                resources_changed: Arc::clone(&resources_changed),
            };
            tokio::spawn(grpc::run(sub, backoff))
        }
        Transport::Rest {
            uri,
            refresh_delay,
            request_timeout,
        } => {
            let sub = RestSubscription {
                uri,
                refresh_delay,
                request_timeout,
                node: source.node,
                tls,
                state: Arc::clone(&state),
                control: Arc::clone(&control),
            };
            tokio::spawn(rest::run(sub, backoff))
        }
    };
    let leases = grpc::lock(&state).leases();
    let lease_watch = tokio::spawn(state::watch_leases(Arc::clone(&state), leases));
    let mut tasks = vec![main.abort_handle(), lease_watch.abort_handle()];
    if !source.initial_fetch_timeout.is_zero() {
        let timeout = source.initial_fetch_timeout;
        let timed = Arc::clone(&state);
        let timer = tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            grpc::lock(&timed).on_init_timeout();
        });
        tasks.push(timer.abort_handle());
    }
    Ok(EdsClient {
        source: kept_source,
        outputs: Mutex::new(outputs),
        state,
        resources_changed,
        resources,
        control,
        tasks,
    })
}
