//! The small part of the zip format that torch.save files use: STORED
//! (uncompressed) records under one `<archive>/` folder, each record's
//! data aligned to 64 bytes by padding in a local extra field, a data
//! descriptor after each record, and zip64 fields where a size or an
//! offset does not fit in 32 bits. See docs/torch-save-format.md.

use std::io::{self, Write};
use std::ops::Range;

use super::image::{Image, Missing};
use crate::error::{Error, ErrorKind, Result};

/// Record data starts on a multiple of this (torch's default alignment).
pub const ALIGNMENT: u64 = 64;

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;

const LOCAL_LEN: usize = 30;
const CENTRAL_LEN: usize = 46;
const EOCD_LEN: usize = 22;
const ZIP64_EOCD_LEN: usize = 56;
const ZIP64_LOCATOR_LEN: usize = 20;

/// Extra-field ids: zip64 sizes/offset, and the padding field torch uses.
const ZIP64_EXTRA: u16 = 0x0001;
const PAD_EXTRA: u16 = 0x4246; // "FB"

/// General-purpose flags: bit 3 (sizes in a data descriptor) and bit 11
/// (UTF-8 names), as torch writes them; bit 0 means encrypted.
const FLAG_DESCRIPTOR: u16 = 1 << 3;
const FLAG_UTF8: u16 = 1 << 11;
const FLAG_ENCRYPTED: u16 = 1;
/// Bit 6: strong encryption; bit 13: the local headers are masked (an
/// encrypted central directory). Neither can be read without a key.
const FLAG_STRONG_ENCRYPTION: u16 = 1 << 6;
const FLAG_MASKED_HEADERS: u16 = 1 << 13;
const ENCRYPTION_FLAGS: u16 = FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION | FLAG_MASKED_HEADERS;

/// A 32-bit field holding this value means "see the zip64 extra field".
const U32_MARK: u64 = 0xFFFF_FFFF;

/// Most records a content-store file may hold (torch writes 6 or 7).
const MAX_ENTRIES: usize = 1024;

struct CentralEntry {
    name: String,
    crc: u32,
    size: u64,
    header_offset: u64,
}

/// Writes a zip of STORED records to `w`, aligning each record's data to
/// [`ALIGNMENT`] from the start of the stream.
pub struct ZipWriter<W: Write> {
    w: W,
    pos: u64,
    entries: Vec<CentralEntry>,
}

