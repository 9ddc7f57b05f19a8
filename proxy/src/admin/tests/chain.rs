//! `/chain/<service>`: a compiled chain, or why its service is left out.

use super::*;

/// `/chain/<service>` of a service whose chain does not compile from the current entries says
/// why it is left out.
#[tokio::test]
async fn a_left_out_chain_says_why() {
    let mut config = Config::parse("{}", std::path::Path::new("t.yaml")).expect("empty config");
    config.chain_failures.push(proxy_core::chain::ChainFailure {
        service: "web".to_owned(),
        reason: "chain \"web\": its protocol is \"tcp\"".to_owned(),
    });
    let state = State::new(
        config,
        Arc::new(Mutex::new(None)),
        BTreeMap::new(),
        watch::channel(std::collections::BTreeSet::default()).1,
    );
    let (server, addr) = serving(state).await;
    let (status, body) = get(&addr, "/chain/web").await;
    assert_eq!(
        (status, body.as_str()),
        (
            404,
            "service \"web\" is left out until its chain compiles: chain \"web\": its protocol is \"tcp\"\n"
        )
    );
    server.stop().await;
}
