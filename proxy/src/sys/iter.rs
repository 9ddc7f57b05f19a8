//! bpf(2) for BPF socket iterators, which aya 0.14 cannot load (it has no kfunc relocation):
//! `BPF_PROG_LOAD` of a tracing program for `BPF_TRACE_ITER` from instructions the caller
//! assembled, `BPF_LINK_CREATE` to make it an iterator, and `BPF_ITER_CREATE` plus `read(2)` to
//! run it once over every socket of the caller's network namespace.

use std::{
    ffi::CStr,
    io::{self, Read as _},
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
};

/// bpf(2) commands (linux/bpf.h `enum bpf_cmd`).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_ITER_CREATE: libc::c_long = 33;
/// `BPF_MAP_TYPE_HASH`.
pub const MAP_HASH: u32 = 1;
/// `BPF_MAP_TYPE_ARRAY`.
pub const MAP_ARRAY: u32 = 2;
/// `BPF_PROG_TYPE_TRACING`.
const PROG_TYPE_TRACING: u32 = 26;
/// `BPF_TRACE_ITER`, the attach type of an iterator program and of its link.
const TRACE_ITER: u32 = 28;
/// Size of the verifier's log buffer: enough for the reason of a refusal of a short program.
const LOG_SIZE: usize = 16 * 1024;
/// Bytes read from an iterator per `read(2)`; the programs print nothing, so one read is the
/// usual run.
const READ_CHUNK: usize = 256;

/// `union bpf_attr` for `BPF_PROG_LOAD`, up to `attach_btf_id` (the kernel zero-fills the rest).
#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    attach_btf_id: u32,
}
const _: () = assert!(size_of::<ProgLoad>() == 112);

/// `union bpf_attr` for `BPF_MAP_CREATE`, up to `map_name`.
#[repr(C)]
#[derive(Default)]
struct MapCreate {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

/// `union bpf_attr` for `BPF_LINK_CREATE` (an iterator without parameters).
#[repr(C)]
#[derive(Default)]
struct LinkCreate {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    iter_info: u64,
    iter_info_len: u32,
    _pad: u32,
}

/// `union bpf_attr` for `BPF_ITER_CREATE`.
#[repr(C)]
#[derive(Default)]
struct IterCreate {
    link_fd: u32,
    flags: u32,
}

/// Calls bpf(2) with `attr`, a `union bpf_attr` prefix; the new fd on success.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a valid, initialised `union bpf_attr` prefix of `size_of::<T>()`
    // bytes, alive for the call; every pointer in it points at memory alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut::<T>(attr).cast::<libc::c_void>(),
            size_of::<T>() as libc::c_uint,
        )
    };
    let fd = i32::try_from(rc).map_err(|_| io::Error::other("bpf(2) returned no fd"))?;
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: bpf(2) returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Creates a map of `map_type` (no flags), named `name` (15 bytes kept).
pub fn create_map(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    name: &CStr,
) -> io::Result<OwnedFd> {
    let mut attr = MapCreate {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_name: object_name(name),
        ..MapCreate::default()
    };
    bpf(BPF_MAP_CREATE, &mut attr)
}

/// A kernel object name: at most 15 bytes and a NUL.
fn object_name(name: &CStr) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (slot, byte) in out.iter_mut().take(15).zip(name.to_bytes()) {
        *slot = *byte;
    }
    out
}

/// Loads `insns` (8 bytes each) as a GPL tracing program for the iterator whose BTF id is
/// `target_btf_id` (the FUNC `bpf_iter_tcp`, say). On a refusal, the error carries the
/// verifier's log.
pub fn load_iter_program(name: &CStr, insns: &[u64], target_btf_id: u32) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut log = vec![0u8; LOG_SIZE];
    let prog_name = object_name(name);
    let mut attr = ProgLoad {
        prog_type: PROG_TYPE_TRACING,
        insn_cnt: u32::try_from(insns.len()).map_err(|_| io::Error::other("program too long"))?,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: LOG_SIZE as u32,
        log_buf: log.as_mut_ptr() as u64,
        prog_name,
        expected_attach_type: TRACE_ITER,
        attach_btf_id: target_btf_id,
        ..ProgLoad::default()
    };
    bpf(BPF_PROG_LOAD, &mut attr).map_err(|err| {
        let text = CStr::from_bytes_until_nul(&log)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        let last = text.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
        io::Error::new(err.kind(), format!("{err}; verifier: {last}"))
    })
}

/// Makes the iterator program `prog` a link, from which iterators are created.
pub fn link_iter(prog: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        attach_type: TRACE_ITER,
        ..LinkCreate::default()
    };
    bpf(BPF_LINK_CREATE, &mut attr)
}

/// Runs the iterator of `link` once: creates an iterator and reads it to its end (each read
/// runs the program over the next batch of sockets).
pub fn run_iter(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = IterCreate {
        link_fd: link.as_raw_fd() as u32,
        flags: 0,
    };
    let mut iter = std::fs::File::from(bpf(BPF_ITER_CREATE, &mut attr)?);
    let mut buf = [0u8; READ_CHUNK];
    loop {
        match iter.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
}
