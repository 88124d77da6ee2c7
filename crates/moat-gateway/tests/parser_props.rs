//! The gateway's readers of hostile bytes (DNS from a box and from upstream,
//! TLS ClientHello, HTTP heads, chunked bodies) never panic, on random bytes
//! or on mutations of valid input, and what they accept is well formed.

#![allow(missing_docs, clippy::unwrap_used, clippy::indexing_slicing)]

use moat_core::policy::HostName;
use moat_gateway::dns;
use moat_gateway::git::{commands, delta, pack, pktline};
use moat_gateway::http::chunked::ChunkedReader;
use moat_gateway::http::request as http;
use moat_gateway::tls::hello as tls;
use proptest::prelude::*;

fn mutate(mut bytes: Vec<u8>, pos: usize, byte: u8, op: u8) -> Vec<u8> {
    if bytes.is_empty() {
        return bytes;
    }
    let pos = pos % bytes.len();
    match op {
        0 => bytes[pos] = byte,
        1 => bytes.insert(pos, byte),
        _ => bytes.truncate(pos),
    }
    bytes
}

fn valid_query() -> Vec<u8> {
    dns::upstream_query(7, &HostName::parse("pypi.org").unwrap(), dns::TYPE_A)
}

fn valid_hello() -> Vec<u8> {
    let name = b"web.test";
    // server_name: list of one host_name entry.
    let mut sni = vec![0, 0, 0, 3 + 2 + name.len() as u8, 0, 3 + name.len() as u8, 0, 0, name.len() as u8];
    sni.extend_from_slice(name);
    let mut body = vec![3, 3];
    body.extend_from_slice(&[1; 32]);
    body.extend_from_slice(&[0, 0, 2, 0x13, 1, 1, 0]);
    body.extend_from_slice(&(sni.len() as u16).to_be_bytes());
    body.extend_from_slice(&sni);
    let mut hs = vec![1, 0, 0, body.len() as u8];
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1, 0, hs.len() as u8];
    rec.extend_from_slice(&hs);
    rec
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn dns_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(q) = dns::parse_query(&bytes) {
            if let Some(name) = &q.name {
                prop_assert!(HostName::parse(name.as_str()).is_ok());
            }
            let _ = dns::answer(&q, dns::Rcode::NxDomain, None, None, 0);
        }
        let _ = dns::format_error(&bytes);
        let _ = dns::parse_upstream(&bytes, 7, &HostName::parse("pypi.org").unwrap());
    }

    #[test]
    fn dns_mutations(pos in 0usize..64, byte in any::<u8>(), op in 0u8..3) {
        let bytes = mutate(valid_query(), pos, byte, op);
        if let Ok(q) = dns::parse_query(&bytes) {
            let reply = dns::answer(&q, dns::Rcode::NoError, Some(std::net::Ipv4Addr::new(198, 18, 0, 2)), None, 60);
            prop_assert_eq!(&reply[..2], &bytes[..2]);
        }
    }

    #[test]
    fn tls_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = tls::read_hello(&bytes);
    }

    #[test]
    fn tls_mutations(pos in 0usize..80, byte in any::<u8>(), op in 0u8..3) {
        if let tls::Hello::Name(name) = tls::read_hello(&mutate(valid_hello(), pos, byte, op)) {
            prop_assert!(HostName::parse(name.as_str()).is_ok());
        }
    }

    #[test]
    fn http_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = http::read_head(&bytes);
        let _ = ChunkedReader::default().feed(&bytes);
    }

    #[test]
    fn http_mutations(pos in 0usize..120, byte in any::<u8>(), op in 0u8..3) {
        let valid = b"POST http://web.test/a/b?c=%70 HTTP/1.1\r\nHost: web.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec();
        let bytes = mutate(valid, pos, byte, op);
        if let http::Head::Request(r) = http::read_head(&bytes) {
            prop_assert!(r.target.starts_with('/'));
            prop_assert!(r.head_len <= bytes.len());
            prop_assert!(!r.target.split('?').next().unwrap().split('/').any(|s| s == ".."));
            let mut chunked = ChunkedReader::default();
            if let Ok(n) = chunked.feed(&bytes[r.head_len..]) {
                prop_assert!(n <= bytes.len() - r.head_len);
            }
        }
    }
}

/// The inputs mutated above are accepted as they are (else the mutation
/// tests would test nothing).
#[test]
fn the_valid_inputs_are_valid() {
    assert!(dns::parse_query(&valid_query()).unwrap().name.is_some());
    assert_eq!(tls::read_hello(&valid_hello()), tls::Hello::Name(HostName::parse("web.test").unwrap()));
}

fn valid_push() -> Vec<u8> {
    let mut body = Vec::new();
    let first =
        format!("{} {} refs/heads/agent/x\0report-status side-band-64k push-options", "1".repeat(40), "2".repeat(40));
    pktline::encode(first.as_bytes(), &mut body);
    pktline::encode(format!("{} {} refs/tags/v1\n", "3".repeat(40), "0".repeat(40)).as_bytes(), &mut body);
    body.extend_from_slice(b"0000");
    pktline::encode(b"ci.skip", &mut body);
    body.extend_from_slice(b"0000PACK\0\0\0\x02\0\0\0\x00");
    body
}

proptest! {
    /// A push's command list, its pack and deltas, from random bytes or a
    /// valid push bent: refused or read, never a panic; what is read is
    /// inside the body.
    #[test]
    fn push_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), pos in any::<usize>(), byte in any::<u8>(), op in 0u8..3) {
        for body in [bytes.clone(), mutate(valid_push(), pos, byte, op)] {
            for ended in [false, true] {
                if let Ok(Some(list)) = commands::parse(&body, ended) {
                    prop_assert!(list.len <= body.len());
                }
            }
            let _ = pack::commits(&body, pack::Hash::Sha1);
            let _ = delta::apply(&bytes, &body, 1 << 16);
        }
        let mut packed = b"PACK\0\0\0\x02\0\0\0\x03".to_vec();
        packed.extend_from_slice(&bytes);
        let _ = pack::commits(&packed, pack::Hash::Sha256);
    }
}
