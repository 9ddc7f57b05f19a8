//! The chain this daemon compiles equals the one a real Consul 1.8.7 serves at
//! `/v1/discovery-chain/<service>`, for every entry set the proxy-chain corpus compiles
//! (`proxy-chain/tests/entry_sets.jsonl`, kept complete by those tests) and every set
//! `daemon_chain.rs` runs through the daemon.
//!
//! Only what differs by Consul version is normalised, in [`to_consul_1_8`]; a set Consul 1.8.7
//! refuses to store (a field or rule it predates) cannot be compared and is counted apart.

use proxy_chain::{CompileRequest, Entries, compile};

use super::*;

/// The corpus of `proxy-chain`'s tests: one JSON array of entries a line, compiled for `main`.
const CORPUS: &str = include_str!("../../../proxy-chain/tests/entry_sets.jsonl");

/// The entry sets of `daemon_chain.rs`, compiled for `web` (in JSON).
fn daemon_chain_sets() -> Vec<Value> {
    let http = |name: &str| json!({"Kind": "service-defaults", "Name": name, "Protocol": "http"});
    vec![
        json!([http("web"),
            {"Kind": "service-splitter", "Name": "web",
             "Splits": [{"Weight": 90, "ServiceSubset": "v1"}, {"Weight": 10, "ServiceSubset": "v2"}]},
            {"Kind": "service-resolver", "Name": "web",
             "Subsets": {"v1": {"Filter": "Service.Meta.version == v1"},
                         "v2": {"Filter": "Service.Meta.version == v2"}}}]),
        json!([{"Kind": "service-resolver", "Name": "web", "Redirect": {"Service": "other"}}]),
        json!([{"Kind": "service-resolver", "Name": "web", "Failover": {"*": {"Service": "backup"}}}]),
        json!([http("web"), http("canary"),
            {"Kind": "service-splitter", "Name": "web",
             "Splits": [{"Weight": 80, "Service": "web"}, {"Weight": 20, "Service": "canary"}]}]),
    ]
}

/// Consul 1.8.7's shape of a chain from a newer Consul's, field by field, with the reason:
/// * `Partition` fields, and the `.default` partition segment of target IDs and node names:
///   admin partitions came in Consul 1.11;
/// * `ConnectTimeout` and `TransparentProxy` on targets: targets carry them since 1.10 (1.8.7
///   has the timeout on the resolver node only, which stays compared);
/// * a split's `Definition`: added to compiled splits after 1.8;
/// * the chain's `Default` and `ServiceMeta`: added to compiled chains after 1.8 (1.8.7 marks a
///   default chain only on its resolver node, which stays compared).
fn to_consul_1_8(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.remove("Partition");
            if map.contains_key("ID") && map.contains_key("SNI") {
                map.remove("ConnectTimeout");
                map.remove("TransparentProxy");
            }
            if map.contains_key("NextNode") && map.contains_key("Weight") {
                map.remove("Definition");
            }
            if map.contains_key("StartNode") {
                map.remove("Default");
                map.remove("ServiceMeta");
            }
            let old = std::mem::take(map);
            for (key, mut v) in old {
                to_consul_1_8(&mut v);
                map.insert(key.replace(".default.default", ".default"), v);
            }
        }
        Value::Array(list) => list.iter_mut().for_each(to_consul_1_8),
        Value::String(text) => *text = text.replace(".default.default", ".default"),
        _ => {}
    }
}

/// Consul's write order: defaults before the resolvers, splitters and routers that need their
/// protocol, resolvers before the splitters that name their subsets.
fn write_rank(entry: &Value) -> usize {
    [
        "proxy-defaults",
        "service-defaults",
        "service-resolver",
        "service-splitter",
        "service-router",
    ]
    .iter()
    .position(|k| entry["Kind"] == *k)
    .unwrap_or(5)
}

