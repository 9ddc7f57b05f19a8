//! A private Consul 1.8.7 dev agent on 127.0.0.1 for the Consul catalog and discovery chain
//! tests, with live service registration, TTL check changes, config entries and compiled
//! discovery chains through its HTTP API.
//!
//! Each [`Consul`] picks free loopback ports for every listener (HTTP, DNS, gRPC, serf LAN/WAN,
//! server RPC), keeps its data and log in a fresh temp dir, disables the update check (no
//! traffic leaves the machine), waits until the agent has elected itself leader, and kills the
//! child by its PID on drop. The ports were free a moment before the agent binds them; another
//! process's outgoing connection may take one of them in between (they are in the ephemeral
//! range), so a start that fails with "address already in use" is retried on fresh ports, a
//! bounded number of times. The binary is `PROXY_TEST_CONSUL`, else `target/tools/consul`
//! (where `cargo xtask setup` installs it), else `consul` on PATH; none of them is a test
//! failure, never a skip.
//!
//! [`Consul::start_with_acls`] starts the agent with ACLs enabled, `default_policy = "deny"`
//! and a master token; the fixture's own calls send that token.

use std::{
    net::{SocketAddr, TcpListener, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use proxy_core::discovery::consul::http;
use serde_json::{Value, json};

/// How long the agent may take to start and elect itself.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Bound of one API call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where `cargo xtask setup` installs the binary, relative to the workspace root.
const INSTALL_PATH: &str = "target/tools/consul";

/// A running Consul dev agent (server and client in one) on 127.0.0.1.
pub struct Consul {
    dir: PathBuf,
    http: SocketAddr,
    datacenter: String,
    /// HTTP, DNS, gRPC, serf LAN, serf WAN and server ports, kept for a restart.
    ports: Vec<u16>,
    /// The ACL master token, when ACLs are on.
    master: Option<String>,
    /// Extra `-hcl` arguments (ACLs, TLS), kept for a restart.
    hcl: Vec<String>,
    /// The HTTPS API address, when TLS is on.
    https: Option<SocketAddr>,
    /// The network namespace the agent runs in ([`Consul::start_in`]); the host's when `None`.
    netns: Option<PathBuf>,
    child: Option<Child>,
}

/// The consul binary to run, or a panic that says how to get one.
pub fn consul_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("PROXY_TEST_CONSUL") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "PROXY_TEST_CONSUL={} is not a file",
            path.display()
        );
        return path;
    }
    let installed = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(INSTALL_PATH);
    if installed.is_file() {
        return installed;
    }
    let on_path = std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|dir| Path::new(dir).join("consul"))
        .find(|p| p.is_file());
    on_path.unwrap_or_else(|| {
        panic!(
            "consul is missing: run `cargo xtask setup` (it installs Consul 1.8.7 from Debian \
             bullseye into {INSTALL_PATH}) or set PROXY_TEST_CONSUL to a consul binary"
        )
    })
}

impl Consul {
    /// Starts a dev agent whose datacenter is `datacenter` and waits until it serves the
    /// catalog.
    pub async fn start(datacenter: &str) -> Self {
        crate::start_retrying_async("consul", 4, async || {
            Self::try_start(datacenter, None, None, None).await
        })
        .await
    }

    /// Like [`Consul::start`], inside `netns` (its loopback): for a daemon that runs there, as
    /// proxy-path tests run it. The fixture's own calls enter the namespace too.
    pub async fn start_in(netns: &crate::kernel::Netns, datacenter: &str) -> Self {
        let path = netns.path();
        crate::start_retrying_async("consul", 4, async || {
            Self::try_start(datacenter, None, None, Some(path.clone())).await
        })
        .await
    }

    /// Like [`Consul::start`], with an HTTPS API as well (its address: [`Consul::https_addr`])
    /// presenting `files.cert`, requiring a client certificate signed by `files.ca`
    /// (`verify_incoming_https`). The plain HTTP API stays for the fixture's own calls.
    pub async fn start_with_https(datacenter: &str, files: &HttpsFiles) -> Self {
        crate::start_retrying_async("consul", 4, async || {
            Self::try_start(datacenter, None, Some(files), None).await
        })
        .await
    }

    /// The HTTPS API address (after [`Consul::start_with_https`]).
    pub fn https_addr(&self) -> SocketAddr {
        self.https.expect("started with https")
    }

