//! HTTP/1.x requests as the gateway reads them from a box: the head (to
//! check Host, method and target against the dialled name and the policy)
//! and the body's framing (so that the next request on the connection is
//! checked too). Anything that could be read two ways is refused.

use moat_core::policy::HostName;

/// Largest request head read.
pub const MAX_HEAD: usize = 16 << 10;
const MAX_HEADERS: usize = 96;
/// Headers by which a client asks the server to read a request as another
/// method (Google's APIs, ASP.NET, Rails middleware and others honour one):
/// the gateway reads the request as that method too, so that a `GET` rule
/// does not pass a `DELETE` in a `GET`, nor the effects ledger miss it.
/// Spelled with `_` for `-` too (Puma and CGI-style servers read both alike).
const METHOD_OVERRIDES: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];
/// The query parameter by which a client asks the same (Laravel, Symfony).
const QUERY_OVERRIDE: &str = "_method=";
/// Longest method a method-override header may name.
const MAX_METHOD: usize = 16;

/// How the body after a head is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// Exactly this many bytes (0: none).
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
}

/// A request head, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The method.
    pub method: String,
    /// The method a method-override header asks the server to read it as,
    /// where that differs from `method` (upper-cased).
    pub method_override: Option<String>,
    /// The target in origin form, normalised ([`normalise_target`]).
    pub target: String,
    /// The Host header's name.
    pub host: HostName,
    /// The Host header's port, if it named one.
    pub port: Option<u16>,
    /// The body's framing.
    pub body: Body,
    /// Whether the request asks to switch protocols (after which the
    /// connection's bytes are no longer HTTP).
    pub upgrade: bool,
    /// Bytes of the head, blank line included.
    pub head_len: usize,
    /// HTTP/1.0 (no chunked responses).
    pub http10: bool,
    /// It asks for the connection to end after its response.
    pub close: bool,
    /// Its body has a content coding (`Content-Encoding` other than identity).
    pub coded: bool,
    /// It waits for `100 Continue` before sending its body.
    pub expects_continue: bool,
}

impl Request {
    /// The methods a server may read this request as: its own, and the one
    /// a method-override header names.
    pub fn methods(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.method.as_str()).chain(self.method_override.as_deref())
    }
}

/// What the start of a buffer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// More bytes are needed.
    Incomplete,
    /// A request.
    Request(Request),
    /// Refused, with the reason.
    Refused(&'static str),
}

/// Whether `buf` starts like an HTTP request (a method token and a space).
pub fn looks_like_http(buf: &[u8]) -> bool {
    let token_len = buf.iter().take_while(|b| b.is_ascii_uppercase()).count();
    token_len > 0 && token_len <= 16 && buf.get(token_len) == Some(&b' ')
}

/// Reads one request head from the start of `buf`.
pub fn read_head(buf: &[u8]) -> Head {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Head::Incomplete,
        Ok(httparse::Status::Partial) => return Head::Refused("request head too large"),
        Err(httparse::Error::TooManyHeaders) => return Head::Refused("too many headers"),
        Err(_) => return Head::Refused("malformed request"),
    };
    if head_len > MAX_HEAD {
        return Head::Refused("request head too large");
    }
    match check(&req, head_len) {
        Ok(request) => Head::Request(request),
        Err(why) => Head::Refused(why),
    }
}

