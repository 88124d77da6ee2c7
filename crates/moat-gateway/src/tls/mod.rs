//! TLS at the gateway: the server name read out of a box's ClientHello
//! without terminating TLS ([`hello`]), and, for the hosts whose requests must
//! be seen, TLS terminated with a leaf signed by the box's own CA
//! ([`leaves`]) and opened again to the real host ([`intercept`]).

pub mod hello;
pub mod intercept;
pub mod leaves;