    /// Like [`Consul::start`], with ACLs enabled, denying by default, and `master` as the
    /// master token (used by the fixture's own calls).
    pub async fn start_with_acls(datacenter: &str, master: &str) -> Self {
        crate::start_retrying_async("consul", 4, async || {
            Self::try_start(datacenter, Some(master), None, None).await
        })
        .await
    }

    /// One start; `Err` with the reason and the agent's log when it exited or elected no leader
    /// in time (the agent is killed and its directory removed on the way out).
    async fn try_start(
        datacenter: &str,
        master: Option<&str>,
        https: Option<&HttpsFiles>,
        netns: Option<PathBuf>,
    ) -> Result<Self, String> {
        let dir = temp_dir();
        let ports = free_ports(7);
        let mut hcl = Vec::new();
        if let Some(m) = master {
            hcl.push(format!(
                "acl {{ enabled = true default_policy = \"deny\" tokens {{ master = \"{m}\" }} }}"
            ));
        }
        if let Some(files) = https {
            hcl.push(format!(
                "ca_file = \"{}\" cert_file = \"{}\" key_file = \"{}\" \
                 verify_incoming_https = true ports {{ https = {} }}",
                files.ca.display(),
                files.cert.display(),
                files.key.display(),
                ports[6]
            ));
        }
        let child = spawn_agent(&dir, datacenter, &ports, &hcl, netns.as_deref());
        let https = https.map(|_| SocketAddr::from(([127, 0, 0, 1], ports[6])));
        let mut consul = Self {
            dir,
            http: SocketAddr::from(([127, 0, 0, 1], ports[0])),
            datacenter: datacenter.to_owned(),
            ports,
            master: master.map(str::to_owned),
            hcl,
            https,
            netns,
            child: Some(child),
        };
        consul.wait_until_leader().await?;
        Ok(consul)
    }

