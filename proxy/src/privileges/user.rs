//! The steady-state user (`user:` in the configuration, `proxy run --user`): a name, a name
//! and a group (`name:group`), or numbers (`uid[:gid]`). Names are looked up in `/etc/passwd`
//! and `/etc/group` (the files, not NSS: the daemon runs before any directory service is
//! reachable, and a lookup must not load libraries); a user without a group takes its
//! primary group from `/etc/passwd`.

use std::fmt;

/// Where names are looked up.
pub const PASSWD: &str = "/etc/passwd";
/// Where group names are looked up.
pub const GROUP: &str = "/etc/group";

/// A user and group to run as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    /// The user id.
    pub uid: u32,
    /// The group id (the only group: supplementary groups are dropped).
    pub gid: u32,
    /// As it was written, for the log.
    pub spec: String,
}

impl fmt::Display for RunAs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (uid {}, gid {})", self.spec, self.uid, self.gid)
    }
}

/// Why a user could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// The setting is empty, or has an empty part.
    #[error("user {0:?}: expected a name, name:group, uid or uid:gid")]
    Syntax(String),
    /// No such user in `/etc/passwd`.
    #[error("user {name:?}: no such user in {PASSWD}; create it, or give numbers (uid:gid)")]
    NoUser {
        /// The name or uid looked for.
        name: String,
    },
    /// No such group in `/etc/group`.
    #[error("user {spec:?}: no group {group:?} in {GROUP}; give its number instead")]
    NoGroup {
        /// The whole setting.
        spec: String,
        /// The group looked for.
        group: String,
    },
    /// A database file could not be read.
    #[error("user {spec:?}: reading {file} to look the name up: {source}")]
    Read {
        /// The whole setting.
        spec: String,
        /// The file.
        file: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Resolves `spec` against the system's `/etc/passwd` and `/etc/group` (read only when a
/// name, or a uid without a gid, needs them).
pub fn resolve(spec: &str) -> Result<RunAs, UserError> {
    let read = |file: &'static str| {
        std::fs::read_to_string(file).map_err(|source| UserError::Read {
            spec: spec.to_owned(),
            file,
            source,
        })
    };
    let (user, group) = split(spec)?;
    let passwd = if user.parse::<u32>().is_err() || group.is_none() {
        read(PASSWD)?
    } else {
        String::new()
    };
    let groups = match group {
        Some(g) if g.parse::<u32>().is_err() => read(GROUP)?,
        _ => String::new(),
    };
    resolve_in(spec, &passwd, &groups)
}

/// Resolves `spec` against the given contents of `/etc/passwd` and `/etc/group`.
pub fn resolve_in(spec: &str, passwd: &str, groups: &str) -> Result<RunAs, UserError> {
    let (user, group) = split(spec)?;
    let numeric = user.parse::<u32>().is_ok();
    let entry = entries(passwd).find(|f| f[0] == user || (numeric && f[2] == user));
    let uid = match (user.parse::<u32>(), &entry) {
        (Ok(uid), _) => uid,
        (Err(_), Some(f)) => f[2].parse().map_err(|_| no_user(user))?,
        (Err(_), None) => return Err(no_user(user)),
    };
    let gid = match group {
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => entries(groups)
                .find(|f| f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| UserError::NoGroup {
                    spec: spec.to_owned(),
                    group: g.to_owned(),
                })?,
        },
        None => entry
            .and_then(|f| f[3].parse().ok())
            .ok_or_else(|| no_user(user))?,
    };
    Ok(RunAs {
        uid,
        gid,
        spec: spec.to_owned(),
    })
}

fn no_user(name: &str) -> UserError {
    UserError::NoUser {
        name: name.to_owned(),
    }
}

/// `user[:group]`, both parts non-empty.
fn split(spec: &str) -> Result<(&str, Option<&str>), UserError> {
    let bad = || UserError::Syntax(spec.to_owned());
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let blank = |s: &str| s.is_empty() || s.contains(|c: char| c.is_whitespace() || c == ':');
    if blank(user) || group.is_some_and(blank) {
        return Err(bad());
    }
    Ok((user, group))
}

/// The lines of a passwd or group file with at least four `:`-separated fields (comments and
/// malformed lines skipped).
fn entries(text: &str) -> impl Iterator<Item = Vec<&str>> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(|f| f.len() >= 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD_TEXT: &str = "root:x:0:0:root:/root:/bin/bash\n# a comment\nbroken line\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\nproxy:x:998:997::/var/lib/proxy:/usr/sbin/nologin\n";
    const GROUP_TEXT: &str = "root:x:0:\nnogroup:x:65534:\nproxy:x:997:\n";

    fn ok(spec: &str) -> (u32, u32) {
        let r = resolve_in(spec, PASSWD_TEXT, GROUP_TEXT).expect(spec);
        (r.uid, r.gid)
    }

    fn err(spec: &str) -> String {
        resolve_in(spec, PASSWD_TEXT, GROUP_TEXT)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn names_numbers_and_groups() {
        assert_eq!(ok("nobody"), (65534, 65534));
        assert_eq!(ok("proxy"), (998, 997));
        assert_eq!(ok("proxy:nogroup"), (998, 65534));
        assert_eq!(
            ok("65534"),
            (65534, 65534),
            "a known uid takes its primary group"
        );
        assert_eq!(ok("1234:4321"), (1234, 4321), "numbers need no entry");
        assert_eq!(ok("nobody:0"), (65534, 0));
    }

    #[test]
    fn unknown_names_and_bad_syntax_are_named() {
        let e = err("nosuchuser");
        assert!(
            e.contains("\"nosuchuser\": no such user in /etc/passwd"),
            "{e}"
        );
        let e = err("1234");
        assert!(e.contains("no such user") && e.contains("uid:gid"), "{e}");
        let e = err("nobody:nosuchgroup");
        assert!(e.contains("no group \"nosuchgroup\" in /etc/group"), "{e}");
        for bad in ["", ":", "nobody:", ":0", "a b", "a:b:c"] {
            assert!(
                err(bad).contains("expected a name"),
                "{bad:?}: {}",
                err(bad)
            );
        }
    }
}
