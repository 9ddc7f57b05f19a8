//! Rebuild the kernel programs when the bpf-linker binary changes: building this crate has an
//! undeclared dependency on it (cargo has no artifact dependencies on stable).
use std::{env, path::Path};

fn main() {
    let Some(path) = env::var_os("PATH") else {
        return;
    };
    for dir in env::split_paths(&path) {
        let linker = dir.join("bpf-linker");
        if Path::new(&linker).exists() {
            println!("cargo:rerun-if-changed={}", linker.display());
            return;
        }
    }
}
