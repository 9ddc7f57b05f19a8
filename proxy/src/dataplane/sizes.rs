//! The sizes of the maps that hold services and host sets (`kernel_maps`): given to the loader,
//! and compared with the maps a previous run pinned, which aya would otherwise adopt whatever
//! their size.

use std::path::Path;

use aya::{EbpfLoader, maps::MapInfo};
use proxy_common::abi::maps;
use proxy_core::config::MapSizes;

use super::DataplaneError;

/// Each sized map with its size in `sizes` and the field that sets it.
fn sized(sizes: &MapSizes) -> [(&'static str, u32, &'static str); 4] {
    [
        (maps::SERVICES, sizes.services, "services"),
        // One counter entry per service id: as many as services.
        (maps::SVC_COUNTERS, sizes.services, "services"),
        (maps::SLOTS, sizes.slot_tables, "slot_tables"),
        (maps::BACKENDS, sizes.backends, "backends"),
    ]
}

/// A loader that creates the sized maps with `sizes`, once the maps pinned in `pin_dir` were
/// found to have them ([`check_pins`]).
pub(super) fn loader(
    pin_dir: &Path,
    sizes: &MapSizes,
) -> Result<EbpfLoader<'static>, DataplaneError> {
    check_pins(pin_dir, sizes)?;
    let mut loader = EbpfLoader::new();
    for (name, entries, _) in sized(sizes) {
        loader.map_max_entries(name, entries);
    }
    Ok(loader)
}

/// Refuses when a map of `pin_dir` has another size than `sizes` asks for: the loader would
/// adopt it as it is, and the limits the daemon refuses by would not be the kernel's. A map
/// whose pin cannot be read is left to the loader (which reports it).
fn check_pins(pin_dir: &Path, sizes: &MapSizes) -> Result<(), DataplaneError> {
    for (name, wanted, field) in sized(sizes) {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        let Ok(info) = MapInfo::from_pin(&path) else {
            continue;
        };
        let pinned = info.max_entries();
        if pinned != wanted {
            return Err(DataplaneError::PinnedSize {
                name,
                path,
                pinned,
                wanted,
                field,
            });
        }
    }
    Ok(())
}
