//! A box's network namespace: `lo` only, and every packet bound for the
//! outside turned back to the egress gateway's listeners on `lo`. There is no
//! device that leads anywhere, so nothing in the box can go around the
//! gateway; the namespace is owned by the host's user namespace, so root in
//! the box cannot change its routes or rules. A box whose gateway is not
//! there reaches nothing.
//!
//! The address, routes and rules are sent to the kernel over netlink here
//! (see [`crate::sys::netlink`]); [`RULES`] says the same rules in `nft`'s
//! words, and a test holds the two to be one ruleset.

use std::io;

use moat_core::egress::{BOX_SOURCE, DNS_PORT, DROPPED_GROUP, PROXY_PORT};
use nix::sys::socket::SockProtocol;

use crate::sys;
use crate::sys::netlink::{Message, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST};

/// The rules, as `nft -f` would take them. DNS to anywhere goes to the
/// gateway's DNS server; every other TCP connection off loopback goes to
/// its proxy, which reads where it was headed from the connection's NAT
/// record. Other UDP and ICMP leave `lo` for nowhere (no forwarding) and are
/// lost; their heads are copied to netlink log group [`DROPPED_GROUP`]
/// first (at a bounded rate, one for all three), for the gateway to log.
/// (The filter chain runs after NAT: redirected DNS has a loopback
/// destination by then, and the kernel's own ICMP errors go to the box's
/// address.)
pub const RULES: &str = "table inet moat {
  chain out {
    type nat hook output priority -100; policy accept;
    meta l4proto tcp th dport 53 redirect to :DNS_PORT
    meta l4proto udp th dport 53 redirect to :DNS_PORT
    ip daddr 127.0.0.0/8 return
    ip6 daddr ::1 return
    meta l4proto tcp redirect to :PROXY_PORT
  }
  chain dropped {
    type filter hook output priority 0; policy accept;
    ip daddr 127.0.0.0/8 return
    ip daddr BOX_SOURCE return
    ip6 daddr ::1 return
    meta l4proto udp jump report
    meta l4proto icmp jump report
    meta l4proto ipv6-icmp jump report
  }
  chain report {
    limit rate 50/second burst 100 packets log group DROPPED_GROUP
  }
}
";

/// Sets up the namespace the caller is in (a new, empty one).
pub fn prepare() -> io::Result<()> {
    sys::loopback_up().map_err(|e| io::Error::other(format!("loopback up: {e}")))?;
    // Per network namespace: let the box's root bind low ports and ping, which
    // the host-owned namespace would otherwise deny it.
    std::fs::write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")?;
    std::fs::write("/proc/sys/net/ipv4/ping_group_range", "0 2147483647")?;
    sys::netlink::request(SockProtocol::NetlinkRoute, routes())?;
    sys::netlink::request(SockProtocol::NetlinkNetFilter, rules())
}

/// Every namespace's loopback device has index 1.
const LO: u32 = 1;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_PREFSRC: u16 = 7;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_LINK: u8 = 253;
const RTN_UNICAST: u8 = 1;

/// Everything leaves through `lo`, so that the rules see it (a packet with
/// no route fails before any rule runs), from an address of the box's own
/// (a packet from no address gets no reply): `ip address add BOX_SOURCE/32
/// dev lo`, `ip route add default dev lo src BOX_SOURCE`, `ip route add
/// ::/0 dev lo`.
fn routes() -> Vec<Message> {
    let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
    let source = BOX_SOURCE.octets();
    let family = |family: i32| u8::try_from(family).unwrap_or_default();
    // ifaddrmsg: family, prefix length, flags, scope, device.
    let mut address = [family(libc::AF_INET), 32, 0, RT_SCOPE_UNIVERSE].to_vec();
    address.extend(LO.to_ne_bytes());
    let mut address = Message::new("add the box's address", RTM_NEWADDR, flags, &address);
    address.attr(IFA_LOCAL, &source).attr(IFA_ADDRESS, &source);
    // rtmsg: family, destination and source lengths, tos, table, protocol,
    // scope, type, flags: a default route.
    let route = |family: u8, scope: u8| {
        let mut rtmsg = [family, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, scope, RTN_UNICAST].to_vec();
        rtmsg.extend(0u32.to_ne_bytes());
        rtmsg
    };
    let mut v4 =
        Message::new("route IPv4 through lo", RTM_NEWROUTE, flags, &route(family(libc::AF_INET), RT_SCOPE_LINK));
    v4.ne32(RTA_OIF, LO).attr(RTA_PREFSRC, &source);
    let mut v6 =
        Message::new("route IPv6 through lo", RTM_NEWROUTE, flags, &route(family(libc::AF_INET6), RT_SCOPE_UNIVERSE));
    v6.ne32(RTA_OIF, LO);
    vec![address, v4, v6]
}

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFPROTO_INET: u8 = 1;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NF_INET_LOCAL_OUT: u32 = 3;
const NF_ACCEPT: u32 = 1;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
/// The verdict register, and the first data register (16 bytes).
const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_META_NFPROTO: u32 = 15;
const NFT_META_L4PROTO: u32 = 16;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFT_CMP_EQ: u32 = 0;
const NFT_JUMP: i32 = -3;
const NFT_RETURN: i32 = -5;
/// `NF_NAT_RANGE_PROTO_SPECIFIED`: the redirect names a port.
const REDIRECT_TO_PORT: u32 = 2;
const NFT_LIMIT_PKTS: u32 = 0;
const TABLE: &str = "moat";
const IPV4: u8 = 2;
const IPV6: u8 = 10;
const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;