impl<W: Write> ZipWriter<W> {
    pub fn new(w: W) -> Self {
        ZipWriter { w, pos: 0, entries: Vec::new() }
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.w.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Adds one record, computing its CRC-32.
    pub fn add(&mut self, name: &str, data: &[u8]) -> io::Result<()> {
        self.add_with_crc(name, data, crc32fast::hash(data))
    }

    /// Adds one record whose CRC-32 the caller computed already (a big
    /// storage's, computed once on several cores). The data goes to the
    /// inner writer in one call: a buffered writer passes it straight to
    /// the file as one large write.
    pub fn add_with_crc(&mut self, name: &str, data: &[u8], crc: u32) -> io::Result<()> {
        let size = data.len() as u64;
        let header_offset = self.pos;
        let big = size >= U32_MARK;
        let mut header = Vec::with_capacity(LOCAL_LEN + name.len() + 24 + ALIGNMENT as usize);
        put_u32(&mut header, LOCAL_SIG);
        put_u16(&mut header, if big { 45 } else { 20 }); // version needed
        put_u16(&mut header, FLAG_DESCRIPTOR | FLAG_UTF8);
        put_u16(&mut header, 0); // method: stored
        put_u16(&mut header, 0); // time
        put_u16(&mut header, 0); // date
        put_u32(&mut header, 0); // crc: in the descriptor
        put_u32(&mut header, if big { U32_MARK as u32 } else { 0 });
        put_u32(&mut header, if big { U32_MARK as u32 } else { 0 });
        put_u16(&mut header, name.len() as u16);
        let extra_len_at = header.len();
        put_u16(&mut header, 0); // extra length, filled below
        header.extend_from_slice(name.as_bytes());
        let extra_start = header.len();
        if big {
            put_u16(&mut header, ZIP64_EXTRA);
            put_u16(&mut header, 16);
            put_u64(&mut header, size);
            put_u64(&mut header, size);
        }
        // The padding field's 4-byte header always goes in, then as many
        // filler bytes as bring the data to the alignment.
        let unpadded = header_offset + header.len() as u64 + 4;
        let pad = ((ALIGNMENT - unpadded % ALIGNMENT) % ALIGNMENT) as usize;
        put_u16(&mut header, PAD_EXTRA);
        put_u16(&mut header, pad as u16);
        header.resize(header.len() + pad, b'Z');
        let extra_len = (header.len() - extra_start) as u16;
        header[extra_len_at..extra_len_at + 2].copy_from_slice(&extra_len.to_le_bytes());
        self.put(&header)?;

        self.put(data)?;

        let mut desc = Vec::with_capacity(24);
        put_u32(&mut desc, DESCRIPTOR_SIG);
        put_u32(&mut desc, crc);
        if big {
            put_u64(&mut desc, size);
            put_u64(&mut desc, size);
        } else {
            put_u32(&mut desc, size as u32);
            put_u32(&mut desc, size as u32);
        }
        self.put(&desc)?;
        self.entries.push(CentralEntry { name: name.to_string(), crc, size, header_offset });
        Ok(())
    }

    /// Writes the central directory and the end records; returns the
    /// inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        let cd_offset = self.pos;
        let mut cd = Vec::new();
        for e in &self.entries {
            let big_size = e.size >= U32_MARK;
            let big_offset = e.header_offset >= U32_MARK;
            let mut extra = Vec::new();
            if big_size {
                put_u64(&mut extra, e.size);
                put_u64(&mut extra, e.size);
            }
            if big_offset {
                put_u64(&mut extra, e.header_offset);
            }
            put_u32(&mut cd, CENTRAL_SIG);
            put_u16(&mut cd, 0x031e); // made by: Unix, spec 3.0
            put_u16(&mut cd, if extra.is_empty() { 20 } else { 45 });
            put_u16(&mut cd, FLAG_DESCRIPTOR | FLAG_UTF8);
            put_u16(&mut cd, 0);
            put_u16(&mut cd, 0);
            put_u16(&mut cd, 0);
            put_u32(&mut cd, e.crc);
            let size32 = if big_size { U32_MARK as u32 } else { e.size as u32 };
            put_u32(&mut cd, size32);
            put_u32(&mut cd, size32);
            put_u16(&mut cd, e.name.len() as u16);
            put_u16(&mut cd, if extra.is_empty() { 0 } else { 4 + extra.len() as u16 });
            put_u16(&mut cd, 0); // comment
            put_u16(&mut cd, 0); // disk
            put_u16(&mut cd, 0); // internal attributes
            put_u32(&mut cd, 0); // external attributes
            put_u32(&mut cd, if big_offset { U32_MARK as u32 } else { e.header_offset as u32 });
            cd.extend_from_slice(e.name.as_bytes());
            if !extra.is_empty() {
                put_u16(&mut cd, ZIP64_EXTRA);
                put_u16(&mut cd, extra.len() as u16);
                cd.extend_from_slice(&extra);
            }
        }
        let cd_size = cd.len() as u64;
        let count = self.entries.len() as u64;
        let zip64_offset = cd_offset + cd_size;
        // Always the zip64 end records too, as torch writes them.
        put_u32(&mut cd, ZIP64_EOCD_SIG);
        put_u64(&mut cd, (ZIP64_EOCD_LEN - 12) as u64);
        put_u16(&mut cd, 0x031e);
        put_u16(&mut cd, 45);
        put_u32(&mut cd, 0);
        put_u32(&mut cd, 0);
        put_u64(&mut cd, count);
        put_u64(&mut cd, count);
        put_u64(&mut cd, cd_size);
        put_u64(&mut cd, cd_offset);
        put_u32(&mut cd, ZIP64_LOCATOR_SIG);
        put_u32(&mut cd, 0);
        put_u64(&mut cd, zip64_offset);
        put_u32(&mut cd, 1);
        put_u32(&mut cd, EOCD_SIG);
        put_u16(&mut cd, 0);
        put_u16(&mut cd, 0);
        put_u16(&mut cd, count.min(0xFFFF) as u16);
        put_u16(&mut cd, count.min(0xFFFF) as u16);
        put_u32(&mut cd, cd_size.min(U32_MARK) as u32);
        put_u32(&mut cd, cd_offset.min(U32_MARK) as u32);
        put_u16(&mut cd, 0);
        self.put(&cd)?;
        self.w.flush()?;
        Ok(self.w)
    }
}