/// This daemon's one deliberate difference in what compiles: splitters leading one into the
/// next stop at 64 (each is a stack frame here; Consul has no bound). docs/differences.md,
/// "Differences from Envoy and Consul".
const SPLITTER_BOUND: &str = "more than 64 service-splitters leading one into the next";

/// How one set compared.
enum Outcome {
    Agree,
    Bounded,
    Refused(String),
    Differ(String),
}

/// Writes `set`, compares the chains of `service`, deletes `set` again.
async fn cross_check(consul: &Consul, trust_domain: &str, service: &str, set: &Value) -> Outcome {
    let mut entries = set.as_array().cloned().unwrap_or_default();
    entries.sort_by_key(write_rank);
    let mut written = Vec::new();
    let mut refused = None;
    for entry in &entries {
        let (status, body) = consul.write_config(entry).await;
        if status != 200 {
            refused = Some(format!("{entry}: {body}"));
            break;
        }
        written.push(entry);
    }
    let theirs = match &refused {
        Some(_) => None,
        None => Some(consul.discovery_chain(service).await),
    };
    for entry in written.iter().rev() {
        let kind = entry["Kind"].as_str().unwrap_or_default();
        consul
            .delete_config(kind, entry["Name"].as_str().unwrap_or_default())
            .await;
    }
    let ours = Entries::from_json(&set.to_string())
        .map_err(|e| e.to_string())
        .and_then(|entries| {
            compile(&CompileRequest::new(service, "dc1", trust_domain), &entries)
                .map_err(|e| e.to_string())
        });
    match (ours, theirs) {
        (Err(_), None | Some(Err(_))) => Outcome::Agree,
        (Ok(_), None) => Outcome::Refused(refused.unwrap_or_default()),
        (Ok(ours), Some(Ok(theirs))) => {
            let mut ours = serde_json::to_value(&ours).expect("serializes");
            to_consul_1_8(&mut ours);
            if ours == theirs {
                Outcome::Agree
            } else {
                Outcome::Differ(format!("ours (normalised): {ours}\nConsul's: {theirs}"))
            }
        }
        (Ok(_), Some(Err((status, text)))) => {
            Outcome::Differ(format!("we compile it, Consul answers {status}: {text}"))
        }
        (Err(e), Some(Ok(_))) if e.contains(SPLITTER_BOUND) => Outcome::Bounded,
        (Err(e), Some(Ok(theirs))) => {
            Outcome::Differ(format!("we refuse it ({e}), Consul compiles {theirs}"))
        }
    }
}

#[tokio::test]
async fn compiled_chains_equal_consuls_for_every_corpus_entry_set() {
    let consul = Consul::start("dc1").await;
    let trust_domain = consul.trust_domain().await;
    let corpus = CORPUS.lines().map(|line| {
        (
            "main",
            serde_json::from_str::<Value>(line).expect("a JSON line"),
        )
    });
    let sets: Vec<(&str, Value)> = corpus
        .chain(daemon_chain_sets().into_iter().map(|s| ("web", s)))
        .collect();
    let (mut agree, mut bounded, mut refused, mut differ) = (0, 0, Vec::new(), Vec::new());
    for (service, set) in &sets {
        match cross_check(&consul, &trust_domain, service, set).await {
            Outcome::Agree => agree += 1,
            Outcome::Bounded => bounded += 1,
            Outcome::Refused(why) => refused.push(why),
            Outcome::Differ(how) => differ.push(format!("{service} from {set}:\n{how}")),
        }
    }
    eprintln!(
        "{agree} agree, {bounded} past the splitter bound, {} refused by Consul 1.8.7:",
        refused.len()
    );
    for why in &refused {
        eprintln!("  {why}");
    }
    assert!(
        differ.is_empty(),
        "{} differ:\n{}",
        differ.len(),
        differ.join("\n\n")
    );
    assert!(
        agree >= sets.len() / 2,
        "too few comparable sets: {agree} of {}",
        sets.len()
    );
}
