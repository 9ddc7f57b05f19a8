//! `dns_lookup_family` rules of `resolve_addresses`.

use std::net::IpAddr;

use crate::{
    config::sources::dns::DnsLookupFamily as F,
    discovery::dns::{AddressRecord, FakeResolver, QueryType, resolve_addresses},
};

fn ips(records: &[AddressRecord]) -> Vec<IpAddr> {
    records.iter().map(|r| r.ip).collect()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn dual_stack() -> FakeResolver {
    let fake = FakeResolver::new();
    fake.set("both.test", &[("10.0.0.1", 5), ("fd00::1", 5)]);
    fake.set("v4.test", &[("10.0.0.1", 5)]);
    fake.set("v6.test", &[("fd00::1", 5)]);
    fake
}

async fn resolve(fake: &FakeResolver, name: &str, family: F) -> Vec<IpAddr> {
    ips(&resolve_addresses(fake, name, family)
        .await
        .expect("success"))
}

#[tokio::test]
async fn auto_prefers_v6_and_falls_back_to_v4_when_v6_is_empty() {
    let fake = dual_stack();
    assert_eq!(resolve(&fake, "both.test", F::Auto).await, [ip("fd00::1")]);
    assert_eq!(resolve(&fake, "v4.test", F::Auto).await, [ip("10.0.0.1")]);
    assert_eq!(
        fake.queries(),
        [
            ("both.test".to_string(), QueryType::Aaaa),
            ("v4.test".to_string(), QueryType::Aaaa),
            ("v4.test".to_string(), QueryType::A)
        ]
    );
}

#[tokio::test]
async fn auto_falls_back_to_v4_when_v6_fails() {
    let fake = dual_stack();
    fake.fail("both.test", QueryType::Aaaa);
    assert_eq!(resolve(&fake, "both.test", F::Auto).await, [ip("10.0.0.1")]);
}

#[tokio::test]
async fn v4_preferred_prefers_v4_and_falls_back_to_v6() {
    let fake = dual_stack();
    assert_eq!(
        resolve(&fake, "both.test", F::V4Preferred).await,
        [ip("10.0.0.1")]
    );
    assert_eq!(
        resolve(&fake, "v6.test", F::V4Preferred).await,
        [ip("fd00::1")]
    );
}

#[tokio::test]
async fn only_families_ask_one_question() {
    let fake = dual_stack();
    assert_eq!(
        resolve(&fake, "both.test", F::V4Only).await,
        [ip("10.0.0.1")]
    );
    assert_eq!(
        resolve(&fake, "both.test", F::V6Only).await,
        [ip("fd00::1")]
    );
    assert!(resolve(&fake, "v6.test", F::V4Only).await.is_empty());
    assert_eq!(fake.queries().len(), 3);
}

#[tokio::test]
async fn all_returns_both_families_v6_first() {
    let fake = dual_stack();
    assert_eq!(
        resolve(&fake, "both.test", F::All).await,
        [ip("fd00::1"), ip("10.0.0.1")]
    );
}

#[tokio::test]
async fn all_fails_only_when_both_families_fail() {
    let fake = dual_stack();
    fake.fail("both.test", QueryType::A);
    assert_eq!(resolve(&fake, "both.test", F::All).await, [ip("fd00::1")]);
    fake.fail("both.test", QueryType::Aaaa);
    assert!(resolve_addresses(&fake, "both.test", F::All).await.is_err());
}

#[tokio::test]
async fn empty_everywhere_is_an_empty_success() {
    let fake = FakeResolver::new();
    for family in [F::Auto, F::V4Only, F::V6Only, F::V4Preferred, F::All] {
        assert!(resolve(&fake, "nothing.test", family).await.is_empty());
    }
}

#[tokio::test]
async fn ip_literals_resolve_to_themselves_without_queries() {
    let fake = FakeResolver::new();
    let records = resolve_addresses(&fake, "127.0.0.5", F::Auto)
        .await
        .unwrap();
    assert_eq!(ips(&records), [ip("127.0.0.5")]);
    assert!(records[0].ttl.is_zero());
    assert!(resolve(&fake, "127.0.0.5", F::V6Only).await.is_empty());
    assert!(fake.queries().is_empty());
}