fn put_u16(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// One record of a parsed zip: its full name, where its data lies in the
/// file, and the CRC-32 the central directory gives for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipEntry {
    pub name: String,
    pub data: Range<usize>,
    pub crc: u32,
}

impl ZipEntry {
    /// Whether the data's CRC-32 matches the directory's. A stored CRC of
    /// 0 is taken as "not computed" (torch can be told not to compute it).
    pub fn crc_ok(&self, file: &[u8]) -> bool {
        self.crc == 0 || crc32fast::hash(&file[self.data.clone()]) == self.crc
    }

    /// [`ZipEntry::crc_ok`] in an image of the file; false when the
    /// data is not at hand.
    pub fn crc_ok_in(&self, img: &Image) -> bool {
        self.crc == 0 || img.get(self.data.start, self.data.len()).is_ok_and(|d| crc32fast::hash(d) == self.crc)
    }
}

fn corrupt(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, format!("not a torch.save zip: {}", what.into()))
}

/// Bounds-checked little-endian reads from an image of the file, below
/// `limit`.
struct Cursor<'a> {
    img: &'a Image<'a>,
    limit: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(img: &'a Image<'a>, what: &'static str) -> Self {
        Cursor { img, limit: img.len(), what }
    }

    fn bytes(&self, at: usize, len: usize) -> Result<&'a [u8]> {
        let past_end = || corrupt(format!("{} at byte {at} runs past the end of the file", self.what));
        if at.checked_add(len).map_or(true, |end| end > self.limit) {
            return Err(past_end());
        }
        self.img.get(at, len).map_err(|m| match m {
            Missing::PastEnd => past_end(),
            Missing::NotRead => corrupt(format!("{} at byte {at} lies in the part of the file not read", self.what)),
        })
    }
    fn u16(&self, at: usize) -> Result<u16> {
        Ok(u16::from_le_bytes(self.bytes(at, 2)?.try_into().unwrap()))
    }
    fn u32(&self, at: usize) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(at, 4)?.try_into().unwrap()))
    }
    fn u64(&self, at: usize) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(at, 8)?.try_into().unwrap()))
    }
}

/// Where the central directory is and how many entries it has.
struct Directory {
    offset: usize,
    size: usize,
    count: usize,
    /// Where the end records begin (nothing of an entry may reach it).
    end_records: usize,
}

