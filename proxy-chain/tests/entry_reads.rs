//! What a compilation reads: over every entry set of the corpus, an entry the compilation of
//! `main` did not read changes nothing when it is removed, and entries nobody reads change
//! nothing when they are added; an entry it read, changed, is seen as a change.

mod support;

use proxy_chain::{ConfigEntry, Entries, EntryKind, compile, compile_reading};
use serde_json::{Value, json};
use support::{ENTRY_SETS, request};

/// Unread entries removed one at a time, per set, at most.
const PER_SET: usize = 40;

/// The corpus's sets, each as its entries.
fn sets() -> Vec<Vec<ConfigEntry>> {
    ENTRY_SETS
        .lines()
        .map(|line| serde_json::from_str(line).expect("a corpus line is an entry array"))
        .collect()
}

/// The compilation of `main` as comparable JSON, or its error text.
fn outcome(entries: &Entries) -> Result<Value, String> {
    compile(&request(), entries)
        .map(|chain| serde_json::to_value(&chain).expect("serializes"))
        .map_err(|e| e.to_string())
}

#[test]
fn an_entry_the_compilation_did_not_read_does_not_change_it() {
    let mut checked = 0;
    for set in sets() {
        let Ok(entries) = Entries::from_entries(set.clone()) else {
            continue;
        };
        let (result, reads) = compile_reading(&request(), &entries);
        let before = result
            .map(|chain| serde_json::to_value(&chain).expect("serializes"))
            .map_err(|e| e.to_string());
        assert!(
            !reads.is_empty(),
            "a compilation reads at least its service's entries"
        );
        let unread: Vec<usize> = (0..set.len())
            .filter(|&i| !reads.contains(set[i].kind(), set[i].name()))
            .collect();
        // At most PER_SET of them, spread over the set: the largest set has 2,001 entries.
        let step = unread.len().div_ceil(PER_SET).max(1);
        for &i in unread.iter().step_by(step) {
            let entry = &set[i];
            let rest = set.iter().enumerate().filter(|(j, _)| *j != i);
            let without = Entries::from_entries(rest.map(|(_, e)| e.clone())).expect("valid");
            assert!(reads.same_in(&entries, &without));
            assert_eq!(
                outcome(&without),
                before,
                "removing {} {:?}, which was not read, changed the chain of {set:?}",
                entry.kind().as_str(),
                entry.name()
            );
            checked += 1;
        }
    }
    assert!(
        checked > 20,
        "the corpus has entries a chain does not read ({checked})"
    );
}

#[test]
fn entries_nobody_reads_do_not_change_a_compilation() {
    let unread: Vec<ConfigEntry> = [
        json!({"Kind": "service-defaults", "Name": "unread", "Protocol": "http"}),
        json!({"Kind": "service-resolver", "Name": "unread", "ConnectTimeout": "7s"}),
        json!({"Kind": "service-splitter", "Name": "unread", "Splits": [{"Weight": 100}]}),
        json!({"Kind": "service-router", "Name": "unread"}),
    ]
    .into_iter()
    .map(|v| serde_json::from_value(v).expect("decodes"))
    .collect();
    for set in sets() {
        let Ok(entries) = Entries::from_entries(set.clone()) else {
            continue;
        };
        let (_, reads) = compile_reading(&request(), &entries);
        let Ok(more) = Entries::from_entries(set.iter().cloned().chain(unread.clone())) else {
            continue;
        };
        assert!(reads.same_in(&entries, &more), "{set:?}");
        assert_eq!(outcome(&more), outcome(&entries), "{set:?}");
    }
}

#[test]
fn an_entry_read_changed_or_added_is_a_change_and_proxy_defaults_is_read_by_name_alone() {
    let splitter = |leg: &str| -> ConfigEntry {
        serde_json::from_value(json!({"Kind": "service-splitter", "Name": "main",
            "Splits": [{"Weight": 100, "Service": leg}]}))
        .expect("decodes")
    };
    let http: ConfigEntry = serde_json::from_value(
        json!({"Kind": "service-defaults", "Name": "main", "Protocol": "http"}),
    )
    .expect("decodes");
    let a = Entries::from_entries([http.clone(), splitter("a")]).unwrap();
    let b = Entries::from_entries([http.clone(), splitter("b")]).unwrap();
    let (_, reads) = compile_reading(&request(), &a);
    assert!(reads.contains(EntryKind::ServiceSplitter, "main"));
    assert!(
        reads.contains(EntryKind::ServiceResolver, "a"),
        "the leg's resolver, absent"
    );
    assert!(reads.contains(EntryKind::ProxyDefaults, "global"));
    assert!(!reads.same_in(&a, &b), "the splitter moved");
    // A resolver for the leg, absent when the chain compiled, is a change once it is there.
    let resolver: ConfigEntry = serde_json::from_value(
        json!({"Kind": "service-resolver", "Name": "a", "ConnectTimeout": "7s"}),
    )
    .expect("decodes");
    let with_resolver = Entries::from_entries([http, splitter("a"), resolver]).unwrap();
    assert!(!reads.same_in(&a, &with_resolver));
}
