//! The type ids of named functions in the kernel's BTF (`/sys/kernel/btf/vmlinux`), which a
//! program names to call a kfunc or to attach to an iterator. Pure parsing of the BTF format
//! (linux/btf.h): a header, then the type section (one record per type, ids from 1), then the
//! string section.

use std::collections::BTreeMap;

/// BTF's magic, little-endian.
const MAGIC: u16 = 0xeb9f;
/// `BTF_KIND_FUNC`.
const KIND_FUNC: u32 = 12;
/// Fixed part of every type record: name_off, info, size/type.
const RECORD: usize = 12;

/// Why BTF could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    /// Not BTF, or a big-endian one.
    #[error("not little-endian BTF (bad magic)")]
    Magic,
    /// A section or record runs past the end of the data.
    #[error("BTF truncated at byte {0}")]
    Truncated(usize),
    /// A kind this parser does not know the record size of.
    #[error("BTF type {id} has unknown kind {kind}")]
    UnknownKind { id: u32, kind: u32 },
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, BtfError> {
    let bytes = data.get(at..at + 4).ok_or(BtfError::Truncated(at))?;
    Ok(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

/// Bytes after the fixed part of a record of `kind` with `vlen` members.
fn extra(kind: u32, vlen: usize, id: u32) -> Result<usize, BtfError> {
    Ok(match kind {
        // INT: one u32 of encoding.
        1 => 4,
        // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG.
        2 | 7 | 8 | 9 | 10 | 11 | 12 | 16 | 18 => 0,
        // ARRAY: type, index type, count.
        3 => 12,
        // STRUCT, UNION (12 per member), ENUM (8 per value).
        4 | 5 => 12 * vlen,
        6 => 8 * vlen,
        // FUNC_PROTO: 8 per parameter; DATASEC: 12 per variable.
        13 => 8 * vlen,
        15 => 12 * vlen,
        // VAR, DECL_TAG: one u32; ENUM64: 12 per value.
        14 | 17 => 4,
        19 => 12 * vlen,
        kind => return Err(BtfError::UnknownKind { id, kind }),
    })
}

/// The ids of the FUNC types among `names` that `btf` has; a name it lacks is absent from the
/// answer (a kernel without that function).
pub fn func_ids(btf: &[u8], names: &[&str]) -> Result<BTreeMap<String, u32>, BtfError> {
    let magic = btf.get(0..2).ok_or(BtfError::Truncated(0))?;
    if u16::from_le_bytes([magic[0], magic[1]]) != MAGIC {
        return Err(BtfError::Magic);
    }
    let hdr_len = u32_at(btf, 4)? as usize;
    let (type_off, type_len) = (u32_at(btf, 8)? as usize, u32_at(btf, 12)? as usize);
    let str_off = hdr_len + u32_at(btf, 16)? as usize;
    let str_len = u32_at(btf, 20)? as usize;
    let strings = btf
        .get(str_off..str_off + str_len)
        .ok_or(BtfError::Truncated(str_off))?;
    let (mut at, end) = (hdr_len + type_off, hdr_len + type_off + type_len);
    let mut found = BTreeMap::new();
    let mut id = 1u32;
    while at < end {
        let name_off = u32_at(btf, at)? as usize;
        let info = u32_at(btf, at + 4)?;
        let kind = (info >> 24) & 0x1f;
        if kind == KIND_FUNC {
            let name = strings.get(name_off..).unwrap_or_default();
            let name = name.split(|b| *b == 0).next().unwrap_or_default();
            if let Some(n) = names.iter().find(|n| n.as_bytes() == name) {
                found.insert((*n).to_owned(), id);
            }
        }
        at += RECORD + extra(kind, (info & 0xffff) as usize, id)?;
        id += 1;
    }
    if at > end || end > btf.len() {
        return Err(BtfError::Truncated(end));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob of an INT, a FUNC_PROTO with one parameter, and two FUNCs named `f` and `g`.
    fn blob() -> Vec<u8> {
        let strings = b"\0int\0f\0g\0";
        let mut types = Vec::new();
        let mut record = |name: u32, kind: u32, vlen: u32, size: u32, extra: &[u32]| {
            for word in [name, (kind << 24) | vlen, size].iter().chain(extra) {
                types.extend_from_slice(&word.to_le_bytes());
            }
        };
        record(1, 1, 0, 4, &[32]); // id 1: int
        record(0, 13, 1, 1, &[0, 1]); // id 2: proto (int) -> int
        record(5, 12, 0, 2, &[]); // id 3: f
        record(7, 12, 0, 2, &[]); // id 4: g
        let mut btf = Vec::new();
        btf.extend_from_slice(&MAGIC.to_le_bytes());
        btf.extend_from_slice(&[1, 0]);
        for word in [24u32, 0, types.len() as u32, types.len() as u32] {
            btf.extend_from_slice(&word.to_le_bytes());
        }
        btf.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        btf.extend_from_slice(&types);
        btf.extend_from_slice(strings);
        btf
    }

    #[test]
    fn finds_the_funcs_asked_for_and_omits_the_missing() {
        let ids = func_ids(&blob(), &["g", "f", "absent"]).unwrap();
        assert_eq!(ids.get("f"), Some(&3));
        assert_eq!(ids.get("g"), Some(&4));
        assert!(!ids.contains_key("absent"));
    }

    #[test]
    fn refuses_what_is_not_btf_or_is_cut_short() {
        assert_eq!(func_ids(b"\0\0\0\0", &["f"]), Err(BtfError::Magic));
        let btf = blob();
        assert!(matches!(
            func_ids(&btf[..btf.len() - 12], &["f"]),
            Err(BtfError::Truncated(_))
        ));
        assert!(func_ids(&btf[..1], &["f"]).is_err());
        let mut odd = btf.clone();
        odd[24 + 7] = 30; // the first record's kind
        assert!(matches!(
            func_ids(&odd, &["f"]),
            Err(BtfError::UnknownKind { id: 1, kind: 30 })
        ));
    }

    /// The running kernel's BTF parses, when it has one (no root needed to read it).
    #[test]
    fn the_running_kernels_btf_parses() {
        let Ok(btf) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("skipped: no /sys/kernel/btf/vmlinux");
            return;
        };
        let ids = func_ids(&btf, &["bpf_iter_tcp"]).unwrap();
        assert!(ids.contains_key("bpf_iter_tcp"));
    }
}