fn find_directory(file: &Image) -> Result<Directory> {
    let c = Cursor::new(file, "end of central directory");
    if file.len() < EOCD_LEN {
        return Err(corrupt(format!("{} bytes is too short to hold a zip end record", file.len())));
    }
    // The end record is the last 22 bytes unless a comment follows it.
    let lowest = file.len().saturating_sub(EOCD_LEN + 0xFFFF);
    let mut at = file.len() - EOCD_LEN;
    let eocd = loop {
        if c.u32(at)? == EOCD_SIG && at + EOCD_LEN + c.u16(at + 20)? as usize == file.len() {
            break at;
        }
        if at == lowest {
            return Err(corrupt("no end of central directory record"));
        }
        at -= 1;
    };
    if c.u16(eocd + 4)? != 0 || c.u16(eocd + 6)? != 0 {
        return Err(corrupt("a multi-disk zip"));
    }
    let mut count = c.u16(eocd + 10)? as u64;
    let mut size = c.u32(eocd + 12)? as u64;
    let mut offset = c.u32(eocd + 16)? as u64;
    let mut end_records = eocd;
    let has_locator = eocd >= ZIP64_LOCATOR_LEN && c.u32(eocd - ZIP64_LOCATOR_LEN)? == ZIP64_LOCATOR_SIG;
    if has_locator {
        let loc = eocd - ZIP64_LOCATOR_LEN;
        let c64 = Cursor::new(file, "zip64 end of central directory");
        let rec = usize::try_from(c64.u64(loc + 8)?).map_err(|_| corrupt("zip64 end record offset out of range"))?;
        if rec.checked_add(ZIP64_EOCD_LEN).map_or(true, |end| end > loc) {
            return Err(corrupt(format!("zip64 end record at {rec} overlaps its locator at {loc}")));
        }
        if c64.u32(rec)? != ZIP64_EOCD_SIG {
            return Err(corrupt(format!("no zip64 end record at byte {rec}, where the locator points")));
        }
        if c64.u32(rec + 16)? != 0 || c64.u32(rec + 20)? != 0 {
            return Err(corrupt("a multi-disk zip64"));
        }
        let count64 = c64.u64(rec + 32)?;
        let size64 = c64.u64(rec + 40)?;
        let offset64 = c64.u64(rec + 48)?;
        // The 32-bit fields must agree where they are not the overflow mark.
        if (count != 0xFFFF && count != count64) || (size != U32_MARK && size != size64) || (offset != U32_MARK && offset != offset64) {
            return Err(corrupt("zip64 end record disagrees with the end record"));
        }
        count = count64;
        size = size64;
        offset = offset64;
        end_records = rec;
    } else if count == 0xFFFF || size == U32_MARK || offset == U32_MARK {
        return Err(corrupt("end record says zip64 but there is no zip64 locator"));
    }
    let offset = usize::try_from(offset).map_err(|_| corrupt("central directory offset out of range"))?;
    let size = usize::try_from(size).map_err(|_| corrupt("central directory size out of range"))?;
    if offset.checked_add(size) != Some(end_records) {
        return Err(corrupt(format!(
            "central directory ({size} bytes at {offset}) does not end where the end records begin ({end_records})"
        )));
    }
    let count = usize::try_from(count).unwrap_or(usize::MAX);
    if count > MAX_ENTRIES || count > size / CENTRAL_LEN {
        return Err(corrupt(format!("central directory claims {count} entries in {size} bytes")));
    }
    Ok(Directory { offset, size, count, end_records })
}

/// Parses and checks a zip of STORED records: the end records, every
/// central-directory entry, and each entry's local header. Refuses
/// compression, encryption, duplicate names, overlapping records and
/// anything out of bounds. Entries come back in file order.
pub fn read_entries(file: &[u8]) -> Result<Vec<ZipEntry>> {
    read_entries_in(&Image::whole(file))
}

