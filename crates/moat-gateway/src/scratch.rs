//! One receive buffer per thread for the readers every box has (its DNS
//! socket, its dropped-packet reports). A reader waits for readiness holding
//! no buffer of its own and reads into this one without awaiting, so ten
//! thousand idle boxes hold no buffers at all (each held 68 KiB before).

use std::cell::RefCell;

/// The largest read: a netlink batch of dropped-packet reports (a DNS
/// datagram is at most 4 KiB by EDNS, well within).
const SIZE: usize = 64 << 10;

thread_local! {
    static BUFFER: RefCell<Vec<u8>> = RefCell::new(vec![0; SIZE]);
}

/// Runs `f` on this thread's buffer. `f` must not await nor call this again
/// (it would find the buffer taken and get an empty one).
pub fn with<R>(f: impl FnOnce(&mut [u8]) -> R) -> R {
    BUFFER.with(|buffer| match buffer.try_borrow_mut() {
        Ok(mut buffer) => f(buffer.as_mut_slice()),
        Err(_) => f(&mut vec![0; SIZE]),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_nested_use_gets_a_buffer_of_its_own() {
        let (outer, inner) = super::with(|a| {
            a.fill(7);
            let inner = super::with(|b| {
                b.fill(9);
                b.len()
            });
            (a.iter().all(|x| *x == 7), inner)
        });
        assert!(outer, "the nested use wrote into the outer buffer");
        assert_eq!(inner, 64 << 10);
    }
}
