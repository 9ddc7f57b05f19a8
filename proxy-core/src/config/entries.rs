//! The file's Consul config entries: gathered from `config_entries` and `config_entry_files`,
//! each checked with Consul's rules, and the chains of the file's services compiled from them.

use super::{Config, error::Invalid};

/// `message` with every double-quoted or backquoted part replaced by `(...)`: what serde quotes
/// is what it read.
fn without_quoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut open: Option<char> = None;
    for c in message.chars() {
        match open {
            Some(q) if c == q => open = None,
            Some(_) => {}
            None if c == '"' || c == '`' => {
                open = Some(c);
                out.push_str("(...)");
            }
            None => out.push(c),
        }
    }
    out
}

/// Every config entry the file holds: `config_entries`, then each of `config_entry_files`
/// (paths relative to `base`), in order, each checked (a second entry of one kind and name is
/// refused).
pub(super) fn gather_entries(
    config: &Config,
    base: &std::path::Path,
) -> Result<Vec<proxy_chain::ConfigEntry>, Invalid> {
    let mut entries = proxy_chain::Entries::new();
    let mut gathered = config.config_entries.clone();
    for (i, entry) in config.config_entries.iter().enumerate() {
        entries
            .insert(entry.clone())
            .map_err(|e| Invalid::new(format!("config_entries[{i}]"), e.to_string()))?;
    }
    for (i, file) in config.config_entry_files.iter().enumerate() {
        let at = format!("config_entry_files[{i}]");
        let path = base.join(file);
        let text = super::read_config_file(&path)
            .map_err(|e| Invalid::new(&at, format!("{}: {e}", path.display())))?;
        // Checked for shape first, and that error names no content: the file may be any file
        // the config names, and its first line (a secret, say) must not end up in the message.
        let value: serde_norway::Value = serde_norway::from_str(&text).map_err(|e| {
            let line = e.location().map_or(0, |l| l.line());
            Invalid::new(
                &at,
                format!("{}: not YAML or JSON (line {line})", path.display()),
            )
        })?;
        if !value.is_sequence() {
            return Err(Invalid::new(
                &at,
                format!(
                    "{}: not a list of config entries (YAML or JSON)",
                    path.display()
                ),
            ));
        }
        let serde_norway::Value::Sequence(list) = value else {
            unreachable!("checked to be a sequence above")
        };
        for (n, value) in list.into_iter().enumerate() {
            // serde's words quote the values it could not read (`invalid type: string "..."`):
            // from a file that is not a list of entries they would be its content.
            let entry: proxy_chain::ConfigEntry = serde_norway::from_value(value).map_err(|e| {
                let why = without_quoted(&e.to_string());
                Invalid::new(&at, format!("{}: entry {n}: {why}", path.display()))
            })?;
            entries
                .insert(entry.clone())
                .map_err(|e| Invalid::new(&at, format!("{}: {e}", path.display())))?;
            gathered.push(entry);
        }
    }
    Ok(gathered)
}

/// The discovery chain of every service that names one, compiled from `entries` (checked by
/// [`gather_entries`] or by the composition).
pub(super) fn compile_chains(
    config: &Config,
    entries: &[proxy_chain::ConfigEntry],
) -> Result<std::collections::BTreeMap<String, proxy_chain::CompiledDiscoveryChain>, Invalid> {
    let entries = proxy_chain::Entries::from_entries(entries.iter().cloned())
        .map_err(|e| Invalid::new("config_entries", e.to_string()))?;
    let mut chains = std::collections::BTreeMap::new();
    for (i, svc) in config.services.iter().enumerate() {
        let Some(name) = &svc.chain else { continue };
        let at = format!("services[{i}].chain");
        let chain = crate::chain::compile_service(config, svc, name, &entries)
            .map_err(|e| Invalid::new(&at, e.to_string()))?;
        chains.insert(svc.name.clone(), chain);
    }
    Ok(chains)
}