/// [`read_entries`] from an image of the file (see [`Image`]): a byte it
/// needs that is not at hand is an error (`Corrupt`).
pub fn read_entries_in(file: &Image) -> Result<Vec<ZipEntry>> {
    let dir = find_directory(file)?;
    let c = Cursor::new(file, "central directory entry");
    // (local header offset, end of the record with its descriptor, entry)
    let mut entries: Vec<(usize, usize, ZipEntry)> = Vec::with_capacity(dir.count);
    let mut at = dir.offset;
    for i in 0..dir.count {
        if c.u32(at)? != CENTRAL_SIG {
            return Err(corrupt(format!("central directory entry {i} has a bad signature")));
        }
        let flags = c.u16(at + 8)?;
        let method = c.u16(at + 10)?;
        let crc = c.u32(at + 16)?;
        let csize = c.u32(at + 20)? as u64;
        let usize_ = c.u32(at + 24)? as u64;
        let name_len = c.u16(at + 28)? as usize;
        let extra_len = c.u16(at + 30)? as usize;
        let comment_len = c.u16(at + 32)? as usize;
        let disk = c.u16(at + 34)?;
        let header_offset = c.u32(at + 42)? as u64;
        let name = std::str::from_utf8(c.bytes(at + CENTRAL_LEN, name_len)?)
            .map_err(|_| corrupt(format!("entry {i} has a name that is not UTF-8")))?
            .to_string();
        if flags & ENCRYPTION_FLAGS != 0 {
            return Err(corrupt(format!("entry {name} is encrypted (flags {flags:#06x})")));
        }
        if method != 0 {
            return Err(corrupt(format!("entry {name} is compressed (method {method}); torch.save stores records")));
        }
        if disk != 0 {
            return Err(corrupt(format!("entry {name} is on another disk")));
        }
        let extra = c.bytes(at + CENTRAL_LEN + name_len, extra_len)?;
        let (size, csize, header_offset) = apply_zip64(&name, extra, usize_, csize, header_offset)?;
        if size != csize {
            return Err(corrupt(format!("entry {name} has stored size {csize} but size {size}")));
        }
        let (data, record_end) = local_data(file, &name, header_offset, size, crc, dir.offset)?;
        entries.push((header_offset as usize, record_end, ZipEntry { name, data, crc }));
        at = at + CENTRAL_LEN + name_len + extra_len + comment_len;
        if at > dir.offset + dir.size {
            return Err(corrupt(format!("central directory entry {i} runs past the directory")));
        }
    }
    if at != dir.offset + dir.size {
        return Err(corrupt("central directory has bytes after its last entry"));
    }
    entries.sort_by_key(|(h, _, _)| *h);
    for pair in entries.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(corrupt(format!("entries {} and {} overlap", pair[0].2.name, pair[1].2.name)));
        }
    }
    let mut names: Vec<&str> = entries.iter().map(|(_, _, e)| e.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(corrupt(format!("entry {} appears twice", w[0])));
    }
    debug_assert!(dir.end_records <= file.len());
    Ok(entries.into_iter().map(|(_, _, e)| e).collect())
}

/// Replaces 32-bit fields holding the overflow mark with the values of the
/// zip64 extra field, which lists only those, in this order.
fn apply_zip64(name: &str, mut extra: &[u8], size: u64, csize: u64, offset: u64) -> Result<(u64, u64, u64)> {
    let (mut size, mut csize, mut offset) = (size, csize, offset);
    let wanted = [size, csize, offset].iter().filter(|v| **v == U32_MARK).count();
    let mut found = false;
    while extra.len() >= 4 {
        let id = u16::from_le_bytes([extra[0], extra[1]]);
        let len = u16::from_le_bytes([extra[2], extra[3]]) as usize;
        let body = extra.get(4..4 + len).ok_or_else(|| corrupt(format!("entry {name} has an extra field longer than its extra area")))?;
        if id == ZIP64_EXTRA && !found {
            found = true;
            if body.len() < 8 * wanted {
                return Err(corrupt(format!("entry {name} has a zip64 field too short for its sizes")));
            }
            let mut vals = body.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
            for field in [&mut size, &mut csize, &mut offset] {
                if *field == U32_MARK {
                    *field = vals.next().unwrap_or(U32_MARK);
                }
            }
        }
        extra = &extra[4 + len..];
    }
    if !extra.is_empty() {
        return Err(corrupt(format!("entry {name} has a truncated extra field")));
    }
    if wanted > 0 && !found {
        return Err(corrupt(format!("entry {name} needs a zip64 field but has none")));
    }
    Ok((size, csize, offset))
}