/// One step of a rule (an nf_tables expression), all through register 1.
enum Expr {
    /// Loads a packet's meta key.
    Meta(u32),
    /// Loads `len` bytes at `offset` of a header.
    Payload { base: u32, offset: u32, len: u32 },
    /// Goes on only if what was loaded is these bytes.
    Is(Vec<u8>),
    /// Loads these bytes.
    Load(Vec<u8>),
    /// Sends the connection to the loaded port of the namespace's loopback.
    Redirect,
    /// Ends the chain.
    Return,
    /// Goes on in another chain.
    Jump(&'static str),
    /// Goes on at most 50 packets a second (100 at once).
    Limit,
    /// Copies the packet's head to the gateway's log group.
    Log,
}

/// A rule: these steps, in order.
fn steps<const N: usize>(parts: [Vec<Expr>; N]) -> Vec<Expr> {
    parts.into_iter().flatten().collect()
}

/// `meta l4proto P`.
fn protocol(p: u8) -> Vec<Expr> {
    vec![Expr::Meta(NFT_META_L4PROTO), Expr::Is(vec![p])]
}

/// `ip daddr` starting with these bytes (`127.0.0.0/8`: one byte).
fn ip_to(first_bytes: &[u8]) -> Vec<Expr> {
    let len = u32::try_from(first_bytes.len()).unwrap_or_default();
    vec![
        Expr::Meta(NFT_META_NFPROTO),
        Expr::Is(vec![IPV4]),
        Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset: 16, len },
        Expr::Is(first_bytes.to_vec()),
    ]
}

/// `ip6 daddr ::1`.
fn ip6_to_loopback() -> Vec<Expr> {
    vec![
        Expr::Meta(NFT_META_NFPROTO),
        Expr::Is(vec![IPV6]),
        Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset: 24, len: 16 },
        Expr::Is(std::net::Ipv6Addr::LOCALHOST.octets().to_vec()),
    ]
}

/// `th dport 53`.
fn to_dns() -> Vec<Expr> {
    vec![
        Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset: 2, len: 2 },
        Expr::Is(53u16.to_be_bytes().to_vec()),
    ]
}

/// `redirect to :PORT`.
fn redirect_to(port: u16) -> Vec<Expr> {
    vec![Expr::Load(port.to_be_bytes().to_vec()), Expr::Redirect]
}

