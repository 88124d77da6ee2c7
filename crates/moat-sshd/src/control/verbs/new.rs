//! `new NAME [flags]`: create a box.

use moat_api::Op;
use moat_core::limits::parse_size;
use moat_core::policy::Preset;
use moat_core::{BackendKind, Limits, Name};

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, rest, seconds, usage, UsageError};

pub const VERB: Verb = Verb {
    names: &["new"],
    help: "  \
  new NAME [--image I] [--cpus N] [--memory SIZE] [--pids N] [--disk SIZE] [--idle SECONDS]
         [--policy PRESET] [--ask] [--backend ns|vm] [--node NODE] [--run]
                      create a box (image 'debian' unless told, built on first use;
                      vm: a kernel of its own, ns: namespaces; the server's default unless told;
                      --node: on that node of a fleet, not where placement puts it;
                      --run: a pulled image's Entrypoint and Cmd run as the box's service,
                      started again when it exits; its output in 'log NAME --service')
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("new", args.first())?;
    let mut image = Name::new(moat_core::images::DEFAULT).map_err(|e| usage(e.to_string()))?;
    let mut limits = Limits::default();
    let mut idle = None;
    let mut policy = None;
    let mut ask = false;
    let mut run = false;
    let mut backend = None;
    let mut node = None;
    let mut rest = rest(args, 1).iter();
    while let Some(flag) = rest.next() {
        if flag == "--ask" || flag == "--run" {
            ask |= flag == "--ask";
            run |= flag == "--run";
            continue;
        }
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (flag.as_str(), None),
        };
        let mut value = || {
            inline.clone().or_else(|| rest.next().cloned()).ok_or_else(|| usage(format!("new: {flag} needs a value")))
        };
        match flag {
            "--image" => image = Name::new(&value()?).map_err(|e| usage(format!("new: --image: {e}")))?,
            "--cpus" => limits.cpus = number(flag, &value()?)?,
            "--pids" => limits.pids = number(flag, &value()?)?,
            "--idle" => idle = Some(seconds("new: --idle", &value()?)?),
            "--policy" => policy = Some(preset("new: --policy", &value()?)?),
            "--disk" => limits.disk = parse_size(&value()?).map_err(|e| usage(format!("new: --disk: {e}")))?,
            "--memory" => limits.memory = parse_size(&value()?).map_err(|e| usage(format!("new: --memory: {e}")))?,
            "--backend" => {
                let v = value()?;
                let kind =
                    BackendKind::parse(&v).ok_or_else(|| usage(format!("new: --backend: {v:?} is not ns or vm")))?;
                backend = Some(kind);
            }
            "--node" => node = Some(node_name(&value()?)?),
            other => return Err(usage(format!("new: unknown flag {other:?}"))),
        }
    }
    limits.validate().map_err(|e| usage(format!("new: {e}")))?;
    Ok(Plan::Call(Call::new(Op::Create { name, image, limits, idle, policy, ask, backend, node, run }, super::name)))
}

/// A preset by name, for `new --policy` and `policy NAME preset`.
pub fn preset(what: &str, value: &str) -> Result<Preset, UsageError> {
    Preset::parse(value).map_err(|_| usage(format!("{what}: no preset {value:?} (presets: {})", Preset::names())))
}

/// A node's name as a host name is: letters, digits, `-` and `.`.
fn node_name(value: &str) -> Result<String, UsageError> {
    let ok = (1..=253).contains(&value.len())
        && value.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !value.starts_with(['-', '.']);
    if !ok {
        return Err(usage(format!("new: --node: {value:?} is not a node name")));
    }
    Ok(value.to_ascii_lowercase())
}

fn number(flag: &str, value: &str) -> Result<u32, UsageError> {
    value.parse().map_err(|_| usage(format!("new: {flag}: {value:?} is not a whole number")))
}
