//! XXH64, the 64-bit xxHash Envoy hashes ring keys, Maglev permutations and request hash
//! inputs with (written from the published algorithm; the vectors below come from libxxhash).

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

/// Bytes one stripe of the four lanes takes.
const STRIPE: usize = 32;

fn round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

fn merge(acc: u64, lane: u64) -> u64 {
    (acc ^ round(0, lane)).wrapping_mul(P1).wrapping_add(P4)
}

fn u64_at(data: &[u8], at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&data[at..at + 8]);
    u64::from_le_bytes(b)
}

fn u32_at(data: &[u8], at: usize) -> u64 {
    let mut b = [0; 4];
    b.copy_from_slice(&data[at..at + 4]);
    u64::from(u32::from_le_bytes(b))
}

/// The XXH64 of `data` with `seed` (Envoy's `HashUtil::xxHash64`; its default seed is 0).
pub fn xxhash64(data: &[u8], seed: u64) -> u64 {
    let mut at = 0;
    let mut h = if data.len() >= STRIPE {
        let mut v = [
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        ];
        while at + STRIPE <= data.len() {
            for (i, lane) in v.iter_mut().enumerate() {
                *lane = round(*lane, u64_at(data, at + 8 * i));
            }
            at += STRIPE;
        }
        let h = v[0]
            .rotate_left(1)
            .wrapping_add(v[1].rotate_left(7))
            .wrapping_add(v[2].rotate_left(12))
            .wrapping_add(v[3].rotate_left(18));
        v.iter().fold(h, |h, &lane| merge(h, lane))
    } else {
        seed.wrapping_add(P5)
    };
    h = h.wrapping_add(data.len() as u64);
    while at + 8 <= data.len() {
        h ^= round(0, u64_at(data, at));
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        at += 8;
    }
    if at + 4 <= data.len() {
        h ^= u32_at(data, at).wrapping_mul(P1);
        h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        at += 4;
    }
    for &byte in &data[at..] {
        h ^= u64::from(byte).wrapping_mul(P5);
        h = h.rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::xxhash64;

    /// Every branch (empty, tail bytes, 4- and 8-byte words, full stripes, a seed) against
    /// libxxhash's answers.
    #[test]
    fn matches_the_reference_implementation() {
        let cases: [(&[u8], u64, u64); 6] = [
            (b"", 0, 0xef46_db37_51d8_e999),
            (b"abc", 0, 0x44bc_2cf5_ad77_0999),
            (b"127.0.0.1:80_0", 0, 0x4bb2_f57c_da42_c065),
            (b"127.0.0.1:8080", 1, 0xa5d6_dc00_53ab_4ed8),
            (
                b"The quick brown fox jumps over the lazy dog, twice over.",
                0,
                0xfb9f_56ce_d8ad_4fc4,
            ),
            (b"[::1]:8080", 7, 0xdc2d_16e7_bebf_d11e),
        ];
        for (data, seed, want) in cases {
            assert_eq!(
                xxhash64(data, seed),
                want,
                "{:?}",
                String::from_utf8_lossy(data)
            );
        }
    }
}
