//! DNS at the gateway: the wire format (a box's queries and the answers it
//! gets, and the gateway's own questions to the upstream resolver), and the
//! server each box's lookups reach.

pub mod server;
pub mod wire;

pub use wire::{
    answer, format_error, parse_query, parse_upstream, upstream_query, DnsError, Query, Rcode, Resolved, CLASS_IN,
    TYPE_A, TYPE_AAAA, TYPE_CNAME,
};