/// The zip64 extra field's values in a local header (sizes first), if it
/// has one; every extra field must fit the extra area exactly.
fn local_zip64(name: &str, mut extra: &[u8]) -> Result<Option<Vec<u64>>> {
    let mut found = None;
    while extra.len() >= 4 {
        let id = u16::from_le_bytes([extra[0], extra[1]]);
        let len = u16::from_le_bytes([extra[2], extra[3]]) as usize;
        let body =
            extra.get(4..4 + len).ok_or_else(|| corrupt(format!("entry {name} has a local extra field longer than its extra area")))?;
        if id == ZIP64_EXTRA && found.is_none() {
            found = Some(body.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect());
        }
        extra = &extra[4 + len..];
    }
    if !extra.is_empty() {
        return Err(corrupt(format!("entry {name} has a truncated local extra field")));
    }
    Ok(found)
}

/// Checks an entry's local header against its central-directory entry
/// (name, method, encryption flags, CRC and sizes, or the data descriptor
/// after the data that carries them) and returns where its data lies and
/// where the record ends (after its descriptor); both must end before the
/// central directory.
fn local_data(file: &Image, name: &str, header_offset: u64, size: u64, crc: u32, cd_offset: usize) -> Result<(Range<usize>, usize)> {
    let c = Cursor::new(file, "local header");
    let at = usize::try_from(header_offset)
        .ok()
        .filter(|a| *a < cd_offset)
        .ok_or_else(|| corrupt(format!("entry {name} has its header at {header_offset}, past the records")))?;
    if c.u32(at)? != LOCAL_SIG {
        return Err(corrupt(format!("entry {name} has no local header at byte {at}")));
    }
    let flags = c.u16(at + 6)?;
    if flags & ENCRYPTION_FLAGS != 0 {
        return Err(corrupt(format!("entry {name} is encrypted in its local header (flags {flags:#06x})")));
    }
    let method = c.u16(at + 8)?;
    if method != 0 {
        return Err(corrupt(format!("entry {name} is compressed in its local header (method {method})")));
    }
    let local_crc = c.u32(at + 14)?;
    let local_csize = c.u32(at + 18)? as u64;
    let local_size = c.u32(at + 22)? as u64;
    let name_len = c.u16(at + 26)? as usize;
    let extra_len = c.u16(at + 28)? as usize;
    if c.bytes(at + LOCAL_LEN, name_len)? != name.as_bytes() {
        return Err(corrupt(format!("entry {name} has another name in its local header")));
    }
    let zip64 = local_zip64(name, c.bytes(at + LOCAL_LEN + name_len, extra_len)?)?;
    let start = at + LOCAL_LEN + name_len + extra_len;
    let end = usize::try_from(size).ok().and_then(|s| start.checked_add(s));
    let end = match end {
        Some(end) if end <= cd_offset => end,
        _ => return Err(corrupt(format!("entry {name} claims {size} bytes at {start}, past the central directory at {cd_offset}"))),
    };
    let mismatch = |what: &str| corrupt(format!("entry {name}: the {what} in its local header disagrees with the central directory"));
    // A local size field is the size, or the zip64 mark with the size in
    // the local zip64 field (which then holds both sizes, in order).
    let local_sizes_ok = |zero_ok: bool| {
        let fits = |v: u64, i: usize| {
            (zero_ok && v == 0)
                || v == size
                || (v == U32_MARK && zip64.as_ref().is_some_and(|z| z.get(i).map_or(zero_ok, |x| *x == size || (zero_ok && *x == 0))))
        };
        fits(local_size, 0) && fits(local_csize, 1)
    };
    let record_end = if flags & FLAG_DESCRIPTOR != 0 {
        // CRC and sizes are 0 here (as torch and most writers leave them)
        // or already the true ones; the descriptor after the data holds
        // them: an optional signature, the CRC, then both sizes, 8 bytes
        // each when the entry is zip64.
        if local_crc != 0 && local_crc != crc {
            return Err(mismatch("CRC-32"));
        }
        if !local_sizes_ok(true) {
            return Err(mismatch("size"));
        }
        // The sizes are 8 bytes when the local header has a zip64 field
        // (as torch's miniz and the APPNOTE write them); the other width is
        // tried too, for writers that decide otherwise: either way the
        // values must be the central directory's.
        let d = Cursor { img: file, limit: cd_offset, what: "data descriptor" };
        let fields_at = |p: usize, wide: bool| -> Option<usize> {
            let crc_ok = d.u32(p).ok()? == crc;
            let (cs, us, next) = if wide {
                (d.u64(p + 4).ok()?, d.u64(p + 12).ok()?, p + 20)
            } else {
                (d.u32(p + 4).ok()? as u64, d.u32(p + 8).ok()? as u64, p + 12)
            };
            (crc_ok && cs == size && us == size).then_some(next)
        };
        let signed = d.u32(end).ok() == Some(DESCRIPTOR_SIG);
        let found = [zip64.is_some(), zip64.is_none()]
            .into_iter()
            .find_map(|wide| signed.then(|| fields_at(end + 4, wide)).flatten().or_else(|| fields_at(end, wide)));
        match found {
            Some(e) => e,
            None => {
                return Err(corrupt(format!(
                    "entry {name}: no data descriptor after its data at byte {end} matching the central directory's CRC-32 {crc:#010x} and size {size}"
                )))
            }
        }
    } else {
        if local_crc != crc {
            return Err(mismatch("CRC-32"));
        }
        if !local_sizes_ok(false) {
            return Err(mismatch("size"));
        }
        end
    };
    Ok((start..end, record_end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(records: &[(&str, &[u8])]) -> Vec<u8> {
        let mut z = ZipWriter::new(Vec::new());
        for (n, d) in records {
            z.add(n, d).unwrap();
        }
        z.finish().unwrap()
    }

    #[test]
    fn round_trip_with_alignment_and_crc() {
        let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let file = build(&[("a/x", b"hello"), ("a/data/0", &big), ("a/empty", b"")]);
        let entries = read_entries(&file).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0].name, "a/x");
        assert_eq!(&file[entries[0].data.clone()], b"hello");
        assert_eq!(&file[entries[1].data.clone()], &big[..]);
        assert!(entries[2].data.is_empty());
        for e in &entries {
            assert_eq!(e.data.start % ALIGNMENT as usize, 0, "{} not aligned", e.name);
            assert!(e.crc_ok(&file));
        }
        assert_eq!(entries[1].crc, crc32fast::hash(&big));
    }

    #[test]
    fn refuses_compressed_truncated_and_garbage() {
        let file = build(&[("a/x", b"hello")]);
        let entries = read_entries(&file).unwrap();
        // Central entry method field: the directory starts after the record.
        let cd = file.len() - EOCD_LEN - ZIP64_LOCATOR_LEN - ZIP64_EOCD_LEN - (CENTRAL_LEN + 3);
        let mut bad = file.clone();
        bad[cd + 10] = 8;
        let e = read_entries(&bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.message().contains("compressed"), "{}", e.message());

        let e = read_entries(&file[..file.len() - 1]).unwrap_err();
        assert!(e.message().contains("end of central directory"), "{}", e.message());
        assert!(read_entries(b"").is_err());
        assert!(read_entries(&[0u8; 100]).is_err());

        let mut bad = file.clone();
        bad[0] = b'X';
        assert!(read_entries(&bad).unwrap_err().message().contains("no local header"));
        let mut bad = file.clone();
        bad[entries[0].data.start] ^= 1;
        assert!(!read_entries(&bad).unwrap()[0].crc_ok(&bad));
    }

    #[test]
    fn duplicate_names_are_refused() {
        let file = build(&[("a/x", b"1"), ("a/x", b"2")]);
        assert!(read_entries(&file).unwrap_err().message().contains("appears twice"));
    }

    #[test]
    fn python_zipfile_layout_fields() {
        // The end records: zip64 record, locator, then the classic record.
        let file = build(&[("a/x", b"hello")]);
        let eocd = file.len() - EOCD_LEN;
        assert_eq!(&file[eocd..eocd + 4], b"PK\x05\x06");
        assert_eq!(&file[eocd - 20..eocd - 16], b"PK\x06\x07");
    }
}