    /// Starts the agent again after [`Consul::kill`], on the same ports and data directory
    /// (what it restores of earlier registrations is its own business: set the catalog after),
    /// and waits until it serves.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "restart follows kill");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.child = Some(spawn_agent(
                &self.dir,
                &self.datacenter,
                &self.ports,
                &self.hcl,
                self.netns.as_deref(),
            ));
            match self.wait_until_leader().await {
                Ok(()) => return,
                // A port still held by the killed agent's sockets: try again shortly.
                Err(why) if Instant::now() < deadline => {
                    self.kill();
                    eprintln!("consul restart: {why}; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(why) => panic!("consul did not come back: {why}"),
            }
        }
    }

    /// The HTTP API address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http
    }

    /// The agent's datacenter.
    pub fn datacenter(&self) -> &str {
        &self.datacenter
    }

    /// `PUT /v1/agent/service/register` with this definition (Consul's JSON field names).
    pub async fn register(&self, definition: Value) {
        self.put("/v1/agent/service/register", Some(definition))
            .await;
    }

    /// `PUT /v1/agent/service/deregister/<id>`.
    pub async fn deregister(&self, id: &str) {
        self.put(&format!("/v1/agent/service/deregister/{id}"), None)
            .await;
    }

    /// Sets a TTL check's status: `pass`, `warn` or `fail` (`PUT /v1/agent/check/<s>/<id>`).
    pub async fn set_check(&self, check_id: &str, status: &str) {
        self.put(&format!("/v1/agent/check/{status}/{check_id}"), None)
            .await;
    }

    /// `PUT /v1/config` with this config entry (Consul's JSON shape); `(status, body)`.
    pub async fn write_config(&self, entry: &Value) -> (u16, String) {
        let body = entry.to_string().into_bytes();
        self.call("PUT", "/v1/config", Some(&body)).await
    }

    /// `DELETE /v1/config/<kind>/<name>` (deleting what is not there succeeds too).
    pub async fn delete_config(&self, kind: &str, name: &str) {
        let (status, body) = self
            .call("DELETE", &format!("/v1/config/{kind}/{name}"), None)
            .await;
        assert_eq!(status, 200, "DELETE {kind}/{name}: {body}");
    }

    /// Consul's compiled discovery chain of `service`: `POST /v1/discovery-chain/<service>`
    /// with `compile-dc` when given and `OverrideMeshGateway.Mode` = `override_mode` (empty:
    /// none). Returns the `Chain` object.
    pub async fn compiled_chain(
        &self,
        service: &str,
        compile_dc: Option<&str>,
        override_mode: &str,
    ) -> Value {
        let query = compile_dc
            .map(|dc| format!("?compile-dc={dc}"))
            .unwrap_or_default();
        let path = format!("/v1/discovery-chain/{service}{query}");
        let body = json!({"OverrideMeshGateway": {"Mode": override_mode}}).to_string();
        let (status, text) = self.call("POST", &path, Some(body.as_bytes())).await;
        assert_eq!(status, 200, "POST {path}: {text}\nlog: {}", self.log());
        let mut answer: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("POST {path}: {e}: {text}"));
        answer["Chain"].take()
    }

    /// `GET /v1/discovery-chain/<service>`: the `Chain` object, or Consul's status and error
    /// text.
    pub async fn discovery_chain(&self, service: &str) -> Result<Value, (u16, String)> {
        let path = format!("/v1/discovery-chain/{service}");
        let (status, text) = self.call("GET", &path, None).await;
        if status != 200 {
            return Err((status, text));
        }
        let mut answer: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("GET {path}: {e}: {text}"));
        Ok(answer["Chain"].take())
    }

    /// The trust domain of the agent's Connect CA (`/v1/connect/ca/roots`), which SNI names end
    /// in.
    pub async fn trust_domain(&self) -> String {
        let (status, text) = self.call("GET", "/v1/connect/ca/roots", None).await;
        assert_eq!(status, 200, "GET /v1/connect/ca/roots: {text}");
        let roots: Value = serde_json::from_str(&text).expect("CA roots JSON");
        roots["TrustDomain"]
            .as_str()
            .unwrap_or_else(|| panic!("no TrustDomain in {text}"))
            .to_owned()
    }

    async fn call(&self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
        let address = self.http.to_string();
        let token = self.master.as_deref();
        let response = self
            .request(method, path, token, body)
            .await
            .unwrap_or_else(|e| panic!("{method} {path} on consul {address}: {e}"));
        let text = String::from_utf8_lossy(&response.body).into_owned();
        (response.status, text)
    }

    /// One API call on the agent's HTTP address, from inside its namespace when it has one.
    async fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&[u8]>,
    ) -> Result<http::HttpResponse, String> {
        let address = self.http.to_string();
        let Some(netns) = self.netns.clone() else {
            return http::request(&address, method, path, token, body, CALL_TIMEOUT)
                .await
                .map_err(|e| e.to_string());
        };
        let (method, path) = (method.to_owned(), path.to_owned());
        let (token, body) = (token.map(str::to_owned), body.map(<[u8]>::to_vec));
        // A socket belongs to the namespace of the thread that makes it: the call runs on a
        // thread inside the agent's namespace, on a runtime of its own.
        let call = move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for a call inside the namespace");
            runtime
                .block_on(http::request(
                    &address,
                    &method,
                    &path,
                    token.as_deref(),
                    body.as_deref(),
                    CALL_TIMEOUT,
                ))
                .map_err(|e| e.to_string())
        };
        let thread = crate::kernel::in_netns_at(netns, call);
        tokio::task::spawn_blocking(move || thread.join().expect("consul call thread"))
            .await
            .expect("consul call task")
    }

    /// A new ACL token whose one policy has these `rules` (Consul's HCL), created with the
    /// master token; returns its secret.
    pub async fn create_token(&self, rules: &str) -> String {
        let name = format!("policy-{}", crate::kernel::unique("p"));
        let policy = json!({"Name": name, "Rules": rules}).to_string();
        let (status, body) = self
            .call("PUT", "/v1/acl/policy", Some(policy.as_bytes()))
            .await;
        assert_eq!(status, 200, "creating policy {name}: {body}");
        let id = serde_json::from_str::<Value>(&body).expect("policy json")["ID"].clone();
        let token = json!({"Policies": [{"ID": id}]}).to_string();
        let (status, body) = self
            .call("PUT", "/v1/acl/token", Some(token.as_bytes()))
            .await;
        assert_eq!(status, 200, "creating a token of {name}: {body}");
        let secret = serde_json::from_str::<Value>(&body).expect("token json")["SecretID"].clone();
        secret.as_str().expect("a SecretID").to_owned()
    }

    /// Kills the agent now (by its PID); later calls fail as against a dead agent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Child::kill sends SIGKILL to this child's PID only.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The agent's log so far, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("consul.log")).unwrap_or_default()
    }

    async fn put(&self, path: &str, body: Option<Value>) {
        let body = body.map(|b| b.to_string().into_bytes());
        let address = self.http.to_string();
        let token = self.master.as_deref();
        let response = self
            .request("PUT", path, token, body.as_deref())
            .await
            .unwrap_or_else(|e| panic!("PUT {path} on consul {address}: {e}"));
        assert_eq!(
            response.status,
            200,
            "PUT {path}: {}\nlog: {}",
            response.body_excerpt(),
            self.log()
        );
    }

    /// Whether the agent names a leader and, with ACLs, knows the master token.
    async fn serving(&self) -> bool {
        let get = |path| self.request("GET", path, None, None);
        let leader = get("/v1/status/leader")
            .await
            .ok()
            .filter(|r| r.status == 200)
            .and_then(|r| serde_json::from_slice::<String>(&r.body).ok());
        if leader.is_none_or(|l| l.is_empty()) {
            return false;
        }
        let Some(master) = self.master.as_deref() else {
            return true;
        };
        let path = "/v1/acl/token/self";
        let known = self.request("GET", path, Some(master), None).await;
        known.is_ok_and(|r| r.status == 200)
    }

    /// Polls until the agent serves (see [`Consul::serving`]); `Err` with the log if the agent
    /// exits first (a port taken, say) or it does not serve within [`START_TIMEOUT`].
    async fn wait_until_leader(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        let address = self.http.to_string();
        loop {
            if self.serving().await {
                return Ok(());
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                return Err(format!(
                    "consul on {address} exited ({status}) before electing a leader\nlog: {}",
                    self.log()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "consul on {address} elected no leader within {START_TIMEOUT:?}\nlog: {}",
                    self.log()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Consul {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A service definition with one TTL check `<id>-ttl`, initially passing. `address` may be
/// empty (the node's address is used).
pub fn service(id: &str, name: &str, address: &str, port: u16) -> Value {
    json!({
        "ID": id,
        "Name": name,
        "Address": address,
        "Port": port,
        "Checks": [{"CheckID": format!("{id}-ttl"), "Name": "ttl", "TTL": "600s",
            "Status": "passing"}],
    })
}

/// `n` distinct ports free for both TCP and UDP on 127.0.0.1 right now (serf uses both); the
/// sockets are held until all are chosen so no port is handed out twice.
fn free_ports(n: usize) -> Vec<u16> {
    let mut held = Vec::new();
    for _ in 0..n * 20 {
        if held.len() == n {
            break;
        }
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind a loopback TCP port");
        let port = tcp.local_addr().expect("local addr").port();
        if let Ok(udp) = UdpSocket::bind(("127.0.0.1", port)) {
            held.push((port, tcp, udp));
        }
    }
    assert_eq!(
        held.len(),
        n,
        "not enough ports free for both TCP and UDP on 127.0.0.1"
    );
    held.into_iter().map(|(port, _, _)| port).collect()
}

fn temp_dir() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("proxy-consul-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// PEM files of an HTTPS agent: the CA its clients' certificates must chain to, and its own
/// certificate and key.
pub struct HttpsFiles {
    /// CA certificate.
    pub ca: PathBuf,
    /// The agent's certificate.
    pub cert: PathBuf,
    /// The agent's key.
    pub key: PathBuf,
}

/// Starts a dev agent of `datacenter` with its data and log (appended) in `dir`, on `ports`
/// (HTTP, DNS, gRPC, serf LAN, serf WAN, server, then one spare), with `hcl` added.
fn spawn_agent(
    dir: &Path,
    datacenter: &str,
    ports: &[u16],
    hcl: &[String],
    netns: Option<&Path>,
) -> Child {
    let binary = consul_binary();
    let log_path = dir.join("consul.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", log_path.display()));
    let stderr = log.try_clone().expect("clone log handle");
    let mut command = Command::new(&binary);
    if let Some(netns) = netns {
        crate::kernel::exec_in_netns(&mut command, netns);
    }
    command
        .args([
            "agent",
            "-dev",
            "-bind",
            "127.0.0.1",
            "-client",
            "127.0.0.1",
        ])
        .args([
            "-node",
            "proxy-test",
            "-datacenter",
            datacenter,
            "-log-level",
            "warn",
        ])
        .args(["-hcl", "disable_update_check = true"])
        .args(hcl.iter().flat_map(|hcl| ["-hcl", hcl.as_str()]))
        .arg("-data-dir")
        .arg(dir.join("data"))
        .args(["-http-port", &ports[0].to_string()])
        .args(["-dns-port", &ports[1].to_string()])
        .args(["-grpc-port", &ports[2].to_string()])
        .args(["-serf-lan-port", &ports[3].to_string()])
        .args(["-serf-wan-port", &ports[4].to_string()])
        .args(["-server-port", &ports[5].to_string()])
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()))
}
