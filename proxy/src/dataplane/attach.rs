//! Loading the cgroup programs and attaching them through pinned bpf_links, and the sk_msg and
//! stream verdict programs to their sockmaps.

use std::{fs, path::Path};

use aya::{
    Ebpf,
    programs::{CgroupAttachMode, Program, links::FdLink},
};
use proxy_common::abi::{maps, pins, programs};

use super::{DataplaneError, maps as kernel_maps};

/// Loads one program (not yet loaded) of the object.
pub(super) fn load(ebpf: &mut Ebpf, name: &'static str) -> Result<(), DataplaneError> {
    let err = |source| DataplaneError::Program { name, source };
    match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => program.load().map_err(err),
        _ => Err(err(aya::programs::ProgramError::NotLoaded)),
    }
}

pub(super) fn attach(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &fs::File,
) -> Result<FdLink, DataplaneError> {
    let err = |source| DataplaneError::Program { name, source };
    // Through bpf_link (5.7+) the kernel takes no attach flags and always allows several
    // programs per hook, which lets a new daemon attach next to the one it replaces.
    let link = match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => {
            if program.fd().is_err() {
                program.load().map_err(err)?;
            }
            let id = program
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(err)?;
            FdLink::try_from(program.take_link(id).map_err(err)?)
        }
        Some(Program::SockOps(program)) => {
            program.load().map_err(err)?;
            let id = program
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(err)?;
            FdLink::try_from(program.take_link(id).map_err(err)?)
        }
        _ => return Err(err(aya::programs::ProgramError::NotLoaded)),
    };
    link.map_err(|_| DataplaneError::NoBpfLink { name })
}

/// Attaches sk_msg to the sockhash (replacing the program a previous run attached: existing
/// sockets keep the program they were inserted with) and pins the program.
pub(super) fn attach_splice(ebpf: &mut Ebpf, pin_dir: &Path) -> Result<(), DataplaneError> {
    let name = programs::SPLICE;
    let err = |source| DataplaneError::Program { name, source };
    // Borrowed, not taken: the programs loaded after this one refer to the map by its fd.
    let map_fd = kernel_maps::sockhash_fd(ebpf, maps::SPLICE, pin_dir)?;
    let Some(Program::SkMsg(program)) = ebpf.program_mut(name) else {
        return Err(err(aya::programs::ProgramError::NotLoaded));
    };
    program.load().map_err(err)?;
    program.attach(&map_fd).map_err(err)?;
    let path = pin_dir.join(pins::PROG_SPLICE);
    if path.exists() {
        let _ = fs::remove_file(&path);
    }
    program
        .pin(&path)
        .map_err(|source| DataplaneError::PinProgram { name, path, source })
}

/// Attaches the pair stream verdict program to `maps::PAIR_SOCKS` and pins it; on error nothing
/// of it stays attached or pinned.
pub(super) fn attach_pair(ebpf: &mut Ebpf, pin_dir: &Path) -> Result<(), DataplaneError> {
    let name = programs::PAIR;
    let err = |source| DataplaneError::Program { name, source };
    let map_fd = kernel_maps::sockhash_fd(ebpf, maps::PAIR_SOCKS, pin_dir)?;
    let Some(Program::SkSkb(program)) = ebpf.program_mut(name) else {
        return Err(err(aya::programs::ProgramError::NotLoaded));
    };
    program.load().map_err(err)?;
    let id = program.attach(&map_fd).map_err(err)?;
    let path = pin_dir.join(pins::PROG_PAIR);
    if path.exists() {
        let _ = fs::remove_file(&path);
    }
    if let Err(source) = program.pin(&path) {
        let _ = program.detach(id);
        return Err(DataplaneError::PinProgram { name, path, source });
    }
    Ok(())
}
