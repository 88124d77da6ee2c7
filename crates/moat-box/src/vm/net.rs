//! A VM box's network namespace: `lo`, and the tap device that is the host
//! end of the guest's network link. Whatever the guest sends arrives on the
//! tap as traffic from outside; DNS and TCP to anywhere are turned to the
//! egress gateway's listeners on `lo` (as a namespace box's own traffic is),
//! everything else is dropped (nothing is forwarded, and nothing but what
//! was turned reaches the namespace's own stack; ARP only from the guest's
//! address for the router's), and the heads of dropped UDP and ICMP are
//! copied to the gateway's log. The namespace belongs to the host's user
//! namespace and nothing in it forwards, so the guest has no way around the
//! gateway; a guest that forges its source address or aims at loopback is
//! dropped before any rule could turn it.

use std::io;
use std::os::fd::OwnedFd;

use moat_core::egress::{BOX_SOURCE, DNS_PORT, DROPPED_GROUP, PROXY_PORT};

use crate::sys;

/// The tap device's name in the namespace.
pub const TAP: &str = "guest0";

fn routes() -> String {
    let router = moat_agent::GUEST_ROUTER;
    format!("link set {TAP} up\naddress add {router}/32 dev {TAP}\nroute add {BOX_SOURCE}/32 dev {TAP}\n")
}

fn rules() -> String {
    format!(
        "table inet moat {{
  chain guard {{
    type filter hook prerouting priority -150; policy accept;
    iifname \"{TAP}\" meta nfproto ipv6 drop
    iifname \"{TAP}\" ip saddr != {BOX_SOURCE} drop
    iifname \"{TAP}\" ip daddr 127.0.0.0/8 drop
  }}
  chain turn {{
    type nat hook prerouting priority -100; policy accept;
    iifname \"{TAP}\" meta l4proto {{ tcp, udp }} th dport 53 dnat ip to 127.0.0.1:{DNS_PORT}
    iifname \"{TAP}\" meta l4proto tcp dnat ip to 127.0.0.1:{PROXY_PORT}
  }}
  chain dropped {{
    type filter hook prerouting priority 0; policy accept;
    iifname \"{TAP}\" ip daddr 127.0.0.0/8 return
    iifname \"{TAP}\" meta l4proto {{ udp, icmp }} limit rate 50/second burst 100 packets log group {DROPPED_GROUP}
  }}
  chain local {{
    type filter hook input priority 0; policy accept;
    iifname \"{TAP}\" ct status dnat accept
    iifname \"{TAP}\" drop
  }}
}}
table arp moat {{
  chain local {{
    type filter hook input priority 0; policy accept;
    meta iifname \"{TAP}\" arp saddr ip != {BOX_SOURCE} drop
    meta iifname \"{TAP}\" arp daddr ip != {router} drop
  }}
}}
",
        router = moat_agent::GUEST_ROUTER
    )
}

/// Sets up the namespace the caller is in (a new, empty one) and returns
/// the tap's queue, for QEMU.
pub fn prepare() -> io::Result<OwnedFd> {
    sys::loopback_up().map_err(|e| io::Error::other(format!("loopback up: {e}")))?;
    let tap = sys::open_tap(TAP).map_err(|e| io::Error::other(format!("make tap device {TAP}: {e}")))?;
    // The gateway listens on 127.0.0.1: what the guest sends may be turned
    // there only if the tap may carry loopback addresses.
    std::fs::write(format!("/proc/sys/net/ipv4/conf/{TAP}/route_localnet"), "1")?;
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{TAP}/disable_ipv6"), "1");
    crate::host::netns::configure(&routes(), &rules())?;
    Ok(tap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_address_is_the_one_the_gateway_expects() {
        assert_eq!(moat_agent::GUEST_ADDR, BOX_SOURCE);
        assert!(rules().contains(&format!("dnat ip to 127.0.0.1:{PROXY_PORT}")));
    }
}
