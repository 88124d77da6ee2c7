//! HTTP/1.x as the gateway reads it: request heads from boxes, response heads
//! from hosts whose answers it checks, and chunked bodies both ways. These
//! parse hostile bytes: anything that could be read two ways is refused.

pub mod chunked;
pub mod request;
pub mod response;
