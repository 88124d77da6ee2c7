//! The DNS wire format, as much as the gateway needs: reading a box's query
//! and writing the answer, and asking the upstream resolver for a name's
//! addresses. Every read is bounds-checked; malformed input is an error,
//! never a panic.

use std::net::{Ipv4Addr, Ipv6Addr};

use moat_core::policy::HostName;

/// Record types the gateway knows by name.
pub const TYPE_A: u16 = 1;
/// CNAME.
pub const TYPE_CNAME: u16 = 5;
/// AAAA.
pub const TYPE_AAAA: u16 = 28;
/// Class IN.
pub const CLASS_IN: u16 = 1;

/// Response codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rcode {
    /// An answer (possibly with no records).
    NoError = 0,
    /// The query was malformed.
    FormErr = 1,
    /// The resolver failed.
    ServFail = 2,
    /// No such name.
    NxDomain = 3,
    /// A kind of query not served.
    NotImp = 4,
    /// Refused.
    Refused = 5,
}

/// Why bytes are not a message the gateway serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DnsError {
    /// Shorter than it says it is, or than a header.
    #[error("truncated message")]
    Truncated,
    /// A name that breaks the format's rules (length, pointers).
    #[error("malformed name")]
    BadName,
    /// Not a standard query with one question.
    #[error("not a standard query with one question")]
    NotAQuery,
    /// An answer to a different question.
    #[error("answer does not match the question")]
    Mismatch,
}

/// A box's query, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query<'a> {
    /// The query id, echoed.
    pub id: u16,
    /// Recursion desired, echoed.
    pub rd: bool,
    /// The question as sent (name, type, class), echoed byte for byte.
    pub question: &'a [u8],
    /// The name, normalised; `None` if it is no host name (a NUL, a dot inside
    /// a label, an address): such a name gets no address.
    pub name: Option<HostName>,
    /// The name as text, for the log (non-printable bytes escaped).
    pub shown: String,
    /// The record type asked for.
    pub qtype: u16,
    /// The class asked for.
    pub qclass: u16,
}

fn u16_at(msg: &[u8], at: usize) -> Result<u16, DnsError> {
    let bytes = msg.get(at..at + 2).and_then(|b| <[u8; 2]>::try_from(b).ok()).ok_or(DnsError::Truncated)?;
    Ok(u16::from_be_bytes(bytes))
}

/// Reads a query: a standard query (opcode 0) with exactly one question whose
/// name is not compressed. Additional records (EDNS) are ignored.
pub fn parse_query(msg: &[u8]) -> Result<Query<'_>, DnsError> {
    if msg.len() < 12 {
        return Err(DnsError::Truncated);
    }
    let id = u16_at(msg, 0)?;
    let flags = u16_at(msg, 2)?;
    let (qr, opcode) = (flags >> 15, (flags >> 11) & 0xf);
    let counts = [u16_at(msg, 4)?, u16_at(msg, 6)?, u16_at(msg, 8)?];
    if qr != 0 || opcode != 0 || counts != [1, 0, 0] {
        return Err(DnsError::NotAQuery);
    }
    let mut at = 12;
    let mut labels: Vec<&[u8]> = Vec::new();
    let mut wire_len = 1;
    loop {
        let len = *msg.get(at).ok_or(DnsError::Truncated)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        // No pointers (or the reserved label types) in a question.
        if len > 63 {
            return Err(DnsError::BadName);
        }
        wire_len += len + 1;
        if wire_len > 255 {
            return Err(DnsError::BadName);
        }
        labels.push(msg.get(at..at + len).ok_or(DnsError::Truncated)?);
        at += len;
    }
    let qtype = u16_at(msg, at)?;
    let qclass = u16_at(msg, at + 2)?;
    let question = msg.get(12..at + 4).ok_or(DnsError::Truncated)?;
    let shown = show_name(&labels);
    // A label holding a dot would read as two labels once joined: no name.
    let plain = labels.iter().all(|l| !l.contains(&b'.'));
    let name = if plain && !labels.is_empty() { HostName::parse(&shown).ok() } else { None };
    Ok(Query { id, rd: flags & 0x0100 != 0, question, name, shown, qtype, qclass })
}

/// The labels as text, bytes outside printable ASCII (and backslash) escaped.
fn show_name(labels: &[&[u8]]) -> String {
    let mut out = String::new();
    for (i, label) in labels.iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        for &b in *label {
            // A dot inside a label is escaped, as in a zone file: a label
            // "\bweb.test" is not the name web.test.
            if b.is_ascii_graphic() && b != b'\\' && b != b'.' {
                out.push(b as char);
            } else {
                out.push_str(&format!("\\{b:03}"));
            }
        }
    }
    if out.is_empty() {
        out.push('.');
    }
    out
}