fn check(req: &httparse::Request<'_, '_>, head_len: usize) -> Result<Request, &'static str> {
    let (Some(method), Some(raw_target), Some(version)) = (req.method, req.path, req.version) else {
        return Err("malformed request");
    };
    if method == "CONNECT" {
        return Err("CONNECT");
    }
    // Methods are case-sensitive, but some servers upper-case what they get
    // (`delete` would pass a rule that refuses `DELETE`).
    if method.bytes().any(|b| b.is_ascii_lowercase()) {
        return Err("a method in lower case");
    }
    let mut host = None;
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut upgrade = false;
    let mut close = false;
    let mut coded = false;
    let mut expects_continue = false;
    let mut method_override: Option<String> = None;
    for h in req.headers.iter() {
        let value = ows(std::str::from_utf8(h.value).map_err(|_| "a header that is not text")?);
        if h.name.eq_ignore_ascii_case("host") {
            if host.replace(value).is_some() {
                return Err("two Host headers");
            }
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let n = value.parse::<u64>().map_err(|_| "bad Content-Length")?;
            if !value.bytes().all(|b| b.is_ascii_digit()) || length.replace(n).is_some() {
                return Err("bad Content-Length");
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if chunked || !value.eq_ignore_ascii_case("chunked") {
                return Err("a transfer coding other than chunked");
            }
            chunked = true;
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        } else if h.name.eq_ignore_ascii_case("connection") {
            close |= value.split(',').any(|t| ows(t).eq_ignore_ascii_case("close"));
        } else if h.name.eq_ignore_ascii_case("content-encoding") {
            coded |= value.split(',').any(|c| !ows(c).is_empty() && !ows(c).eq_ignore_ascii_case("identity"));
        } else if h.name.eq_ignore_ascii_case("expect") {
            expects_continue |= value.eq_ignore_ascii_case("100-continue");
        } else if is_method_override(h.name.as_bytes()) {
            add_override(&mut method_override, value)?;
        }
    }
    if chunked && version == 0 {
        return Err("a chunked body in an HTTP/1.0 request");
    }
    if chunked && length.is_some() {
        return Err("both Content-Length and Transfer-Encoding");
    }
    let (host, port) = split_host(host.ok_or("no Host header")?)?;
    let target = match raw_target.strip_prefix("http://") {
        // Absolute form: its authority must be the Host header's.
        Some(rest) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            if split_host(authority)? != (host.clone(), port) {
                return Err("the URL's host differs from the Host header");
            }
            if path.is_empty() {
                "/"
            } else {
                path
            }
        }
        None if raw_target.starts_with('/') => raw_target,
        None => return Err("a request target that is not a path"),
    };
    let body = if chunked { Body::Chunked } else { Body::Length(length.unwrap_or(0)) };
    let target = normalise_target(target)?;
    let query = target.split_once('?').map(|(_, query)| query).unwrap_or_default();
    for value in query.split('&').filter_map(|pair| pair.strip_prefix(QUERY_OVERRIDE)) {
        add_override(&mut method_override, value)?;
    }
    let http10 = version == 0;
    Ok(Request {
        method: method.to_string(),
        method_override: method_override.filter(|o| o != method),
        target,
        host,
        port,
        body,
        upgrade,
        head_len,
        http10,
        close,
        coded,
        expects_continue,
    })
}

/// Whether a header's name is one of [`METHOD_OVERRIDES`] (in any case, `_`
/// for `-`).
pub fn is_method_override(name: &[u8]) -> bool {
    let same = |want: &str| {
        want.len() == name.len()
            && want.bytes().zip(name).all(|(w, &n)| w == n.to_ascii_lowercase() || (w == b'-' && n == b'_'))
    };
    METHOD_OVERRIDES.iter().any(|o| same(o))
}

/// Takes `value` (a method-override header's, or `_method` in the query) as
/// the method the server may read the request as: refused if it is no
/// method, or another than one named before.
fn add_override(method_override: &mut Option<String>, value: &str) -> Result<(), &'static str> {
    if value.is_empty() || value.len() > MAX_METHOD || !value.bytes().all(super::is_tchar) {
        return Err("a method override that is not a method");
    }
    let value = value.to_ascii_uppercase();
    if method_override.as_ref().is_some_and(|o| *o != value) {
        return Err("two method overrides that differ");
    }
    *method_override = Some(value);
    Ok(())
}

