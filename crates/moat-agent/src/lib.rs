//! moat-agent: the process that is PID 1 in every box, and the wire protocol the host
//! uses to talk to it.
//!
//! One protocol for both backends: the namespace backend carries it over a unix
//! socket, the VM backend will carry it over a virtio-serial port. Each connection
//! carries exactly one operation (an exec, a TCP connection into the box, or a
//! ping), so a transport only has to provide independent byte streams.

pub mod protocol;

#[cfg(feature = "client")]
pub mod client;