/// An answer to `query`: its question echoed, and an A or AAAA record for
/// each address given (which must match the question's type).
pub fn answer(query: &Query<'_>, rcode: Rcode, v4: Option<Ipv4Addr>, v6: Option<Ipv6Addr>, ttl: u32) -> Vec<u8> {
    let records: Vec<(u16, Vec<u8>)> = v4
        .map(|a| (TYPE_A, a.octets().to_vec()))
        .into_iter()
        .chain(v6.map(|a| (TYPE_AAAA, a.octets().to_vec())))
        .collect();
    // QR, AA, RA, and RD as asked.
    let flags: u16 = 0x8000 | 0x0400 | 0x0080 | if query.rd { 0x0100 } else { 0 } | rcode as u16;
    let mut out = Vec::with_capacity(12 + query.question.len() + records.len() * 28);
    out.extend_from_slice(&query.id.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    for count in [1, records.len() as u16, 0, 0] {
        out.extend_from_slice(&count.to_be_bytes());
    }
    out.extend_from_slice(query.question);
    for (rtype, data) in records {
        // The owner is the question's name (a pointer to offset 12).
        out.extend_from_slice(&0xc00cu16.to_be_bytes());
        out.extend_from_slice(&rtype.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(&data);
    }
    out
}

/// A reply to bytes that are not a query we read: FORMERR, echoing the id
/// if there is one (nothing for fewer than two bytes).
pub fn format_error(msg: &[u8]) -> Option<Vec<u8>> {
    let id = msg.get(..2)?;
    let mut out = id.to_vec();
    out.extend_from_slice(&(0x8000u16 | Rcode::FormErr as u16).to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    Some(out)
}

/// A recursive query for `name`'s records of `qtype`, with id `id`.
pub fn upstream_query(id: u16, name: &HostName, qtype: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(18 + name.as_str().len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&0x0100u16.to_be_bytes());
    for count in [1u16, 0, 0, 0] {
        out.extend_from_slice(&count.to_be_bytes());
    }
    for label in name.as_str().split('.') {
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out.extend_from_slice(&qtype.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    out
}

/// What the upstream resolver said.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Its response code.
    pub rcode: u16,
    /// Whether it was truncated (ask again over TCP).
    pub truncated: bool,
    /// IPv4 addresses in the answer.
    pub v4: Vec<Ipv4Addr>,
    /// IPv6 addresses in the answer.
    pub v6: Vec<Ipv6Addr>,
    /// The smallest TTL among them.
    pub ttl: u32,
}

/// Reads the upstream resolver's answer to [`upstream_query`]`(id, name, _)`:
/// it must echo the id and the question. Records of the answer section for
/// the name or any name a CNAME in it leads to are taken.
pub fn parse_upstream(msg: &[u8], id: u16, name: &HostName) -> Result<Resolved, DnsError> {
    if msg.len() < 12 {
        return Err(DnsError::Truncated);
    }
    let flags = u16_at(msg, 2)?;
    if u16_at(msg, 0)? != id || flags & 0x8000 == 0 || u16_at(msg, 4)? != 1 {
        return Err(DnsError::Mismatch);
    }
    let ancount = u16_at(msg, 6)?;
    let (qname, mut at) = read_name(msg, 12)?;
    if !qname.eq_ignore_ascii_case(name.as_str()) {
        return Err(DnsError::Mismatch);
    }
    at += 4;
    let mut out = Resolved { rcode: flags & 0xf, truncated: flags & 0x0200 != 0, ttl: u32::MAX, ..Resolved::default() };
    let mut names = vec![qname];
    for _ in 0..ancount {
        let (owner, next) = read_name(msg, at)?;
        let rtype = u16_at(msg, next)?;
        let ttl = u32::from(u16_at(msg, next + 4)?) << 16 | u32::from(u16_at(msg, next + 6)?);
        let len = u16_at(msg, next + 8)? as usize;
        let data_at = next + 10;
        let data = msg.get(data_at..data_at + len).ok_or(DnsError::Truncated)?;
        at = data_at + len;
        if !names.iter().any(|n| n.eq_ignore_ascii_case(&owner)) {
            continue;
        }
        match (rtype, data.len()) {
            (TYPE_A, 4) => out.v4.push(Ipv4Addr::from(<[u8; 4]>::try_from(data).map_err(|_| DnsError::Truncated)?)),
            (TYPE_AAAA, 16) => {
                out.v6.push(Ipv6Addr::from(<[u8; 16]>::try_from(data).map_err(|_| DnsError::Truncated)?))
            }
            (TYPE_CNAME, _) => {
                names.push(read_name(msg, data_at)?.0);
                continue;
            }
            _ => continue,
        }
        out.ttl = out.ttl.min(ttl);
    }
    if out.ttl == u32::MAX {
        out.ttl = 0;
    }
    Ok(out)
}

/// Reads a possibly compressed name at `at`; returns it as text and the
/// offset just past it where it starts. Pointers must point backwards, so
/// a loop cannot be written.
fn read_name(msg: &[u8], mut at: usize) -> Result<(String, usize), DnsError> {
    let mut name = String::new();
    let mut end = None;
    let mut limit = at;
    loop {
        let len = *msg.get(at).ok_or(DnsError::Truncated)? as usize;
        match len >> 6 {
            0 if len == 0 => break,
            0 => {
                let label = msg.get(at + 1..at + 1 + len).ok_or(DnsError::Truncated)?;
                if !name.is_empty() {
                    name.push('.');
                }
                // Labels of other bytes match no name we asked for.
                name.extend(label.iter().map(|&b| if b.is_ascii_graphic() && b != b'.' { b as char } else { '?' }));
                if name.len() > 255 {
                    return Err(DnsError::BadName);
                }
                at += 1 + len;
            }
            3 => {
                let target = u16_at(msg, at)? as usize & 0x3fff;
                if target >= limit {
                    return Err(DnsError::BadName);
                }
                end.get_or_insert(at + 2);
                limit = target;
                at = target;
            }
            _ => return Err(DnsError::BadName),
        }
    }
    Ok((name, end.unwrap_or(at + 1)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    fn host(s: &str) -> HostName {
        HostName::parse(s).unwrap()
    }

    #[test]
    fn queries_round_trip() {
        let q = upstream_query(7, &host("Pypi.org"), TYPE_A);
        let query = parse_query(&q).unwrap();
        assert_eq!((query.id, query.qtype, query.qclass, query.rd), (7, TYPE_A, CLASS_IN, true));
        assert_eq!(query.name, Some(host("pypi.org")));
        let reply = answer(&query, Rcode::NoError, Some(Ipv4Addr::new(198, 18, 0, 9)), None, 60);
        let got = parse_upstream(&reply, 7, &host("pypi.org")).unwrap();
        assert_eq!(got.v4, vec![Ipv4Addr::new(198, 18, 0, 9)]);
        assert_eq!(got.ttl, 60);
        assert_eq!(parse_upstream(&reply, 8, &host("pypi.org")), Err(DnsError::Mismatch));
        assert_eq!(parse_upstream(&reply, 7, &host("evil.org")), Err(DnsError::Mismatch));
    }

    #[test]
    fn odd_names_are_no_names() {
        // One label "a.b", a label with a NUL, an address.
        for wire in [&b"\x03a.b\x00"[..], b"\x03a\x00b\x00", b"\x011\x011\x011\x011\x00"] {
            let mut q = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
            q.extend_from_slice(wire);
            q.extend_from_slice(&[0, 1, 0, 1]);
            let query = parse_query(&q).unwrap();
            assert_eq!(query.name, None, "{wire:?}");
        }
        // Shown as what it is: not the name "web.test".
        let mut q = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        q.extend_from_slice(b"\x09\x08web.test\x00\x00\x01\x00\x01");
        assert_eq!(parse_query(&q).unwrap().shown, "\\008web\\046test");
        let mut q = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xc0, 12, 0, 1, 0, 1];
        assert_eq!(parse_query(&q), Err(DnsError::BadName));
        q[5] = 2;
        assert_eq!(parse_query(&q), Err(DnsError::NotAQuery));
    }

    #[test]
    fn cname_chains_and_pointer_loops() {
        // Question pypi.org; answer: pypi.org CNAME x.net (compressed), x.net A, other A.
        let mut m = vec![0, 9, 0x81, 0x80, 0, 1, 0, 3, 0, 0, 0, 0];
        m.extend_from_slice(b"\x04pypi\x03org\x00\x00\x01\x00\x01");
        m.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 30, 0, 7]);
        let x_at = m.len() as u8;
        m.extend_from_slice(b"\x01x\x03net\x00");
        m.extend_from_slice(&[0xc0, x_at, 0, 1, 0, 1, 0, 0, 0, 20, 0, 4, 1, 2, 3, 4]);
        m.extend_from_slice(b"\x05other\x00\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04\x05\x06\x07\x08");
        let got = parse_upstream(&m, 9, &host("pypi.org")).unwrap();
        assert_eq!(got.v4, vec![Ipv4Addr::new(1, 2, 3, 4)]);
        assert_eq!(got.ttl, 20);
        // A pointer to itself.
        let mut l = vec![0, 9, 0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0];
        l.extend_from_slice(b"\x04pypi\x03org\x00\x00\x01\x00\x01");
        let here = l.len() as u8;
        l.extend_from_slice(&[0xc0, here]);
        assert_eq!(parse_upstream(&l, 9, &host("pypi.org")), Err(DnsError::BadName));
    }
}