/// The same ruleset as [`RULES`], as one nf_tables transaction.
fn rules() -> Vec<Message> {
    let out = [
        steps([protocol(TCP), to_dns(), redirect_to(DNS_PORT)]),
        steps([protocol(UDP), to_dns(), redirect_to(DNS_PORT)]),
        steps([ip_to(&[127]), vec![Expr::Return]]),
        steps([ip6_to_loopback(), vec![Expr::Return]]),
        steps([protocol(TCP), redirect_to(PROXY_PORT)]),
    ];
    let dropped = [
        steps([ip_to(&[127]), vec![Expr::Return]]),
        steps([ip_to(&BOX_SOURCE.octets()), vec![Expr::Return]]),
        steps([ip6_to_loopback(), vec![Expr::Return]]),
        steps([protocol(UDP), vec![Expr::Jump("report")]]),
        steps([protocol(ICMP), vec![Expr::Jump("report")]]),
        steps([protocol(ICMPV6), vec![Expr::Jump("report")]]),
    ];
    let mut table = nft("add table inet moat", NFT_MSG_NEWTABLE, 0);
    table.string(NFTA_TABLE_NAME, TABLE);
    let mut report = nft("add chain report", NFT_MSG_NEWCHAIN, 0);
    report.string(NFTA_CHAIN_TABLE, TABLE).string(NFTA_CHAIN_NAME, "report");
    let mut batch = vec![
        batch_marker(NFNL_MSG_BATCH_BEGIN),
        table,
        base_chain("add chain out", "out", "nat", -100),
        base_chain("add chain dropped", "dropped", "filter", 0),
        report,
    ];
    batch.extend(out.iter().map(|r| rule("add a rule to chain out", "out", r)));
    batch.extend(dropped.iter().map(|r| rule("add a rule to chain dropped", "dropped", r)));
    batch.push(rule("add a rule to chain report", "report", &[Expr::Limit, Expr::Log]));
    batch.push(batch_marker(NFNL_MSG_BATCH_END));
    batch
}

/// A message to nf_tables about table `moat`, in family `inet`.
fn nft(what: &'static str, kind: u16, extra: u16) -> Message {
    let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | extra;
    Message::new(what, (NFNL_SUBSYS_NFTABLES << 8) | kind, flags, &[NFPROTO_INET, 0, 0, 0])
}

/// Where a transaction begins or ends (answered only if refused).
fn batch_marker(kind: u16) -> Message {
    let mut nfgenmsg = vec![0u8, 0];
    nfgenmsg.extend(NFNL_SUBSYS_NFTABLES.to_be_bytes());
    Message::new("an nf_tables transaction", kind, NLM_F_REQUEST, &nfgenmsg)
}

/// A chain on the output hook, accepting what no rule ends.
fn base_chain(what: &'static str, name: &str, kind: &str, priority: i32) -> Message {
    let mut m = nft(what, NFT_MSG_NEWCHAIN, 0);
    m.string(NFTA_CHAIN_TABLE, TABLE).string(NFTA_CHAIN_NAME, name);
    m.nest(NFTA_CHAIN_HOOK).be32(NFTA_HOOK_HOOKNUM, NF_INET_LOCAL_OUT);
    m.attr(NFTA_HOOK_PRIORITY, &priority.to_be_bytes()).end();
    m.be32(NFTA_CHAIN_POLICY, NF_ACCEPT).string(NFTA_CHAIN_TYPE, kind);
    m
}

fn rule(what: &'static str, chain: &str, exprs: &[Expr]) -> Message {
    let mut m = nft(what, NFT_MSG_NEWRULE, NLM_F_APPEND);
    m.string(NFTA_RULE_TABLE, TABLE).string(NFTA_RULE_CHAIN, chain);
    m.nest(NFTA_RULE_EXPRESSIONS);
    for expr in exprs {
        m.nest(NFTA_LIST_ELEM);
        encode(&mut m, expr);
        m.end();
    }
    m.end();
    m
}

