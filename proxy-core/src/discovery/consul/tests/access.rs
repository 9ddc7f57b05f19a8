//! Address and token from config, then `CONSUL_HTTP_*`, then Consul's defaults; the token never
//! shows in Debug, a serialization or an error.

use std::{collections::HashMap, path::PathBuf};

use super::*;
use crate::config::sources::consul::{
    ConsulConfigError,
    access::{Access, TokenOrigin, TokenSource, resolve},
};

fn resolve_in(config: &ConsulConfig, vars: &[(&str, &str)]) -> Result<Access, ConsulConfigError> {
    let env: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    resolve(config, &|name| env.get(name).cloned())
}

fn token(text: &str) -> ConsulToken {
    ConsulToken::new(text).expect("valid token")
}

#[test]
fn the_config_wins_over_the_environment_which_wins_over_the_default() {
    let env = [
        ("CONSUL_HTTP_ADDR", "http://10.0.0.1:8500"),
        ("CONSUL_HTTP_TOKEN", "from-env"),
    ];
    let mut config = ConsulConfig::new("web");
    let from_env = resolve_in(&config, &env).expect("env");
    assert_eq!(from_env.authority, "10.0.0.1:8500");
    assert_eq!(
        from_env.token,
        TokenSource::Fixed(token("from-env"), TokenOrigin::Env)
    );
    config.address = Some("127.0.0.1:18500".to_owned());
    config.token = Some(token("from-config"));
    let explicit = resolve_in(&config, &env).expect("config");
    assert_eq!(explicit.authority, "127.0.0.1:18500");
    assert_eq!(
        explicit.token,
        TokenSource::Fixed(token("from-config"), TokenOrigin::Config)
    );
    let empty_vars = resolve_in(&ConsulConfig::new("web"), &[("CONSUL_HTTP_ADDR", "")]);
    let default = empty_vars.expect("an empty variable is unset");
    assert_eq!(
        (default.authority.as_str(), default.token),
        ("127.0.0.1:8500", TokenSource::None)
    );
}

