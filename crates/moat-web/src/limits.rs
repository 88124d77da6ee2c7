//! The edge's limits: who a source is, and a visitor's share of a box port
//! (counted in [`moat_core::slots::Slots`]).

/// The source a limit counts `ip` as: an IPv6 address by its /64 (one
/// host's whole allotment), an IPv4-mapped one as the IPv4 address.
pub fn source_of(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.into(),
            None => std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1)).into(),
        },
        v4 => v4,
    }
}

/// A visitor's share of a box port's requests in flight: three quarters,
/// so one address (with HTTP/2 streams or WebSockets) cannot take them all.
pub fn visitor_share(per_box: usize) -> usize {
    (per_box - per_box / 4).max(1)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_hosts_and_visitors_share() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert_eq!(source_of(ip("2001:db8:1:2:aaaa::1")), source_of(ip("2001:db8:1:2:bbbb::9")));
        assert_ne!(source_of(ip("2001:db8:1:2::1")), source_of(ip("2001:db8:1:3::1")));
        assert_eq!(source_of(ip("::ffff:192.0.2.7")), ip("192.0.2.7"));
        assert_eq!(source_of(ip("192.0.2.7")), ip("192.0.2.7"));
        assert_eq!((visitor_share(256), visitor_share(2), visitor_share(1)), (192, 2, 1));
    }
}