fn encode(m: &mut Message, expr: &Expr) {
    let name = match expr {
        Expr::Meta(_) => "meta",
        Expr::Payload { .. } => "payload",
        Expr::Is(_) => "cmp",
        Expr::Load(_) | Expr::Return | Expr::Jump(_) => "immediate",
        Expr::Redirect => "redir",
        Expr::Limit => "limit",
        Expr::Log => "log",
    };
    m.string(NFTA_EXPR_NAME, name).nest(NFTA_EXPR_DATA);
    // Each expression's attributes, numbered as its own NFTA_* enum.
    match expr {
        Expr::Meta(key) => {
            m.be32(1, NFT_REG_1).be32(2, *key);
        }
        Expr::Payload { base, offset, len } => {
            m.be32(1, NFT_REG_1).be32(2, *base).be32(3, *offset).be32(4, *len);
        }
        Expr::Is(value) => {
            m.be32(1, NFT_REG_1).be32(2, NFT_CMP_EQ).nest(3).attr(NFTA_DATA_VALUE, value).end();
        }
        Expr::Load(value) => {
            m.be32(1, NFT_REG_1).nest(2).attr(NFTA_DATA_VALUE, value).end();
        }
        Expr::Redirect => {
            m.be32(1, NFT_REG_1).be32(3, REDIRECT_TO_PORT);
        }
        Expr::Return | Expr::Jump(_) => {
            m.be32(1, NFT_REG_VERDICT).nest(2).nest(NFTA_DATA_VERDICT);
            match expr {
                Expr::Jump(chain) => {
                    m.attr(NFTA_VERDICT_CODE, &NFT_JUMP.to_be_bytes()).string(NFTA_VERDICT_CHAIN, chain)
                }
                _ => m.attr(NFTA_VERDICT_CODE, &NFT_RETURN.to_be_bytes()),
            };
            m.end().end();
        }
        Expr::Limit => {
            m.attr(1, &50u64.to_be_bytes())
                .attr(2, &1u64.to_be_bytes())
                .be32(3, 100)
                .be32(4, NFT_LIMIT_PKTS)
                .be32(5, 0);
        }
        Expr::Log => {
            m.attr(1, &DROPPED_GROUP.to_be_bytes());
        }
    }
    m.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`RULES`] as `nft -f` takes it.
    fn rules_text() -> String {
        RULES
            .replace("DNS_PORT", &DNS_PORT.to_string())
            .replace("PROXY_PORT", &PROXY_PORT.to_string())
            .replace("BOX_SOURCE", &BOX_SOURCE.to_string())
            .replace("DROPPED_GROUP", &DROPPED_GROUP.to_string())
    }

    /// How `ip` and `nft` list a new network namespace after `set_up`
    /// (`None`: this test may not make one, not being root).
    fn listed_after(set_up: impl FnOnce() -> io::Result<()> + Send) -> Option<String> {
        std::thread::scope(|s| {
            s.spawn(|| {
                // Only this thread moves; the commands below start from it.
                match nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
                    Err(nix::errno::Errno::EPERM) => return None,
                    other => other.expect("a network namespace"),
                }
                set_up().expect("set up the namespace");
                let run = |tool: &str, args: &[&str]| {
                    let out = std::process::Command::new(tool).args(args).output().expect("run a listing tool");
                    assert!(out.status.success(), "{tool} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
                    String::from_utf8_lossy(&out.stdout).into_owned()
                };
                let listed = [
                    run("ip", &["address", "show", "dev", "lo"]),
                    run("ip", &["route", "show", "table", "all"]),
                    run("ip", &["-6", "route", "show", "table", "all"]),
                    run("nft", &["list", "ruleset"]),
                    // The bytecode itself: registers, lengths, byte order.
                    run("nft", &["--debug=netlink", "list", "ruleset"]),
                ];
                Some(listed.concat())
            })
            .join()
            .expect("the namespace's thread")
        })
    }

    #[test]
    fn what_netlink_sets_up_is_what_ip_and_nft_would() {
        let Some(ours) = listed_after(prepare) else {
            eprintln!("skipped: making a network namespace takes root");
            return;
        };
        let theirs = listed_after(|| {
            sys::loopback_up()?;
            let routes = format!(
                "address add {BOX_SOURCE}/32 dev lo\nroute add default dev lo src {BOX_SOURCE}\nroute add ::/0 dev lo\n"
            );
            crate::host::netns::configure(&routes, &rules_text())
        })
        .expect("a namespace, as before");
        assert_eq!(ours, theirs);
        let bytecode = "[ payload load 16b @ network header + 24 => reg 1 ]";
        for said in ["redirect to :53", "redirect to :1", "log group 1", "src 198.18.0.1", "jump report", bytecode] {
            assert!(ours.contains(said), "{said:?} not in:\n{ours}");
        }
    }

    #[test]
    fn a_refused_request_names_what_was_refused() {
        let refused = std::thread::scope(|s| {
            s.spawn(|| {
                match nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
                    Err(nix::errno::Errno::EPERM) => return None,
                    other => other.expect("a network namespace"),
                }
                sys::loopback_up().expect("lo up");
                sys::netlink::request(SockProtocol::NetlinkRoute, routes()).expect("the routes, once");
                // The same address again is refused (it exists), by name.
                Some(sys::netlink::request(SockProtocol::NetlinkRoute, routes()))
            })
            .join()
            .expect("the namespace's thread")
        });
        let Some(refused) = refused else { return };
        let e = refused.expect_err("an address added twice");
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert!(e.to_string().contains("add the box's address"), "{e}");
    }
}
