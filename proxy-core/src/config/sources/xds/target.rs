//! Where an `api_config_source`'s server is, and its TLS: `server_uri`, a STATIC cluster named
//! by `envoy_grpc` or REST `cluster_names`, or `google_grpc` with its channel credentials.

use super::{
    ApiConfigSource, ApiType, GoogleGrpc, GrpcService, Resolve, TlsSettings, XdsConfigError,
};

pub(super) fn server_uri(
    source: &ApiConfigSource,
    field: &str,
    resolve: &Resolve<'_>,
) -> Result<(String, Option<TlsSettings>), XdsConfigError> {
    let error = |reason: String| XdsConfigError::Server {
        field: field.to_owned(),
        reason,
    };
    if source.tls.is_some() && source.server_uri.is_none() {
        return Err(error(
            "tls applies to server_uri only (google_grpc takes channel_credentials, a named cluster its transport_socket)".into(),
        ));
    }
    unread(source).map_err(|why| error(why.to_owned()))?;
    let (raw, tls) = match &source.server_uri {
        Some(uri) => (uri.clone(), source.tls.clone()),
        None => target(source, resolve).map_err(error)?,
    };
    if let Some(settings) = &tls {
        settings.validate().map_err(|e| error(e.to_string()))?;
    }
    let uri = normalize_uri(&raw, tls.is_some()).map_err(error)?;
    Ok((uri, tls))
}

/// A field `source`'s `api_type` (or its `server_uri`) does not read: refused, never ignored.
fn unread(source: &ApiConfigSource) -> Result<(), &'static str> {
    let rest = source.api_type == ApiType::Rest;
    let targets = !source.grpc_services.is_empty() || !source.cluster_names.is_empty();
    if source.server_uri.is_some() && targets {
        Err("server_uri replaces grpc_services and cluster_names; set one of them")
    } else if rest && !source.grpc_services.is_empty() {
        Err("grpc_services is for GRPC and DELTA_GRPC; REST reads cluster_names")
    } else if !rest && !source.cluster_names.is_empty() {
        Err("cluster_names is for REST; GRPC and DELTA_GRPC read grpc_services")
    } else if !rest && source.refresh_delay.is_some() {
        Err("refresh_delay is REST's polling interval; a gRPC stream is pushed to")
    } else if !rest && source.request_timeout != super::default_request_timeout() {
        Err("request_timeout bounds one REST poll; a gRPC stream has none")
    } else {
        Ok(())
    }
}

/// The address and TLS of `grpc_services` or REST `cluster_names` (no `server_uri`).
fn target(
    source: &ApiConfigSource,
    resolve: &Resolve<'_>,
) -> Result<(String, Option<TlsSettings>), String> {
    let cluster = |name: &str| {
        let (addr, socket) = resolve(name)
            .ok_or_else(|| format!("cluster {name:?} is not a known static cluster"))?;
        let tls = socket
            .map(|s| s.settings())
            .transpose()
            .map_err(|e| format!("cluster {name:?}: {e}"))?;
        Ok((addr.to_string(), tls))
    };
    if source.api_type == ApiType::Rest {
        return match source.cluster_names.as_slice() {
            [name] => cluster(name),
            _ => Err("REST needs server_uri or exactly one cluster_names entry".into()),
        };
    }
    match source.grpc_services.as_slice() {
        [
            GrpcService {
                envoy_grpc: Some(e),
                google_grpc: None,
            },
        ] => cluster(&e.cluster_name),
        [
            GrpcService {
                envoy_grpc: None,
                google_grpc: Some(g),
            },
        ] => Ok((g.target_uri.clone(), google_tls(g)?)),
        [_] => Err("grpc_services[0] must set exactly one of envoy_grpc and google_grpc".into()),
        _ => Err("gRPC needs server_uri or exactly one grpc_services entry".into()),
    }
}

/// `ssl_credentials` as [`TlsSettings`]; `None` without `channel_credentials`.
fn google_tls(google: &GoogleGrpc) -> Result<Option<TlsSettings>, String> {
    let Some(credentials) = &google.channel_credentials else {
        return Ok(None);
    };
    let ssl = &credentials.ssl_credentials;
    let Some(root_certs) = &ssl.root_certs else {
        return Err(
            "google_grpc.channel_credentials.ssl_credentials.root_certs is required: no system trust store is used"
                .into(),
        );
    };
    Ok(Some(TlsSettings {
        ca_file: root_certs.filename.clone(),
        cert_file: ssl.cert_chain.as_ref().map(|d| d.filename.clone()),
        key_file: ssl.private_key.as_ref().map(|d| d.filename.clone()),
        server_name: None,
    }))
}

/// `host:port`, `http://host:port` or (with TLS) `https://host:port` → with its scheme;
/// paths, other schemes, and a scheme that contradicts the TLS settings are refused.
fn normalize_uri(raw: &str, tls: bool) -> Result<String, String> {
    let scheme = if tls { "https" } else { "http" };
    let with_scheme = if raw.contains("://") {
        raw.to_owned()
    } else {
        format!("{scheme}://{raw}")
    };
    let uri: http::Uri = with_scheme
        .parse()
        .map_err(|e| format!("invalid server address {raw:?}: {e}"))?;
    match uri.scheme_str() {
        Some(s) if s == scheme => {}
        Some("https") => {
            return Err(format!(
                "server address {raw:?} is https:// but no TLS is configured: add a tls block (server_uri) or channel_credentials (google_grpc)"
            ));
        }
        Some("http") => {
            return Err(format!(
                "server address {raw:?} is plaintext http:// but TLS is configured: use https://"
            ));
        }
        _ => {
            return Err(format!(
                "server address {raw:?}: the scheme must be http:// or https://"
            ));
        }
    }
    if uri.port_u16().is_none() || uri.path().len() > 1 {
        return Err(format!(
            "server address {raw:?} must be host:port without a path"
        ));
    }
    Ok(with_scheme.trim_end_matches('/').to_owned())
}
