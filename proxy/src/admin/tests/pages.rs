//! Every page over a real socket: the renderer's output, byte for byte, under its content type.

use super::*;

/// Every page answers with the renderer's output, byte for byte, under the same content type.
#[tokio::test]
async fn pages_render_what_they_rendered_before() {
    let state = state();
    let (server, addr) = serving(state.clone()).await;
    let text = "text/plain; charset=utf-8";
    let json = "application/json";
    let exposition = "text/plain; version=0.0.4; charset=utf-8";
    let all = render::StatsQuery::all();
    let pretty = |v: &dyn erased::Value| v.pretty() + "\n";
    for (target, content_type, want) in [
        ("/stats", text, render::stats_text(&state, &all)),
        (
            "/stats?format=json",
            json,
            pretty(&render::stats_map(&state, &all)),
        ),
        (
            "/stats/prometheus",
            exposition,
            render::prometheus(&state, &all),
        ),
        (
            "/stats?format=prometheus",
            exposition,
            render::prometheus(&state, &all),
        ),
        (
            "/stats?filter=services&format=json",
            json,
            pretty(&render::stats_map(
                &state,
                &render::StatsQuery::parse("filter=services").unwrap(),
            )),
        ),
        ("/listeners", text, render::listeners_text(&state)),
        (
            "/listeners?format=json",
            json,
            pretty(&render::listeners_json(&state)),
        ),
        ("/clusters", text, render::clusters_text(&state)),
        (
            "/clusters?format=json",
            json,
            pretty(&render::clusters_json(&state)),
        ),
        ("/config_dump", json, pretty(&render::config_dump(&state))),
        ("/config_dump?format=proxy", json, pretty(&*state.config)),
    ] {
        let (status, head, body) = call(&addr, "GET", target).await;
        assert_eq!(status, 200, "{target}");
        assert!(
            head.contains(&format!("content-type: {content_type}")),
            "{target}: {head}"
        );
        assert!(
            head.contains(&format!("content-length: {}", want.len())),
            "{target}: {head}"
        );
        assert_eq!(body, want, "{target}");
    }
    assert!(render::stats_text(&state, &all).contains("server.services: 0"));
    let (status, body) = get(&addr, "/chain/web").await;
    assert_eq!(
        (status, body.as_str()),
        (404, "no discovery chain for service \"web\"\n")
    );
    server.stop().await;
}

/// serde_json's pretty form of anything `Serialize`, behind one object-safe trait.
mod erased {
    pub trait Value {
        fn pretty(&self) -> String;
    }
    impl<T: serde::Serialize> Value for T {
        fn pretty(&self) -> String {
            serde_json::to_string_pretty(self).expect("serializable")
        }
    }
}

/// `/stats?filter=` takes a regex (a bad one is a 400 that says why, a bad format too);
/// `POST /reset_counters` answers OK on the control socket and takes POST only.
#[tokio::test]
async fn stats_queries_and_reset_counters_over_the_sockets() {
    let (server, tcp, control) = serving_both(state()).await;
    assert_eq!(
        get(&tcp, "/stats?filter=%5Eserver%5C.serv").await,
        (200, "server.services: 0\n".to_owned())
    );
    let (status, body) = get(&tcp, "/stats?filter=(").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.starts_with("error: invalid regex in filter \"(\""),
        "{body}"
    );
    let (status, body) = get(&tcp, "/stats/prometheus?format=xml").await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(call(&control, "POST", "/reset_counters").await.0, 200);
    let (status, head, _) = call(&control, "GET", "/reset_counters").await;
    assert_eq!(status, 405);
    assert!(head.contains("allow: post"), "{head}");
    server.stop().await;
}