/// The lines of a head `read_head` accepted (lines end in LF or CRLF), without
/// their ends and the blank line; `None` if it is not text.
pub fn head_lines(head: &[u8]) -> Option<Vec<String>> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines: Vec<String> = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l).to_string()).collect();
    while lines.last().is_some_and(String::is_empty) {
        lines.pop();
    }
    Some(lines)
}

/// A head from its lines, every line ended by CRLF, so that the host reads
/// its lines where the gateway did (a bare LF is read as a line end by some
/// servers and not by others).
pub fn join_head(lines: &[String]) -> Vec<u8> {
    let mut out = lines.join("\r\n").into_bytes();
    out.extend_from_slice(b"\r\n\r\n");
    out
}

/// `head` with every line ended by CRLF ([`join_head`]).
pub fn with_crlf(head: &[u8]) -> Option<Vec<u8>> {
    head_lines(head).map(|lines| join_head(&lines))
}

fn split_host(value: &str) -> Result<(HostName, Option<u16>), &'static str> {
    let (name, port) = match value.rsplit_once(':') {
        Some((name, port)) => (name, Some(port.parse::<u16>().map_err(|_| "bad port in Host")?)),
        None => (value, None),
    };
    if name.contains('@') || name.starts_with('[') {
        return Err("Host is not a host name");
    }
    Ok((HostName::parse(name).map_err(|_| "Host is not a host name")?, port))
}

/// The target as servers read it, so that rules match what the server will
/// serve: escapes of unreserved characters decoded (`%70` is `p`), other
/// escapes in upper case. Refused: dot segments (in any spelling, with
/// `;parameters` too), a backslash (escaped too), an escaped NUL, a
/// fragment, or an escape that is not two hex digits.
pub fn normalise_target(target: &str) -> Result<String, &'static str> {
    let bytes = target.as_bytes();
    let mut out = String::with_capacity(target.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = |c: u8| (c as char).to_digit(16);
            let (Some(hi), Some(lo)) =
                (bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex))
            else {
                return Err("a bad percent escape");
            };
            let c = (hi * 16 + lo) as u8;
            if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                out.push(c as char);
            } else {
                out.push_str(&format!("%{c:02X}"));
            }
            i += 3;
            continue;
        }
        if b == b'\\' || b == b'#' || !b.is_ascii_graphic() {
            return Err("a request target with a backslash, fragment or control byte");
        }
        out.push(b as char);
        i += 1;
    }
    let path = out.split('?').next().unwrap_or_default();
    // Servers differ on what ends a segment: `/`, its escape, a backslash's
    // escape (IIS), and `;` before parameters (`..;` is `..` to Tomcat).
    if path.contains("%5C") || path.contains("%00") {
        return Err("an escaped backslash or NUL in the path");
    }
    let dots = |seg: &str| matches!(seg.split(';').next(), Some("." | ".."));
    if path.split('/').flat_map(|seg| seg.split("%2F")).any(dots) {
        return Err("dot segments in the path");
    }
    Ok(out)
}

