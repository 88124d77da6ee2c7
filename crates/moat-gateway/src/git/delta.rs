//! git's delta format: the base's size and the result's as varints, then
//! instructions that copy a range of the base or insert literal bytes.
//! Applied only to objects that may be commits (small), every range checked.

/// Why a delta cannot be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    /// It names another size of base.
    #[error("a delta for another base")]
    WrongBase,
    /// Its result would be larger than allowed.
    #[error("a delta result too large")]
    TooLarge,
    /// An instruction that reads outside the delta or the base.
    #[error("a malformed delta")]
    Malformed,
}

/// A little-endian base-128 size at `*at`.
fn varint(data: &[u8], at: &mut usize) -> Result<u64, DeltaError> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *data.get(*at).ok_or(DeltaError::Malformed)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(DeltaError::Malformed)
}

/// `delta` applied to `base`; the result may be at most `max` bytes.
pub fn apply(base: &[u8], delta: &[u8], max: usize) -> Result<Vec<u8>, DeltaError> {
    let mut at = 0;
    if varint(delta, &mut at)? != base.len() as u64 {
        return Err(DeltaError::WrongBase);
    }
    let size = varint(delta, &mut at)?;
    let size = usize::try_from(size).ok().filter(|&s| s <= max).ok_or(DeltaError::TooLarge)?;
    let mut out = Vec::with_capacity(size);
    while let Some(&op) = delta.get(at) {
        at += 1;
        if op & 0x80 != 0 {
            // Copy: which offset and size bytes follow is in op's low bits.
            let mut fields = [0u64; 2];
            for (bit, field) in [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)] {
                if op & (1 << bit) != 0 {
                    let byte = *delta.get(at).ok_or(DeltaError::Malformed)?;
                    at += 1;
                    let shift = if field == 0 { bit * 8 } else { (bit - 4) * 8 };
                    if let Some(f) = fields.get_mut(field) {
                        *f |= u64::from(byte) << shift;
                    }
                }
            }
            let [offset, len] = fields;
            let len = if len == 0 { 0x10000 } else { len };
            let end = offset.checked_add(len).ok_or(DeltaError::Malformed)?;
            let range = usize::try_from(offset).ok().zip(usize::try_from(end).ok()).ok_or(DeltaError::Malformed)?;
            let piece = base.get(range.0..range.1).ok_or(DeltaError::Malformed)?;
            if out.len() + piece.len() > size {
                return Err(DeltaError::Malformed);
            }
            out.extend_from_slice(piece);
        } else if op != 0 {
            let piece = delta.get(at..at + usize::from(op)).ok_or(DeltaError::Malformed)?;
            at += usize::from(op);
            if out.len() + piece.len() > size {
                return Err(DeltaError::Malformed);
            }
            out.extend_from_slice(piece);
        } else {
            return Err(DeltaError::Malformed);
        }
    }
    if out.len() == size {
        Ok(out)
    } else {
        Err(DeltaError::Malformed)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_inserts() {
        let base = b"tree abc\nparent def\n";
        // base 20, result 13: copy 5 bytes at 0 ("tree "), insert "xyz", copy 5 at 4.
        let delta = [20, 11, 0x80 | 0x10, 5, 3, b'x', b'y', b'z', 0x80 | 0x01 | 0x10, 4, 3];
        assert_eq!(apply(base, &delta, 100).unwrap(), b"tree xyz ab");
        assert_eq!(apply(base, &[21, 1, 1, b'a'], 100), Err(DeltaError::WrongBase));
        assert_eq!(apply(base, &[20, 50, 1, b'a'], 10), Err(DeltaError::TooLarge));
        for bad in
            [&[20u8, 2, 0x80 | 0x01 | 0x10, 19, 5][..], &[20, 2, 5, b'a'], &[20, 2, 0], &[20, 3, 1, b'a'], &[20, 0xff]]
        {
            assert!(apply(base, bad, 100).is_err(), "{bad:?}");
        }
    }
}
