//! The pure rules: `Host`, methods, and where state changes are served.

use super::*;

const ADDRESS: &str = "127.0.0.1:15000";

fn tcp(mutations: bool) -> Access {
    Access::Tcp {
        address: ADDRESS.parse().unwrap(),
        mutations,
        control: "/run/proxy/t.admin".to_owned(),
    }
}

fn request(method: &str, target: &str, host: Option<&str>) -> Request<()> {
    let mut builder = Request::builder().method(method).uri(target);
    if let Some(host) = host {
        builder = builder.header(HOST, host);
    }
    builder.body(()).unwrap()
}

/// The status of `request` on `access` (200 when admitted) and the refusal's `Allow` and body.
fn verdict(request: &Request<()>, access: &Access) -> (u16, Option<&'static str>, String) {
    match admit(request, access, None) {
        Ok(()) => (200, None, String::new()),
        Err(refused) => (refused.status.as_u16(), refused.allow, refused.body),
    }
}

#[test]
fn host_must_name_the_admin_interface_itself() {
    let local = Some("127.0.0.1:15000".parse().unwrap());
    for host in [
        "127.0.0.1:15000",
        "localhost:15000",
        "LocalHost:15000",
        "[::1]:15000",
    ] {
        let ok = request("GET", "/ready", Some(host));
        assert!(admit(&ok, &tcp(false), local).is_ok(), "{host}");
    }
    for host in [
        "evil.example:15000",
        "localhost",
        "localhost:15001",
        "127.0.0.1",
        "127.0.0.2:15000",
        "localhost.evil.example:15000",
    ] {
        let (status, _, body) = verdict(&request("GET", "/ready", Some(host)), &tcp(true));
        assert_eq!(status, 421, "{host}");
        assert!(
            body.starts_with(&format!(
                "refused: host {host:?} is not this admin interface's"
            )),
            "{host}: {body}"
        );
    }
    // An absolute-form target names its host too.
    let absolute = request("GET", "http://evil.example:15000/ready", Some(ADDRESS));
    assert_eq!(verdict(&absolute, &tcp(false)).0, 421);
}

#[test]
fn a_missing_or_doubled_host_is_refused_on_http_1_1_only() {
    let (status, _, body) = verdict(&request("GET", "/ready", None), &tcp(false));
    assert_eq!(status, 400);
    assert!(body.contains("no Host header"), "{body}");
    let mut old = request("GET", "/ready", None);
    *old.version_mut() = Version::HTTP_10;
    assert_eq!(verdict(&old, &tcp(false)).0, 200, "HTTP/1.0 may omit Host");
    let mut doubled = request("GET", "/ready", Some(ADDRESS));
    doubled.headers_mut().append(HOST, ADDRESS.parse().unwrap());
    let (status, _, body) = verdict(&doubled, &tcp(false));
    assert_eq!(status, 400);
    assert!(body.contains("more than one Host header"), "{body}");
}

#[test]
fn the_owner_socket_needs_no_host() {
    for method in ["GET", "POST"] {
        let target = if method == "GET" { "/ready" } else { "/reload" };
        let asked = request(method, target, None);
        assert_eq!(verdict(&asked, &Access::Owner).0, 200, "{method}");
    }
}

#[test]
fn read_only_endpoints_take_get_and_head_only() {
    for path in [
        "/",
        "/ready",
        "/stats",
        "/config_dump",
        "/chain/web",
        "/server_info",
    ] {
        for method in ["GET", "HEAD"] {
            let asked = request(method, path, Some(ADDRESS));
            assert_eq!(verdict(&asked, &tcp(false)).0, 200, "{method} {path}");
        }
        for method in ["POST", "PUT", "DELETE", "OPTIONS"] {
            for access in [tcp(true), Access::Owner] {
                let (status, allow, body) = verdict(&request(method, path, Some(ADDRESS)), &access);
                assert_eq!((status, allow), (405, Some("GET, HEAD")), "{method} {path}");
                assert_eq!(
                    body,
                    format!("method {method} is not allowed on {path}: it only shows\n")
                );
            }
        }
    }
    // An unknown path is the handler's 404, whatever the method.
    assert_eq!(
        verdict(&request("POST", "/nope", Some(ADDRESS)), &tcp(false)).0,
        200
    );
}

#[test]
fn state_changes_take_post_and_are_refused_on_tcp_unless_allowed() {
    for path in [
        "/reload",
        "/healthcheck/fail",
        "/healthcheck/ok",
        "/logging?level=debug",
    ] {
        let post = request("POST", path, Some(ADDRESS));
        let (status, allow, body) = verdict(&post, &tcp(false));
        assert_eq!((status, allow), (403, None), "{path}");
        let bare = path.split('?').next().unwrap();
        assert!(
            body.starts_with(&format!("POST {bare} changes the daemon's state")),
            "{body}"
        );
        assert!(body.contains("control socket /run/proxy/t.admin"), "{body}");
        assert!(body.contains("admin.allow_tcp_mutations: true"), "{body}");
        assert_eq!(verdict(&post, &tcp(true)).0, 200, "{path}: allowed on TCP");
        assert_eq!(
            verdict(&post, &Access::Owner).0,
            200,
            "{path}: the owner's socket"
        );
        let get = request("GET", path, Some(ADDRESS));
        let (status, allow, _) = verdict(&get, &Access::Owner);
        assert_eq!((status, allow), (405, Some("POST")), "GET {path}");
    }
    // `/logging` shows by GET, changes by POST; other methods learn both.
    assert_eq!(
        verdict(&request("GET", "/logging", Some(ADDRESS)), &tcp(false)).0,
        200
    );
    let put = request("PUT", "/logging", Some(ADDRESS));
    assert_eq!(verdict(&put, &Access::Owner).1, Some("GET, HEAD, POST"));
}
