//! Cutting a box's secret values out of what reaches it: a value is found as
//! it is and however a host may escape it on the way back (JSON and
//! JavaScript string escapes, percent-encoding of any of its characters,
//! HTML character references, quotes doubled or shell-quoted, in any mix),
//! however the bytes are split across
//! reads, and what is held back between reads says nothing of the values. A
//! value transformed otherwise (base64, cut in parts) is not found: a bound
//! host must not echo the credentials it is sent.

/// What a value is replaced with.
const REMOVED: &[u8] = b"[secret removed by moat]";

/// The longest escape of one character this reads (`&#x00007E;`).
const LONGEST_ESCAPE: usize = 10;

/// Cuts secret values out of a stream of bytes. What it holds back for the
/// next bytes is decided without looking at the values (the trailing run of
/// printable bytes, as long as the longest spelling less one): were it the
/// tail that starts a value, the sizes of the pieces the box gets would tell
/// it, byte by byte, what the value starts with. A streamed response
/// (server-sent events, whose events end in a newline) still reaches the box
/// event by event.
pub struct Scrubber {
    values: Vec<Vec<u8>>,
    /// Whether a value holds a space, which a form writes as `+`.
    spaces: bool,
    longest: usize,
    pending: Vec<u8>,
}

impl Scrubber {
    /// Cuts out each of `values`, however escaped.
    pub fn new(values: &[String]) -> Self {
        let mut kept: Vec<Vec<u8>> = Vec::new();
        for v in values.iter().filter(|v| !v.is_empty()) {
            if !kept.iter().any(|k| k == v.as_bytes()) {
                kept.push(v.as_bytes().to_vec());
            }
        }
        let longest = kept.iter().map(Vec::len).max().unwrap_or(0) * LONGEST_ESCAPE;
        let spaces = kept.iter().any(|v| v.contains(&b' '));
        Self { values: kept, spaces, longest, pending: Vec::new() }
    }

    /// What of `data` (and what came before) is safe to pass on now.
    pub fn push(&mut self, data: &[u8]) -> Vec<u8> {
        self.pending.extend_from_slice(data);
        self.cut();
        let ready = self.pending.len() - self.held();
        self.pending.drain(..ready).collect()
    }

    /// How much of the end of what is pending could be the start of a value
    /// (values are printable ASCII, and so are their escapes): the same
    /// whatever the values are.
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
        // As it is: a value with escapes of its own (`%41`) reads otherwise decoded.
        for value in &self.values {
            let mut at = 0;
            while let Some(i) = self.pending.get(at..).and_then(|p| find(p, value)) {
                let start = at + i;
                self.pending.splice(start..start + value.len(), REMOVED.iter().copied());
                at = start + REMOVED.len();
            }
        }
        // Decoded, `+` as itself (a JSON string) and, for a value with a
        // space, as a space (a form).
        for plus_is_space in [false, true] {
            if plus_is_space && !self.spaces {
                break;
            }
            let (text, starts) = decode(&self.pending, plus_is_space);
            let mut cuts = Vec::new();
            let mut at = 0;
            while let Some((i, n)) = self
                .values
                .iter()
                .filter_map(|v| text.get(at..).and_then(|t| find(t, v)).map(|i| (at + i, v.len())))
                .min()
            {
                if let (Some(&from), Some(&to)) = (starts.get(i), starts.get(i + n)) {
                    cuts.push(from..to);
                }
                at = i + n;
            }
            for range in cuts.into_iter().rev() {
                self.pending.splice(range, REMOVED.iter().copied());
            }
        }
    }
}

/// `hay` with every escape read as the byte it stands for (a character
/// outside ASCII as NUL, which no value holds), and where each byte of the
/// result starts in `hay` (and, last, its length).
fn decode(hay: &[u8], plus_is_space: bool) -> (Vec<u8>, Vec<usize>) {
    let mut text = Vec::with_capacity(hay.len());
    let mut starts = Vec::with_capacity(hay.len() + 1);
    let mut i = 0;
    while let Some(rest) = hay.get(i..).filter(|r| !r.is_empty()) {
        let (byte, len) = escape(rest, plus_is_space).unwrap_or((rest.first().copied().unwrap_or(0), 1));
        starts.push(i);
        text.push(byte);
        i += len;
    }
    starts.push(hay.len());
    (text, starts)
}

