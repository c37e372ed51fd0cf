//! Click-ID fingerprints: a keyed 128-bit SipHash-1-3 of the click ID, so the cache
//! costs the same for a 36-byte UUID and a 100-byte ID, and nobody without the key
//! (`dedup.fingerprint_key`) can make two IDs collide on purpose.
//!
//! The cache spreads entries over `dedup.shards` hashes by the fingerprint's top bits
//! and stores its low 88 bits as the field (11 bytes: what keeps an entry within 32
//! bytes of Redis memory), so two click IDs share an entry only if all
//! `88 + log2(shards)` bits agree — at least 100 with the smallest allowed shard count
//! (guide, "What counts", gives the odds).

use siphasher::sip128::SipHasher13;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub u128);

impl Fingerprint {
    /// The shard hash this fingerprint lives in (`shards` is a power of two ≤ 2^24).
    pub fn shard(self, shards: u32) -> u32 {
        (self.0 >> 96) as u32 & (shards - 1)
    }

    /// The field stored in the shard hash: the low 88 bits, big-endian.
    pub fn field(self) -> [u8; 11] {
        let bytes = self.0.to_be_bytes();
        bytes[5..].try_into().expect("11 bytes")
    }
}

/// Computes fingerprints with one deployment's key.
#[derive(Clone)]
pub struct Fingerprinter(SipHasher13);

impl Fingerprinter {
    pub fn new(key: &str) -> Fingerprinter {
        // The configured key is text of any length; SipHash wants 128 bits.
        let k = SipHasher13::new_with_keys(0x636c_6963_6b61_6767, 0x6b65_7964_6572_6976).hash(key.as_bytes());
        Fingerprinter(SipHasher13::new_with_keys(k.h1, k.h2))
    }

    pub fn of(&self, click_id: &str) -> Fingerprint {
        Fingerprint(self.0.hash(click_id.as_bytes()).as_u128())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_depend_on_the_key_and_split_into_shard_and_field() {
        let a = Fingerprinter::new("one");
        let b = Fingerprinter::new("two");
        assert_eq!(a.of("click-1"), a.of("click-1"));
        assert_ne!(a.of("click-1"), a.of("click-2"));
        assert_ne!(a.of("click-1"), b.of("click-1"));
        let f = Fingerprint(0xabcd_ef01_2345_6789_0011_2233_4455_6677);
        assert_eq!(f.shard(1 << 16), 0xef01);
        assert_eq!(f.shard(1), 0);
        assert_eq!(f.field(), [0x45, 0x67, 0x89, 0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77]);
    }
}
