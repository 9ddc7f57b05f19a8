//! Socket-to-socket splicing (root): with splicing on, sockops puts both ends of a local
//! connection into the sockhash and sk_msg hands every message straight to the peer socket.
//! Several megabytes each way must arrive intact (digests compared), and with splicing off
//! nothing is put in the sockhash and the bytes take the TCP path.

use std::net::SocketAddr;

use integration_tests::kernel::{
    InProcess, Netns, TestCgroup, framed_exchange, require_root, skip_without_dataplane, spec,
};
use proxy_common::socket::SETTINGS_F_SPLICE;
use rstest::rstest;

/// Bytes sent in each direction.
const SIZE: usize = 8 * 1024 * 1024;

struct Family {
    vip: &'static str,
    server: &'static str,
}

const V4: Family = Family {
    vip: "127.77.2.1:80",
    server: "127.0.0.51:8080",
};
const V6: Family = Family {
    vip: "[fd77::2:1]:80",
    server: "[::1]:8080",
};

#[rstest]
#[case::ipv4_spliced(V4, true)]
#[case::ipv4_not_spliced(V4, false)]
#[case::ipv6_spliced(V6, true)]
#[case::ipv6_not_spliced(V6, false)]
fn bytes_arrive_intact_both_ways(#[case] fam: Family, #[case] splice: bool) {
    require_root();
    if skip_without_dataplane("bytes_arrive_intact_both_ways") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let server: SocketAddr = fam.server.parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    // Switching on and then off must leave it off (the default is off as well).
    dp.set_splice(true).expect("switching splicing on");
    dp.set_splice(splice).expect("setting the splice switch");
    assert_eq!(
        dp.runtime().settings().flags & SETTINGS_F_SPLICE != 0,
        splice
    );
    dp.publisher()
        .publish(&spec("local", vip, false, 0, &[server]))
        .expect("publishing");

    let (up, down) = framed_exchange(cgroup.path(), &netns, server, vip, SIZE);
    assert!(up, "client -> server bytes differ (splice {splice})");
    assert!(down, "server -> client bytes differ (splice {splice})");
    let (inserted, redirected) = (
        dp.counter("sockhash_inserted"),
        dp.counter("sk_msg_redirected"),
    );
    println!("splice {splice}: sockhash_inserted {inserted}, sk_msg_redirected {redirected}");
    if splice {
        assert_eq!(inserted, 2, "both ends belong in the sockhash");
        assert!(redirected > 0, "no message was spliced");
    } else {
        assert_eq!((inserted, redirected), (0, 0), "splicing is off");
    }
}
