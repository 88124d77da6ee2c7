//! `image pull|ls|rm|login`: images of the account's own, pulled from any
//! OCI registry. A login's password comes on stdin, never on the line.

use std::fmt::Write as _;

use moat_api::{ApiError, ImageInfo, Op, Reply};
use moat_core::limits::format_measured;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, rest, usage, UsageError};
use crate::control::render::to_json;
use crate::control::time::utc_ms;

pub const VERB: Verb = Verb {
    names: &["image"],
    help: "  \
  image pull REF [--as NAME] [--json]
                      pull an OCI image (python:3.12-slim, ghcr.io/org/img@sha256:...; a short
                      name is on the server's default registry) as your image NAME (the
                      reference's last part and tag unless told): new BOX --image NAME
  image ls [--json]   your images: name, reference, digest, size, when pulled
  image save BOX NAME make BOX's files as of now your image NAME (a template: O(1), read-only;
                      new B --image NAME starts from them, with BOX's image's Env, User, dir;
                      an image NAME you had is replaced, as a pull of the same name replaces)
  image push NAME REF push your image NAME to REF (REGISTRY/REPO[:TAG]) as an OCI image: a
                      template sends one layer of what it adds, its base's layers are
                      found there or mounted from the repository they were pulled from
  image rm NAME       remove your image NAME (boxes made from it keep their files)
  image login REGISTRY USER   (password or token on stdin)
                      keep your login for REGISTRY (sealed, as secrets are) for pulls from it
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let Some(verb) = args.first() else {
        return Err(usage("image: pull, ls, save, push, rm or login (see 'help')"));
    };
    match (verb.as_str(), rest(args, 1)) {
        ("ls", []) => Ok(Plan::Call(Call::new(Op::ImageList, render_list))),
        ("ls", [json]) if json == "--json" => Ok(Plan::Call(Call::new(Op::ImageList, render_list).json(true))),
        ("rm", [n]) => {
            Ok(Plan::Call(Call::new(Op::ImageRemove { name: name_arg("image rm", Some(n))? }, super::nothing)))
        }
        ("pull", [reference, flags @ ..]) => parse_pull(reference, flags),
        ("save", [b, image]) => {
            let op =
                Op::ImageSave { name: name_arg("image save", Some(b))?, image: name_arg("image save", Some(image))? };
            Ok(Plan::Call(Call::new(op, render_pulled)))
        }
        ("push", [image, reference]) => {
            if reference.is_empty() || reference.len() > 512 || reference.starts_with('-') {
                return Err(usage("image push: REF is where to push (like registry.example.com/team/app:v1)"));
            }
            let op = Op::ImagePush { name: name_arg("image push", Some(image))?, reference: reference.clone() };
            Ok(Plan::Call(Call::new(op, render_pushed)))
        }
        ("login", [registry, user]) => {
            let registry = registry_arg(registry)?;
            if user.is_empty() || user.len() > 256 || user.contains(':') || user.chars().any(char::is_control) {
                return Err(usage("image login: USER must be 1 to 256 characters, no ':'"));
            }
            let user = user.clone();
            Ok(Plan::ReadPassword(Box::new(move |password| {
                Call::new(Op::ImageLogin { registry, user, password }, super::nothing)
            })))
        }
        _ => Err(usage(format!("image {verb}: bad arguments (see 'help')"))),
    }
}

fn parse_pull(reference: &str, flags: &[String]) -> Result<Plan, UsageError> {
    if reference.is_empty() || reference.len() > 512 || reference.starts_with('-') {
        return Err(usage("image pull: REF is an image reference (like python:3.12-slim)"));
    }
    let (mut name, mut json) = (None, false);
    let mut rest = flags.iter();
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--json" => json = true,
            "--as" => name = Some(name_arg("image pull --as", rest.next())?),
            other => return Err(usage(format!("image pull: unknown flag {other:?}"))),
        }
    }
    let op = Op::ImagePull { reference: reference.to_string(), name };
    Ok(Plan::Call(Call::new(op, render_pulled).json(json)))
}

/// `HOST[:PORT]`, as a registry is named.
fn registry_arg(value: &str) -> Result<String, UsageError> {
    let (host, port) = value.rsplit_once(':').map_or((value, None), |(h, p)| (h, Some(p)));
    let ok = (1..=253).contains(&host.len())
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !host.starts_with(['-', '.'])
        && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
    if !ok {
        return Err(usage(format!("image login: {value:?} is not a registry (HOST or HOST:PORT)")));
    }
    Ok(value.to_ascii_lowercase())
}

fn render_pushed(reply: Reply, _: &Op, _: bool) -> Result<String, ApiError> {
    let Reply::Text(line) = reply else { return Err(ApiError::unexpected(&reply)) };
    Ok(format!("{line}\n"))
}

fn render_pulled(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Image(image) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&image));
    }
    Ok(format!(
        "{}: {} ({}, {} layers, {})\n",
        image.name,
        image.reference,
        image.digest,
        image.layers,
        format_measured(image.bytes)
    ))
}

fn render_list(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Images(images) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&images));
    }
    if images.is_empty() {
        return Ok("no images of your own (image pull REF); built in: debian, busybox\n".into());
    }
    let mut out = format!("{:<24} {:<19} {:>9}  {:<20} {}\n", "NAME", "DIGEST", "SIZE", "PULLED", "REFERENCE");
    for i in &images {
        let ImageInfo { name, reference, digest, bytes, created_ms, .. } = i;
        let short = digest.get(..19).unwrap_or(digest);
        let _ = writeln!(
            out,
            "{name:<24} {short:<19} {:>9}  {:<20} {reference}",
            format_measured(*bytes),
            utc_ms(*created_ms)
        );
    }
    Ok(out)
}
