//! The kernel programs' log records (`kernel_log` in the configuration): aya-log's ring buffer,
//! read whenever the kernel signals new records, each record re-emitted as a `tracing` event
//! with the target `kernel`. They appear in the daemon's log in its format (text or JSON) and
//! under its filter, which `/logging` changes (`kernel=off` hides them).
//!
//! With `kernel_log: off` nothing here runs: the loader creates no reader, and the programs
//! hold no record code (see `proxy-ebpf`'s `log` module).

use tracing::{Level, warn};

/// The reader of the programs' ring buffer, created by the loader when the level is not off.
pub type KernelLog = aya_log::EbpfLogger<KernelRecords>;

/// Re-emits aya-log's `log` records as `tracing` events, target `kernel`, with the program
/// module and source line that wrote them.
pub struct KernelRecords;

impl log::Log for KernelRecords {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let module = record.module_path().unwrap_or("?");
        let line = record.line().unwrap_or(0);
        // tracing's macros take the level as a constant.
        macro_rules! emit {
            ($level:expr) => {
                tracing::event!(target: "kernel", $level, module, line, "{}", record.args())
            };
        }
        match record.level() {
            log::Level::Error => emit!(Level::ERROR),
            log::Level::Warn => emit!(Level::WARN),
            log::Level::Info => emit!(Level::INFO),
            log::Level::Debug => emit!(Level::DEBUG),
            log::Level::Trace => emit!(Level::TRACE),
        }
    }

    fn flush(&self) {}
}

/// Reads records until the daemon stops (the task is dropped with the runtime). A record is
/// formatted by aya-log, which panics on one it cannot decode; only the daemon's own programs
/// can write into the buffer (it is not pinned, and no other process holds it), so that would
/// be a bug of ours, and the daemon's panic handling applies.
pub async fn run(log: KernelLog) {
    let mut fd = match crate::sys::register_readable(log) {
        Ok(fd) => fd,
        Err(err) => {
            warn!(%err, "cannot wait for the kernel's log records; they are not shown");
            return;
        }
    };
    loop {
        match fd.readable_mut().await {
            Ok(mut ready) => {
                ready.get_inner_mut().flush();
                ready.clear_ready();
            }
            Err(err) => {
                warn!(%err, "waiting for the kernel's log records failed; no more are shown");
                return;
            }
        }
    }
}

/// The reader of the programs' log records (aya-log's ring buffer, taken out of the object), or
/// none when the level is off.
pub(crate) fn reader(
    ebpf: &mut aya::Ebpf,
    level: proxy_core::config::KernelLogLevel,
) -> Result<Option<KernelLog>, crate::dataplane::DataplaneError> {
    if level == proxy_core::config::KernelLogLevel::Off {
        return Ok(None);
    }
    aya_log::EbpfLogger::init_with_logger(ebpf, KernelRecords)
        .map(Some)
        .map_err(crate::dataplane::DataplaneError::KernelLog)
}
