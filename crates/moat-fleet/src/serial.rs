//! A certificate's serial number, read from its DER: what names a fleet
//! member in the store (`fleet_members.serial`). The certificate has passed
//! the chain check before it is read here, but the reader still takes any
//! bytes without panicking.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

/// One DER element at the start of `input`: its tag, its contents, and what
/// follows it. `None` if it is cut short or its length is not one a
/// certificate uses (indefinite, or over four bytes of length).
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let (digits, rest) = (rest.get(..n)?, rest.get(n..)?);
        (digits.iter().fold(0usize, |len, &d| (len << 8) | usize::from(d)), rest)
    };
    Some((tag, rest.get(..len)?, rest.get(len..)?))
}

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
/// `[0] EXPLICIT Version`, present in every v3 certificate.
const VERSION: u8 = 0xa0;

/// The serial number of the certificate `der`, as lowercase hex without
/// leading zero bytes (the form moat registers members under).
pub fn of(der: &[u8]) -> Option<String> {
    let (SEQUENCE, cert, _) = element(der)? else { return None };
    let (SEQUENCE, tbs, _) = element(cert)? else { return None };
    let (tag, contents, rest) = element(tbs)?;
    let serial = match tag {
        VERSION => match element(rest)? {
            (INTEGER, serial, _) => serial,
            _ => return None,
        },
        INTEGER => contents,
        _ => return None,
    };
    let start = serial.iter().position(|&b| b != 0).unwrap_or(serial.len());
    let serial = serial.get(start..)?;
    (!serial.is_empty()).then(|| hex::encode(serial))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn the_serial_of_an_issued_certificate_is_read_back() {
        let ca = crate::pki::Ca::mint().unwrap();
        let leaf = ca.issue(crate::pki::Role::Node, "n1").unwrap();
        assert_eq!(of(leaf.cert.der()).as_deref(), Some(leaf.serial.as_str()));
        assert_eq!(leaf.serial.len(), 32);
    }

    #[test]
    fn any_bytes_are_read_without_panic() {
        assert_eq!(of(&[]), None);
        assert_eq!(of(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(of(&[0x30, 0x03, 0x30, 0x01, 0x02]), None);
        // A certificate whose serial is zero names no member.
        assert_eq!(of(&[0x30, 0x05, 0x30, 0x03, 0x02, 0x01, 0x00]), None);
        assert_eq!(of(&[0x30, 0x05, 0x30, 0x03, 0x02, 0x01, 0x2a]).as_deref(), Some("2a"));
        let ca = crate::pki::Ca::mint().unwrap();
        let der = ca.issue(crate::pki::Role::Front, "f1").unwrap().cert.der().to_vec();
        for cut in 0..der.len() {
            let _ = of(&der[..cut]);
        }
        let mut seed = 1u32;
        for i in 0..der.len() * 4 {
            let mut bent = der.clone();
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
            bent[i % der.len()] = (seed >> 16) as u8;
            let _ = of(&bent);
        }
    }
}
