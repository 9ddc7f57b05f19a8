//! Reading a file the configuration names, as hostile input: only a regular file, opened without
//! blocking (a FIFO would hang `proxy check` forever), and at most [`MAX_FILE`] bytes.

use std::{
    fs::File,
    io::{self, Read},
    os::unix::fs::OpenOptionsExt,
    path::Path,
};

/// The largest file read as configuration (16 MiB).
pub const MAX_FILE: u64 = 16 << 20;

/// The text of the regular file at `path`. A FIFO, a device, a socket or a directory is an
/// error, found without reading from it; so is a file over [`MAX_FILE`] bytes.
pub fn read_config_file(path: &Path) -> io::Result<String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, device, socket or directory is not read)",
        ));
    }
    if meta.len() > MAX_FILE {
        return Err(too_large());
    }
    let mut text = String::new();
    // Bounded again while reading: the file may grow after the check.
    File::take(file, MAX_FILE + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_FILE {
        return Err(too_large());
    }
    Ok(text)
}

fn too_large() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("larger than {} MiB", MAX_FILE >> 20),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("proxy-config-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn reads_regular_files_and_refuses_the_rest_without_blocking() {
        let file = temp("entries.yaml");
        std::fs::write(&file, "- Kind: service-resolver\n").unwrap();
        assert_eq!(
            read_config_file(&file).unwrap(),
            "- Kind: service-resolver\n"
        );

        let dir = file.parent().unwrap();
        let err = read_config_file(dir).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");

        // A FIFO with no writer: a blocking open would never return.
        let fifo = temp("fifo");
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(
            made.is_ok_and(|s| s.success()),
            "mkfifo (coreutils) is needed"
        );
        let err = read_config_file(&fifo).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("not a regular file"), "{err}");

        let big = temp("big.yaml");
        let f = File::create(&big).unwrap();
        f.set_len(MAX_FILE + 1).unwrap();
        let err = read_config_file(&big).unwrap_err();
        assert!(err.to_string().contains("larger than 16 MiB"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
