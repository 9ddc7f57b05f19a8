//! What the kernel runs of a loaded program: its instructions after the verifier (`xlated`),
//! read with `BPF_OBJ_GET_INFO_BY_FD`. The kernel reports a map an instruction loads as the
//! map's id, so a test can tell whether any instruction of a program still touches a map.

use std::{io, os::fd::BorrowedFd};

/// `BPF_OBJ_GET_INFO_BY_FD`.
const OBJ_GET_INFO_BY_FD: u32 = 15;
/// `BPF_LD | BPF_IMM | BPF_DW`: the two-slot load of a 64-bit immediate (or a map).
const LD_IMM64: u8 = 0x18;
/// `BPF_PSEUDO_MAP_FD` and `BPF_PSEUDO_MAP_VALUE`: the load is a map (or a value in one); the
/// dump gives the map's id as the immediate.
const PSEUDO_MAP: [u8; 2] = [1, 2];

/// The prefix of `struct bpf_prog_info` up to `xlated_prog_insns` (the kernel fills and copies
/// back only the bytes it is given).
#[repr(C)]
#[derive(Default)]
struct ProgInfo {
    prog_type: u32,
    id: u32,
    tag: [u8; 8],
    jited_prog_len: u32,
    xlated_prog_len: u32,
    jited_prog_insns: u64,
    xlated_prog_insns: u64,
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The program's instructions as the kernel runs them (8 bytes each), `len` bytes of them
/// (`ProgramInfo::size_translated`).
pub fn instructions(prog: BorrowedFd<'_>, len: u32) -> io::Result<Vec<[u8; 8]>> {
    use std::os::fd::AsRawFd as _;
    let mut insns = vec![[0u8; 8]; len as usize / 8];
    let mut info = ProgInfo {
        xlated_prog_len: len,
        xlated_prog_insns: insns.as_mut_ptr() as u64,
        ..ProgInfo::default()
    };
    let mut attr = InfoAttr {
        bpf_fd: u32::try_from(prog.as_raw_fd()).expect("an open fd"),
        info_len: u32::try_from(size_of::<ProgInfo>()).expect("small"),
        info: std::ptr::from_mut(&mut info) as u64,
    };
    let size = u32::try_from(size_of::<InfoAttr>()).expect("small attr");
    // SAFETY: `attr` is a repr(C) bpf_attr prefix of `size` bytes; it points at `info`, which
    // points at `insns`, a buffer of `len` bytes; all three outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            OBJ_GET_INFO_BY_FD,
            std::ptr::from_mut(&mut attr),
            size,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    insns.truncate(info.xlated_prog_len as usize / 8);
    Ok(insns)
}

/// The ids of the maps the instructions load (`instructions`).
pub fn map_ids(insns: &[[u8; 8]]) -> Vec<u32> {
    insns
        .iter()
        .filter(|i| i[0] == LD_IMM64 && PSEUDO_MAP.contains(&(i[1] >> 4)))
        .map(|i| u32::from_le_bytes([i[4], i[5], i[6], i[7]]))
        .collect()
}