/// `text` without HTTP's optional whitespace around it: spaces and tabs
/// only. (`str::trim` also takes Unicode spaces, U+0085 and U+00A0 among
/// them, which a server does not: `chunked\u{85}` would be chunked here
/// and no coding there, and the body two requests to one of them.)
pub(crate) fn ows(text: &str) -> &str {
    text.trim_matches([' ', '\t'])
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    fn req(text: &str) -> Head {
        read_head(text.as_bytes())
    }

    #[test]
    fn heads() {
        let Head::Request(r) = req("GET /simple/x/ HTTP/1.1\r\nHost: PyPI.org\r\n\r\nrest") else { panic!() };
        assert_eq!(
            (r.method.as_str(), r.target.as_str(), r.host.as_str(), r.port),
            ("GET", "/simple/x/", "pypi.org", None)
        );
        assert_eq!((r.body, r.head_len), (Body::Length(0), 43));
        let Head::Request(r) =
            req("POST http://a.org:8080/x HTTP/1.1\r\nHost: a.org:8080\r\nContent-Length: 5\r\n\r\n")
        else {
            panic!()
        };
        assert_eq!((r.target.as_str(), r.port, r.body), ("/x", Some(8080), Body::Length(5)));
        assert_eq!(req("GET / HTTP/1.1\r\nHost: a.org\r\n"), Head::Incomplete);
        for (bad, why) in [
            ("GET / HTTP/1.1\r\n\r\n", "no Host header"),
            ("GET / HTTP/1.1\r\nHost: a.org\r\nHost: b.org\r\n\r\n", "two Host headers"),
            ("GET http://b.org/ HTTP/1.1\r\nHost: a.org\r\n\r\n", "the URL's host differs from the Host header"),
            (
                "GET / HTTP/1.1\r\nHost: a.org\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
                "both Content-Length and Transfer-Encoding",
            ),
            ("GET / HTTP/1.1\r\nHost: a.org\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", "bad Content-Length"),
            (
                "GET / HTTP/1.1\r\nHost: a.org\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                "a transfer coding other than chunked",
            ),
            (
                "POST / HTTP/1.0\r\nHost: a.org\r\nTransfer-Encoding: chunked\r\n\r\n",
                "a chunked body in an HTTP/1.0 request",
            ),
            ("CONNECT a.org:443 HTTP/1.1\r\nHost: a.org\r\n\r\n", "CONNECT"),
            ("GET /a/../b HTTP/1.1\r\nHost: a.org\r\n\r\n", "dot segments in the path"),
            ("GET /a/%2e%2E/b HTTP/1.1\r\nHost: a.org\r\n\r\n", "dot segments in the path"),
            ("GET / HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\n", "Host is not a host name"),
            ("GET / HTTP/1.1\r\nHost: user@a.org\r\n\r\n", "Host is not a host name"),
            ("GET / HTTP/1.1\r\nHost: a.org\0\r\n\r\n", "malformed request"),
            // Unicode spaces are no HTTP whitespace: what servers read as
            // another coding (the body as requests), or no length.
            (
                "POST / HTTP/1.1\r\nHost: a.org\r\nTransfer-Encoding: chunked\u{85}\r\n\r\n",
                "a transfer coding other than chunked",
            ),
            ("POST / HTTP/1.1\r\nHost: a.org\r\nContent-Length: 5\u{a0}\r\n\r\n", "bad Content-Length"),
        ] {
            assert_eq!(req(bad), Head::Refused(why), "{bad:?}");
        }
        let Head::Request(r) = req("POST / HTTP/1.1\r\nHost: a.org\r\nContent-Length: \t5 \r\n\r\n") else { panic!() };
        assert_eq!(r.body, Body::Length(5));
        assert_eq!(read_head(&vec![b'G'; MAX_HEAD + 1]), Head::Refused("request head too large"));
        let mut long = b"GET / HTTP/1.1\r\nHost: a.org\r\nX: ".to_vec();
        long.extend(vec![b'a'; MAX_HEAD]);
        assert_eq!(read_head(&long), Head::Refused("request head too large"));
    }

    #[test]
    fn a_method_override_is_read_as_the_method_it_names() {
        let read = |head: &str| match req(head) {
            Head::Request(r) => r.methods().map(str::to_string).collect::<Vec<_>>(),
            other => panic!("{head:?}: {other:?}"),
        };
        assert_eq!(read("GET / HTTP/1.1\r\nHost: a.org\r\n\r\n"), ["GET"]);
        for header in ["X-HTTP-Method-Override", "x-http-method", "X-Method-Override"] {
            let head = format!("GET / HTTP/1.1\r\nHost: a.org\r\n{header}: delete\r\n\r\n");
            assert_eq!(read(&head), ["GET", "DELETE"], "{header}");
        }
        // Naming the method itself (in any case), or naming one twice, is one method.
        assert_eq!(read("GET / HTTP/1.1\r\nHost: a.org\r\nX-HTTP-Method: get\r\n\r\n"), ["GET"]);
        let twice = "GET / HTTP/1.1\r\nHost: a.org\r\nX-HTTP-Method: PUT\r\nX-Method-Override: put\r\n\r\n";
        assert_eq!(read(twice), ["GET", "PUT"]);
        // Spelled with underscores (Puma reads them as dashes), or asked in the query.
        assert_eq!(read("GET / HTTP/1.1\r\nHost: a.org\r\nX_HTTP_METHOD_OVERRIDE: PUT\r\n\r\n"), ["GET", "PUT"]);
        assert_eq!(read("POST /i?a=1&_method=delete HTTP/1.1\r\nHost: a.org\r\n\r\n"), ["POST", "DELETE"]);
        assert_eq!(read("POST /i?_%6Dethod=PUT HTTP/1.1\r\nHost: a.org\r\n\r\n"), ["POST", "PUT"]);
        assert_eq!(read("GET /i?x_method=PUT HTTP/1.1\r\nHost: a.org\r\n\r\n"), ["GET"]);
        // Any token is a method (RFC 9110), as servers read one.
        assert_eq!(read("GET / HTTP/1.1\r\nHost: a.org\r\nX-HTTP-Method: m-search\r\n\r\n"), ["GET", "M-SEARCH"]);
        for (bad, why) in [
            (
                "GET / HTTP/1.1\r\nHost: a.org\r\nX-HTTP-Method: PUT\r\nX-HTTP-Method: DELETE\r\n\r\n",
                "two method overrides that differ",
            ),
            (
                "GET / HTTP/1.1\r\nHost: a.org\r\nX-HTTP-Method-Override: DELETE, GET\r\n\r\n",
                "a method override that is not a method",
            ),
            (
                "GET / HTTP/1.1\r\nHost: a.org\r\nX-HTTP-Method-Override:\r\n\r\n",
                "a method override that is not a method",
            ),
            (
                "POST /?_method=PUT HTTP/1.1\r\nHost: a.org\r\nX-HTTP-Method: DELETE\r\n\r\n",
                "two method overrides that differ",
            ),
            ("delete / HTTP/1.1\r\nHost: a.org\r\n\r\n", "a method in lower case"),
            ("Delete / HTTP/1.1\r\nHost: a.org\r\n\r\n", "a method in lower case"),
        ] {
            assert_eq!(req(bad), Head::Refused(why), "{bad:?}");
        }
    }

    #[test]
    fn heads_go_out_with_crlf_line_ends() {
        let head = b"GET / HTTP/1.1\nHost: a.org\r\nX: 1\n\n";
        assert!(matches!(read_head(head), Head::Request(_)));
        assert_eq!(with_crlf(head).unwrap(), b"GET / HTTP/1.1\r\nHost: a.org\r\nX: 1\r\n\r\n");
    }

    #[test]
    fn targets_normalise() {
        assert_eq!(normalise_target("/o/r/git-receive-%70ack").unwrap(), "/o/r/git-receive-pack");
        assert_eq!(normalise_target("/@types%2fnode?x=%e2").unwrap(), "/@types%2Fnode?x=%E2");
        assert!(normalise_target("/a%zz").is_err());
        assert!(normalise_target("/a\\b").is_err());
        assert!(normalise_target("/a/./b").is_err());
        for fronted in
            ["/public/..;/admin", "/public/%2e%2e;/admin", "/public/..%5cadmin", "/a%2f..%2fb", "/a/.;x/b", "/a%00"]
        {
            assert!(normalise_target(fronted).is_err(), "{fronted}");
        }
        assert_eq!(normalise_target("/a/..b/c;v=1").unwrap(), "/a/..b/c;v=1");
        assert!(normalise_target("/a?x=/../").is_ok());
    }
}