#[test]
fn the_token_file_variable_wins_and_falls_back_to_the_token_variable_when_empty() {
    let dir = std::env::temp_dir().join(format!("proxy-consul-access-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("token");
    std::fs::write(&file, "\n").expect("write");
    let path = file.to_str().expect("utf-8 path");
    let env = [
        ("CONSUL_HTTP_TOKEN_FILE", path),
        ("CONSUL_HTTP_TOKEN", "env-token"),
    ];
    let access = resolve_in(&ConsulConfig::new("web"), &env).expect("env");
    let read = access.token.read().expect("readable");
    assert_eq!(read, Some((token("env-token"), TokenOrigin::Env)));
    std::fs::write(&file, "file-token\n").expect("write");
    let read = access.token.read().expect("readable");
    let origin = TokenOrigin::EnvFile(PathBuf::from(path));
    assert_eq!(read, Some((token("file-token"), origin)));
    std::fs::write(&file, "two words").expect("write");
    let err = access.token.read().expect_err("not a header value");
    assert!(!err.to_string().contains("two words"), "{err}");
    assert!(err.to_string().contains(path), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn https_takes_the_tls_variables_and_http_never_turns_it_off() {
    let env = [
        ("CONSUL_HTTP_ADDR", "http://127.0.0.1:8501"),
        ("CONSUL_HTTP_SSL", "true"),
        ("CONSUL_CACERT", "/etc/consul/ca.pem"),
        ("CONSUL_CLIENT_CERT", "/etc/consul/client.pem"),
        ("CONSUL_CLIENT_KEY", "/etc/consul/client-key.pem"),
        ("CONSUL_TLS_SERVER_NAME", "server.dc1.consul"),
    ];
    let access = resolve_in(&ConsulConfig::new("web"), &env).expect("https");
    let tls = access.tls.expect("tls");
    assert_eq!(access.authority, "127.0.0.1:8501");
    assert_eq!(tls.ca_file, PathBuf::from("/etc/consul/ca.pem"));
    assert_eq!(
        tls.key_file,
        Some(PathBuf::from("/etc/consul/client-key.pem"))
    );
    assert_eq!(tls.server_name.as_deref(), Some("server.dc1.consul"));
    let plain = resolve_in(&ConsulConfig::new("web"), &env[..1]).expect("http");
    assert_eq!(plain.tls, None);
}

#[test]
fn schemes_and_bad_variables_are_refused_with_the_source_named() {
    let config = ConsulConfig::new("web");
    let err = |vars: &[(&str, &str)]| resolve_in(&config, vars).expect_err("refused");
    assert!(matches!(
        err(&[("CONSUL_HTTP_ADDR", "unix:///run/consul.sock")]),
        ConsulConfigError::Scheme {
            field: "CONSUL_HTTP_ADDR",
            ..
        }
    ));
    let https = err(&[("CONSUL_HTTP_ADDR", "https://127.0.0.1:8501")]);
    assert!(matches!(https, ConsulConfigError::NoCa), "{https}");
    let ssl = err(&[("CONSUL_HTTP_SSL", "true")]);
    assert!(matches!(ssl, ConsulConfigError::NoCa), "{ssl}");
    let half = err(&[
        ("CONSUL_HTTP_SSL", "1"),
        ("CONSUL_CACERT", "/ca.pem"),
        ("CONSUL_CLIENT_CERT", "/c.pem"),
    ]);
    assert!(matches!(half, ConsulConfigError::TlsPair { .. }), "{half}");
    let ssl = err(&[("CONSUL_HTTP_SSL", "yes")]);
    assert!(matches!(ssl, ConsulConfigError::SslEnv { .. }), "{ssl}");
    assert!(matches!(
        err(&[("CONSUL_HTTP_ADDR", "127.0.0.1:8500/prefix")]),
        ConsulConfigError::Address {
            field: "CONSUL_HTTP_ADDR",
            ..
        }
    ));
    let bad = err(&[("CONSUL_HTTP_TOKEN", "a b\r\nX-Injected: 1")]);
    assert!(matches!(bad, ConsulConfigError::TokenEnv), "{bad}");
    assert!(!bad.to_string().contains("X-Injected"), "{bad}");
    let mut both = ConsulConfig::new("web");
    both.token = Some(token("t"));
    both.token_file = Some(PathBuf::from("/etc/consul.token"));
    assert_eq!(
        resolve_in(&both, &[]).expect_err("both"),
        ConsulConfigError::TokenAndFile
    );
    let ok = resolve_in(&config, &[("CONSUL_HTTP_ADDR", "http://[::1]:8500")]);
    assert_eq!(ok.expect("ipv6").authority, "[::1]:8500");
}

#[test]
fn the_token_never_shows_in_debug_serialization_or_parse_errors() {
    let yaml = "service: web\ntoken: s3cret-0001\n";
    let config: ConsulConfig = serde_norway::from_str(yaml).expect("parses");
    assert_eq!(
        config.token.as_ref().map(ConsulToken::expose),
        Some("s3cret-0001")
    );
    let json = serde_json::to_string(&config).expect("serializes");
    let debug = format!("{config:?}");
    for shown in [&json, &debug] {
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }
    let err = serde_norway::from_str::<ConsulConfig>("service: web\ntoken: 's3cret 0002'")
        .expect_err("a space cannot travel in a header");
    assert!(!err.to_string().contains("s3cret"), "{err}");
    let file_only = serde_json::to_value(ConsulConfig {
        token_file: Some(PathBuf::from("/etc/consul.token")),
        ..ConsulConfig::new("web")
    })
    .expect("serializes");
    assert_eq!(file_only["token_file"], "/etc/consul.token");
    assert!(file_only.get("token").is_none());
}

#[test]
fn a_raw_typed_config_serializes_with_its_token_redacted() {
    let raw = serde_json::json!({"service": "web", "token": "s3cret-0003"});
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::new(&mut out);
    crate::config::sources::consul::access::serialize_redacted(&raw, &mut serializer)
        .expect("serializes");
    let text = String::from_utf8(out).expect("utf-8");
    assert_eq!(text, r#"{"service":"web","token":"<redacted>"}"#);
}
