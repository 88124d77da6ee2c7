//! What a user name is to an account ([`Route`]), asked at every login: a
//! node answers it from its manager, and a fleet's router from the store,
//! by this one rule.

use moat_core::Name;

use crate::proto::Route;

/// `name` among the account's boxes `boxes`: one of them; else close to one
/// (a typo); else, if `was_box` says so, a name one of them had; else none.
pub fn route<E>(name: &Name, boxes: &[Name], was_box: impl FnOnce() -> Result<bool, E>) -> Result<Route, E> {
    if boxes.contains(name) {
        return Ok(Route::Box);
    }
    let near = moat_core::near::closest(name.as_str(), boxes.iter().map(Name::as_str));
    if let Some(b) = near.and_then(|n| boxes.iter().find(|b| b.as_str() == n)) {
        return Ok(Route::Near(b.clone()));
    }
    if was_box()? {
        return Ok(Route::Gone);
    }
    Ok(Route::None)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<Name> {
        list.iter().map(|n| Name::new(n).unwrap()).collect()
    }

    #[test]
    fn a_box_a_typo_a_former_box_or_nothing() {
        let boxes = names(&["web", "db1"]);
        let of = |name: &str, was: bool| route::<()>(&Name::new(name).unwrap(), &boxes, || Ok(was)).unwrap();
        assert_eq!(of("web", true), Route::Box, "a box is a box whatever it was");
        assert_eq!(of("db11", false), Route::Near(Name::new("db1").unwrap()));
        assert_eq!(of("api", true), Route::Gone);
        assert_eq!(of("api", false), Route::None);
        let failed = route(&Name::new("api").unwrap(), &boxes, || Err("store down"));
        assert_eq!(failed, Err("store down"));
    }
}
