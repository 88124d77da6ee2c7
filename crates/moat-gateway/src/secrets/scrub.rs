//! Cutting a box's secret values out of what reaches it: every form in which
//! a host may echo a value (as it is, in a JSON string, percent-encoded) is
//! replaced, however the bytes are split across reads, and what is held back
//! between reads says nothing of the values.

/// What a value is replaced with.
const REMOVED: &[u8] = b"[secret removed by moat]";

/// Cuts secret values out of a stream of bytes. What it holds back for the
/// next bytes is decided without looking at the values (the trailing run of
/// printable bytes, as long as the longest form less one): were it the tail
/// that starts a value, the sizes of the pieces the box gets would tell it,
/// byte by byte, what the value starts with. A streamed response (server-sent
/// events, whose events end in a newline) still reaches the box event by event.
pub struct Scrubber {
    forms: Vec<Vec<u8>>,
    longest: usize,
    pending: Vec<u8>,
}

impl Scrubber {
    /// Cuts out each of `values` as it is, and as JSON strings and URLs
    /// write it.
    pub fn new(values: &[String]) -> Self {
        let mut forms: Vec<Vec<u8>> = Vec::new();
        for v in values.iter().filter(|v| !v.is_empty()) {
            for form in encodings(v) {
                if !forms.contains(&form) {
                    forms.push(form);
                }
            }
        }
        let longest = forms.iter().map(Vec::len).max().unwrap_or(0);
        Self { forms, longest, pending: Vec::new() }
    }

    /// What of `data` (and what came before) is safe to pass on now.
    pub fn push(&mut self, data: &[u8]) -> Vec<u8> {
        self.pending.extend_from_slice(data);
        self.cut();
        let ready = self.pending.len() - self.held();
        self.pending.drain(..ready).collect()
    }

    /// How much of the end of what is pending could be the start of a value
    /// (values are printable ASCII): the same whatever the values are.
    fn held(&self) -> usize {
        let printable = self.pending.iter().rev().take_while(|b| (0x20..0x7f).contains(*b)).count();
        printable.min(self.longest.saturating_sub(1))
    }

    /// The rest, at the end of the stream.
    pub fn finish(&mut self) -> Vec<u8> {
        self.cut();
        std::mem::take(&mut self.pending)
    }

    fn cut(&mut self) {
        for value in &self.forms {
            let mut at = 0;
            while let Some(i) = self.pending.get(at..).and_then(|p| find(p, value)) {
                let start = at + i;
                self.pending.splice(start..start + value.len(), REMOVED.iter().copied());
                at = start + REMOVED.len();
            }
        }
    }
}

/// The ways a response may spell `value`: as it is; in a JSON string
/// (quotes and backslashes escaped, with or without `/` escaped, or every
/// character that is not a letter or digit as `\u00XX`); percent-encoded,
/// in either case of hex.
fn encodings(value: &str) -> Vec<Vec<u8>> {
    let json = value.replace('\\', "\\\\").replace('"', "\\\"");
    let mut forms = vec![value.to_string(), json.clone(), json.replace('/', "\\/")];
    let escaped = |f: &dyn Fn(u8) -> String| -> String {
        value.bytes().map(|b| if b.is_ascii_alphanumeric() { char::from(b).to_string() } else { f(b) }).collect()
    };
    forms.push(escaped(&|b| format!("\\u{b:04x}")));
    forms.push(escaped(&|b| format!("\\u{b:04X}")));
    let unreserved = |b: u8| b.is_ascii_alphanumeric() || b"-._~".contains(&b);
    let percent = |upper: bool| -> String {
        value
            .bytes()
            .map(|b| match (unreserved(b), upper) {
                (true, _) => char::from(b).to_string(),
                (false, true) => format!("%{b:02X}"),
                (false, false) => format!("%{b:02x}"),
            })
            .collect()
    };
    forms.push(percent(true));
    forms.push(percent(false));
    forms.into_iter().map(String::into_bytes).collect()
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn values_are_cut_however_the_stream_is_split() {
        let text = b"a sk-REAL/x b \"sk-REAL\\/x\" sk-REAL/";
        for split in 0..text.len() {
            let mut s = Scrubber::new(&["sk-REAL/x".into()]);
            let mut out = s.push(&text[..split]);
            out.extend(s.push(&text[split..]));
            out.extend(s.finish());
            let out = String::from_utf8(out).unwrap();
            assert!(!out.contains("sk-REAL/x") && !out.contains("sk-REAL\\/x"), "{split}: {out}");
            assert!(out.ends_with("sk-REAL/"), "{out}");
        }
    }

    #[test]
    fn what_is_held_back_says_nothing_of_the_values() {
        // The same bytes pass in the same pieces whatever the value is: a
        // box cannot learn which text starts it from the pieces' sizes.
        let input: [&[u8]; 4] = [b"data: {\"x\":1}\n\n", b"guess sk-RE", b"AL-01", b"x\n"];
        let pieces = |value: &str| {
            let mut s = Scrubber::new(&[value.to_string()]);
            input.iter().map(|d| s.push(d).len()).collect::<Vec<_>>()
        };
        assert_eq!(pieces("sk-REAL-0123456789"), pieces("zz-OTHER-987654321"));
        // Events, which end in a newline, are not held back at all.
        let mut s = Scrubber::new(&["sk-REAL-0123456789".into()]);
        assert_eq!(s.push(b"data: {\"x\":1}\n\n"), b"data: {\"x\":1}\n\n");
        assert_eq!(s.push(b"event sk-REAL-01"), b"");
        assert_eq!(s.push(b"23456789!\n"), b"event [secret removed by moat]!\n");
    }

    #[test]
    fn values_are_cut_as_json_and_urls_spell_them() {
        let value = "sk+a/b\"c";
        for form in ["sk+a/b\\\"c", "sk+a\\/b\\\"c", "sk\\u002ba\\u002fb\\u0022c", "sk%2Ba%2Fb%22c", "sk%2ba%2fb%22c"] {
            let mut s = Scrubber::new(&[value.to_string()]);
            let mut out = s.push(format!("x {form} y").as_bytes());
            out.extend(s.finish());
            assert_eq!(out, b"x [secret removed by moat] y", "{form}");
        }
    }
}
