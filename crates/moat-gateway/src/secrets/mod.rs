//! A box's secrets at the gateway: written into requests to the one host each
//! is bound to ([`inject`]), counted against their limits ([`meter`]), and cut
//! out of every answer that host sends back ([`scrub`], through [`relay`]).
//! The box only ever holds placeholders.

pub mod inject;
pub mod meter;
pub mod relay;
pub mod scrub;
