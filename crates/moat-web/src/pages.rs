//! The pages the edge answers with itself: every refusal says what happened
//! and what to do, in one short HTML page (and plain text for `curl`).

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use moat_core::web::{WebHost, WebRefusal};

use crate::body::{full, ResBody};
use crate::host::HostError;

/// Why the edge answers a request itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Page {
    /// A refusal the privileged side decided.
    #[error("{0}")]
    Refused(WebRefusal, Option<WebHost>),
    /// The host is not one of ours.
    #[error(transparent)]
    Host(#[from] HostError),
    /// Nothing listens on the port in the box.
    #[error("nothing in box {0} listens on port {1}")]
    NoListener(String, u16),
    /// The box did not begin its answer in time.
    #[error("box {0} did not answer in {1} s")]
    Slow(String, u64),
    /// The box's answer broke off, or the box could not be reached.
    #[error("box {0} could not be reached: {1}")]
    Unreachable(String, String),
    /// Too many requests in flight to this box port.
    #[error("too many requests in flight to box {0}; try again")]
    Crowded(String),
    /// The request was malformed in a way hyper let through.
    #[error("bad request: {0}")]
    Bad(&'static str),
    /// A page of another box asked to change something in this one.
    #[error("a page of another box ({1}) may not change box {0}")]
    CrossBox(String, String),
}

impl Page {
    fn status(&self) -> StatusCode {
        match self {
            Page::Refused(WebRefusal::NotFound, _) => StatusCode::NOT_FOUND,
            Page::Refused(WebRefusal::SignIn | WebRefusal::NotShared | WebRefusal::LinkSpent, _) => {
                StatusCode::UNAUTHORIZED
            }
            Page::Refused(WebRefusal::Stopped | WebRefusal::Busy, _) | Page::Crowded(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Page::Host(HostError::Foreign(_)) => StatusCode::MISDIRECTED_REQUEST,
            Page::Host(_) | Page::Bad(_) => StatusCode::BAD_REQUEST,
            Page::NoListener(..) | Page::Unreachable(..) => StatusCode::BAD_GATEWAY,
            Page::Slow(..) => StatusCode::GATEWAY_TIMEOUT,
            Page::CrossBox(..) => StatusCode::FORBIDDEN,
        }
    }

    /// What to do about it, in a sentence.
    fn advice(&self) -> String {
        match self {
            Page::Refused(WebRefusal::SignIn, Some(h)) => format!(
                "This URL is private. Its owner gets a one-time sign-in link with: ssh HOST url {} {}",
                h.name, h.port
            ),
            Page::Refused(WebRefusal::NotShared, Some(h)) => format!(
                "You are signed in, but box {} is not shared with your key. Its owner can run: ssh HOST share {} YOUR-KEY-FINGERPRINT (your fingerprint: ssh HOST whoami)",
                h.name, h.name
            ),
            Page::Refused(WebRefusal::LinkSpent, Some(h)) => format!(
                "Sign-in links work once, for a few minutes. Get a new one with: ssh HOST url {} {}",
                h.name, h.port
            ),
            Page::Refused(WebRefusal::Stopped, Some(h)) => {
                format!("Box {} is stopped. Its owner starts it with: ssh HOST start {}", h.name, h.name)
            }
            Page::Refused(WebRefusal::NotFound, _) => {
                "No box port is exposed at this address (see: ssh HOST urls).".to_string()
            }
            Page::Host(_) => "Box URLs look like https://PORT-NAME-OWNER.DOMAIN/ (see: ssh HOST urls).".to_string(),
            Page::NoListener(name, port) => format!("Start a server on port {port} in box {name} and reload."),
            Page::CrossBox(..) => "Every box URL is one site to a browser: a page of one box may read another's, \
                                   not post to it or open a WebSocket to it. Open this box's own URL."
                .to_string(),
            _ => "Try again in a moment.".to_string(),
        }
    }

    /// The page.
    pub fn response(&self) -> Response<ResBody> {
        let status = self.status();
        let (title, advice) = (escape(&self.to_string()), escape(&self.advice()));
        let html = format!(
            "<!doctype html><html><head><meta charset=\"utf-8\"><title>{code} {title}</title></head>\
             <body><h1>{code} {title}</h1><p>{advice}</p><hr><p>moat</p></body></html>\n",
            code = status.as_u16()
        );
        let mut res = Response::new(full(Bytes::from(html)).map_err(|never| match never {}).boxed_unsync());
        *res.status_mut() = status;
        res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
        res.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        res
    }
}

/// `s` safe inside HTML text.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_text_is_escaped() {
        assert_eq!(escape("<script>&\""), "&lt;script&gt;&amp;&quot;");
        let page = Page::Host(HostError::Foreign("<b>".into()));
        assert_eq!(page.response().status(), StatusCode::MISDIRECTED_REQUEST);
    }
}