/// The byte the escape at the start of `s` stands for, and its length.
fn escape(s: &[u8], plus_is_space: bool) -> Option<(u8, usize)> {
    let number = |digits: &[u8], radix: u32| -> Option<u8> {
        let text = std::str::from_utf8(digits).ok()?;
        if text.is_empty() || !text.chars().all(|c| c.is_digit(radix)) {
            return None;
        }
        Some(u32::from_str_radix(text, radix).ok().and_then(|n| u8::try_from(n).ok()).filter(u8::is_ascii).unwrap_or(0))
    };
    // The run of digits of `radix` (at most `most`) at the start of `s`.
    let digits =
        |s: &[u8], radix: u32, most: usize| s.iter().take(most).take_while(|c| (**c as char).is_digit(radix)).count();
    match s {
        [b'%', rest @ ..] => Some((number(rest.get(..2)?, 16)?, 3)),
        [b'\\', b'u', b'{', rest @ ..] => {
            let end = rest.iter().take(7).position(|&c| c == b'}')?;
            Some((number(rest.get(..end)?, 16)?, end + 4))
        }
        [b'\\', b'u', rest @ ..] => Some((number(rest.get(..4)?, 16)?, 6)),
        [b'\\', b'x', rest @ ..] => Some((number(rest.get(..2)?, 16)?, 4)),
        // JavaScript's octal escapes (`\163`), and its escapes of any other
        // character as itself (`\s`); a control character's (`\n`) stands
        // for no byte a value holds.
        [b'\\', rest @ ..] if rest.first().is_some_and(|c| (b'0'..=b'7').contains(c)) => {
            let n = digits(rest, 8, 3);
            Some((number(rest.get(..n)?, 8)?, n + 1))
        }
        [b'\\', c, ..] if c.is_ascii_graphic() && !b"bfnrtv".contains(c) => Some((*c, 2)),
        // A quote doubled (CSV, SQL) or closed, escaped and opened again (a
        // shell's `'\''` and `'"'"'`).
        [b'\'', b'"', b'\'', b'"', b'\'', ..] => Some((b'\'', 5)),
        [b'\'', b'\\', b'\'', b'\'', ..] => Some((b'\'', 4)),
        [b'"', b'"', ..] => Some((b'"', 2)),
        [b'\'', b'\'', ..] => Some((b'\'', 2)),
        // Character references, `;` optional as browsers read them.
        [b'&', b'#', b'x' | b'X', rest @ ..] => {
            let n = digits(rest, 16, 6);
            let semi = usize::from(rest.get(n) == Some(&b';'));
            Some((number(rest.get(..n)?, 16)?, n + semi + 3))
        }
        [b'&', b'#', rest @ ..] => {
            let n = digits(rest, 10, 7);
            let semi = usize::from(rest.get(n) == Some(&b';'));
            Some((number(rest.get(..n)?, 10)?, n + semi + 2))
        }
        [b'&', rest @ ..] => {
            let end = rest.iter().take(8).position(|&c| c == b';')?;
            let name = rest.get(..end)?;
            let (_, c) = ENTITIES.iter().find(|(n, _)| n.as_bytes() == name)?;
            Some((*c, end + 2))
        }
        [b'+', ..] if plus_is_space => Some((b' ', 1)),
        _ => None,
    }
}

/// HTML's named references to printable ASCII.
const ENTITIES: [(&str, u8); 36] = [
    ("quot", b'"'),
    ("QUOT", b'"'),
    ("amp", b'&'),
    ("AMP", b'&'),
    ("lt", b'<'),
    ("LT", b'<'),
    ("gt", b'>'),
    ("GT", b'>'),
    ("apos", b'\''),
    ("excl", b'!'),
    ("num", b'#'),
    ("dollar", b'$'),
    ("percnt", b'%'),
    ("lpar", b'('),
    ("rpar", b')'),
    ("ast", b'*'),
    ("midast", b'*'),
    ("plus", b'+'),
    ("comma", b','),
    ("period", b'.'),
    ("sol", b'/'),
    ("colon", b':'),
    ("semi", b';'),
    ("equals", b'='),
    ("quest", b'?'),
    ("commat", b'@'),
    ("lsqb", b'['),
    ("lbrack", b'['),
    ("bsol", b'\\'),
    ("rsqb", b']'),
    ("rbrack", b']'),
    ("Hat", b'^'),
    ("lowbar", b'_'),
    ("grave", b'`'),
    ("lcub", b'{'),
    ("verbar", b'|'),
];

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
        let value = "sk+a/b\"c<&>";
        for form in [
            "sk+a/b\\\"c<&>",
            "sk+a\\/b\\\"c<&>",
            "sk\\u002ba\\u002fb\\u0022c\\u003c\\u0026\\u003e",
            "sk%2Ba%2Fb%22c%3C%26%3E",
            "sk%2ba%2fb%22c%3c%26%3e",
            // HTML, Go's JSON (only <, & and > escaped), Python's quote (`/` left).
            "sk+a/b&quot;c&lt;&amp;&gt;",
            "sk&#43;a&#x2F;b&#34;c&#60;&#38;&#62;",
            "sk+a/b\\\"c\\u003c\\u0026\\u003e",
            "sk%2Ba/b%22c%3C%26%3E",
            "%73%6B%2B%61/b\\x22c&lt;%26\\u003E",
            // JavaScript's octal, ES6 and identity escapes; references without `;`.
            "\\163\\153+a/b\\42c<&>",
            "\\u{73}\\u{6B}\\u{2b}a/b\\\"c<&>",
            "\\s\\k\\+\\a\\/b\\\"\\c\\<\\&\\>",
            "&#115&#107&#43a/b&#34c&#60&#38&#62",
        ] {
            let mut s = Scrubber::new(&[value.to_string()]);
            let mut out = s.push(format!("x {form} y").as_bytes());
            out.extend(s.finish());
            assert_eq!(out, b"x [secret removed by moat] y", "{form}");
        }
        // A value with a space, as a form writes it; one whose own text
        // looks like an escape, as it is; quotes doubled (CSV, SQL) or
        // spelled as a shell quotes them.
        for (value, form) in [
            ("sk a+b", "sk+a%2Bb"),
            ("sk%41&amp;\\u0041", "sk%41&amp;\\u0041"),
            ("sk-\"q'-0123456789", "sk-\"\"q''-0123456789"),
            ("sk-'q'-0123456789", "sk-'\"'\"'q'\\''-0123456789"),
        ] {
            let mut s = Scrubber::new(&[value.to_string()]);
            let mut out = s.push(format!("x {form} y").as_bytes());
            out.extend(s.finish());
            assert_eq!(out, b"x [secret removed by moat] y", "{form}");
        }
        // Escapes that stand for no value pass as they came.
        let mut s = Scrubber::new(&["sk-value-0123456789".to_string()]);
        let text = b"%zz &bogus; &#x110000; \\u12 + sk-value-012345678 %E2%82%AC";
        let mut out = s.push(text);
        out.extend(s.finish());
        assert_eq!(out, text);
    }
}
