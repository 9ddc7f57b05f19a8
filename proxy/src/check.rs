//! `proxy check`: whether a configuration file is usable, as the daemon would load it.

use std::{io::Write, path::PathBuf};

use proxy_core::config::{Config, ConfigError};
use serde::Serialize;

/// The verdict on one file; serialised as `proxy check --json` prints it.
#[derive(Debug, Serialize)]
pub struct Verdict {
    /// The file, as given.
    pub file: PathBuf,
    /// Whether the daemon would start with it.
    pub ok: bool,
    /// Its clusters, when it is usable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clusters: Option<usize>,
    /// Its services, when it is usable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub services: Option<usize>,
    /// What the operator should know of a usable file (services that wait for Consul's config
    /// entries).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Why it is not usable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Problem>,
}

/// Why a file is not usable.
#[derive(Debug, Serialize)]
pub struct Problem {
    /// The whole message, as `proxy check` prints it on stderr.
    pub message: String,
    /// Where, when the problem is at a place in the file (1-based).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    /// Where on that line (1-based).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column: Option<usize>,
    /// The dotted path of the field, e.g. `clusters[0].lb_policy`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// Loads and validates `file`, and resolves the user it names.
pub fn check(file: &std::path::Path) -> Verdict {
    let mut verdict = Verdict {
        file: file.to_path_buf(),
        ok: false,
        clusters: None,
        services: None,
        notes: Vec::new(),
        error: None,
    };
    match crate::load_config(file) {
        Err(err) => verdict.error = Some(Problem::from_config(&err)),
        Ok(cfg) if let Err(err) = steady_state_user(&cfg) => {
            verdict.error = Some(Problem::message(format!("{}: {err}", file.display())));
        }
        Ok(cfg) => {
            verdict.ok = true;
            verdict.clusters = Some(cfg.clusters.len());
            verdict.services = Some(cfg.services.len());
            // Chains that need Consul's entries (consul_config_entries): not the file's
            // fault, but the operator should know the service waits for them.
            verdict.notes = cfg
                .chain_failures
                .iter()
                .map(|f| {
                    format!(
                        "service {:?} waits for Consul's config entries: its {}",
                        f.service, f.reason
                    )
                })
                .collect();
        }
    }
    verdict
}

impl Verdict {
    /// The readable form: a line on `out` for a usable file (and its notes), the error on `err`.
    pub fn print_text(&self, out: &mut impl Write, err: &mut impl Write) -> std::io::Result<()> {
        if let Some(problem) = &self.error {
            return writeln!(err, "error: {}", problem.message);
        }
        writeln!(
            out,
            "{}: ok ({} clusters, {} services)",
            self.file.display(),
            self.clusters.unwrap_or_default(),
            self.services.unwrap_or_default()
        )?;
        for note in &self.notes {
            writeln!(out, "note: {note}")?;
        }
        Ok(())
    }
}

impl Problem {
    fn message(message: String) -> Self {
        Self {
            message,
            line: None,
            column: None,
            field: None,
        }
    }

    fn from_config(err: &ConfigError) -> Self {
        let mut problem = Self::message(err.to_string());
        if let ConfigError::Invalid { at, field, .. } = err {
            problem.line = Some(at.line);
            problem.column = Some(at.column);
            problem.field = Some(field.clone());
        }
        problem
    }
}

/// Resolves the configuration's `user`, so that an unknown one is a configuration error before
/// anything is attached.
pub fn steady_state_user(cfg: &Config) -> Result<(), crate::privileges::UserError> {
    cfg.user
        .as_deref()
        .map_or(Ok(()), |u| crate::privileges::resolve_user(u).map(drop))
}

#[cfg(test)]
mod tests {
    use super::check;

    /// A scratch directory of one test, removed when dropped.
    struct Scratch(std::path::PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn file(test: &str, text: &str) -> (Scratch, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("proxy-check-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creates the scratch directory");
        let path = dir.join("proxy.yaml");
        std::fs::write(&path, text).expect("writes the file");
        (Scratch(dir), path)
    }

    #[test]
    fn a_usable_file_is_ok_with_its_counts_in_json() {
        let (_dir, path) = file(
            "usable",
            "clusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 80 } } }\nservices:\n  - { name: web, address: 127.77.0.1, port: 80, cluster: web }\n",
        );
        let verdict = check(&path);
        let json = serde_json::to_value(&verdict).expect("serialises");
        assert_eq!(json["ok"], true, "{json}");
        assert_eq!(json["clusters"], 1, "{json}");
        assert_eq!(json["services"], 1, "{json}");
        assert!(json.get("error").is_none(), "{json}");
    }

    #[test]
    fn an_invalid_field_is_refused_with_its_place_in_json_and_in_text() {
        let (_dir, path) = file(
            "invalid",
            "clusters:\n  - name: web\n    lb_policy: CLUSTER_PROVIDED\n",
        );
        let verdict = check(&path);
        let json = serde_json::to_value(&verdict).expect("serialises");
        assert_eq!(json["ok"], false, "{json}");
        assert_eq!(json["error"]["line"], 3, "{json}");
        assert_eq!(json["error"]["column"], 5, "{json}");
        assert_eq!(json["error"]["field"], "clusters[0].lb_policy", "{json}");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        verdict.print_text(&mut out, &mut err).expect("prints");
        let err = String::from_utf8(err).expect("utf-8");
        assert!(out.is_empty(), "nothing on stdout for a refused file");
        assert!(
            err.starts_with(&format!(
                "error: {}:3:5: clusters[0].lb_policy:",
                path.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn an_unreadable_file_is_an_error_without_a_place() {
        let verdict = check(std::path::Path::new("/nonexistent/proxy.yaml"));
        let json = serde_json::to_value(&verdict).expect("serialises");
        assert_eq!(json["ok"], false, "{json}");
        assert!(json["error"].get("line").is_none(), "{json}");
        assert!(
            json["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("cannot read the config file")),
            "{json}"
        );
    }
}
