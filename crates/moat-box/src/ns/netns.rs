//! A box's network namespace: `lo` only, and every packet bound for the
//! outside turned back to the egress gateway's listeners on `lo`. There is no
//! device that leads anywhere, so nothing in the box can go around the
//! gateway; the namespace is owned by the host's user namespace, so root in
//! the box cannot change its routes or rules. A box whose gateway is not
//! there reaches nothing.

use std::io;

use moat_core::egress::{BOX_SOURCE, DNS_PORT, DROPPED_GROUP, PROXY_PORT};

use crate::sys;

/// Everything leaves through `lo`, so that the rules below see it (a packet
/// with no route fails before any rule runs), from an address of the box's
/// own (a packet from no address gets no reply).
fn routes() -> String {
    format!("address add {BOX_SOURCE}/32 dev lo\nroute add default dev lo src {BOX_SOURCE}\nroute add ::/0 dev lo\n")
}

/// DNS to anywhere goes to the gateway's DNS server; every other TCP
/// connection off loopback goes to its proxy, which reads where it was
/// headed from the connection's NAT record. Other UDP and ICMP leave `lo`
/// for nowhere (no forwarding) and are lost; their heads are copied to
/// netlink log group [`DROPPED_GROUP`] first (at a bounded rate), for the
/// gateway to log. (The filter chain runs after NAT: redirected DNS has a
/// loopback destination by then, and the kernel's own ICMP errors go to the
/// box's address.)
fn rules() -> String {
    format!(
        "table inet moat {{
  chain out {{
    type nat hook output priority -100; policy accept;
    meta l4proto {{ tcp, udp }} th dport 53 redirect to :{DNS_PORT}
    ip daddr 127.0.0.0/8 return
    ip6 daddr ::1 return
    meta l4proto tcp redirect to :{PROXY_PORT}
  }}
  chain dropped {{
    type filter hook output priority 0; policy accept;
    ip daddr {{ 127.0.0.0/8, {BOX_SOURCE} }} return
    ip6 daddr ::1 return
    meta l4proto {{ udp, icmp, ipv6-icmp }} limit rate 50/second burst 100 packets log group {DROPPED_GROUP}
  }}
}}
"
    )
}

/// Sets up the namespace the caller is in (a new, empty one).
pub fn prepare() -> io::Result<()> {
    sys::loopback_up().map_err(|e| io::Error::other(format!("loopback up: {e}")))?;
    // Per network namespace: let the box's root bind low ports and ping, which
    // the host-owned namespace would otherwise deny it.
    std::fs::write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")?;
    std::fs::write("/proc/sys/net/ipv4/ping_group_range", "0 2147483647")?;
    crate::host::netns::configure(&routes(), &rules())
}
