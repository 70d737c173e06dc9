//! A pickle writer for the few objects a content-store file holds,
//! emitting protocol 2 exactly as CPython's pickler does for them (same
//! opcodes, same memo numbering), so our `data.pkl` is byte-identical to
//! the one torch.save writes for the same object.

/// Opcodes, by their names in CPython's `pickletools`.
pub mod op {
    pub const PROTO: u8 = 0x80;
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const GLOBAL: u8 = b'c';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
    pub const BINUNICODE: u8 = b'X';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const LONG1: u8 = 0x8a;
    pub const TUPLE: u8 = b't';
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const EMPTY_TUPLE: u8 = b')';
    pub const EMPTY_DICT: u8 = b'}';
    pub const SETITEM: u8 = b's';
    pub const SETITEMS: u8 = b'u';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const REDUCE: u8 = b'R';
    pub const BINPERSID: u8 = b'Q';
}

/// Builds a protocol-2 pickle one object at a time. Container methods
/// take closures that write the items, mirroring how the pickler recurses.
pub struct Pickler {
    out: Vec<u8>,
    memo_next: u32,
}

impl Default for Pickler {
    fn default() -> Self {
        Self::new()
    }
}

impl Pickler {
    pub fn new() -> Self {
        Pickler { out: vec![op::PROTO, 2], memo_next: 0 }
    }

    /// Ends the pickle and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.push(op::STOP);
        self.out
    }

    /// Memoizes the object just written, as the pickler does for every
    /// string, global and non-empty tuple.
    fn put(&mut self) {
        let i = self.memo_next;
        self.memo_next += 1;
        if i < 256 {
            self.out.extend_from_slice(&[op::BINPUT, i as u8]);
        } else {
            self.out.push(op::LONG_BINPUT);
            self.out.extend_from_slice(&i.to_le_bytes());
        }
    }

    pub fn int(&mut self, v: i64) {
        if (0..=0xff).contains(&v) {
            self.out.extend_from_slice(&[op::BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            self.out.push(op::BININT2);
            self.out.extend_from_slice(&(v as u16).to_le_bytes());
        } else if (i32::MIN as i64..=i32::MAX as i64).contains(&v) {
            self.out.push(op::BININT);
            self.out.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            // Two's complement, little-endian, the fewest bytes that keep
            // the sign (CPython's encode_long).
            let bytes = v.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let top = bytes[n - 1];
                let next_sign = bytes[n - 2] & 0x80;
                if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.out.extend_from_slice(&[op::LONG1, n as u8]);
            self.out.extend_from_slice(&bytes[..n]);
        }
    }

    pub fn bool(&mut self, v: bool) {
        self.out.push(if v { op::NEWTRUE } else { op::NEWFALSE });
    }

    pub fn str(&mut self, s: &str) {
        self.out.push(op::BINUNICODE);
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
        self.put();
    }

    /// A module attribute such as `torch.float32` (protocol 2 GLOBAL).
    pub fn global(&mut self, module: &str, name: &str) {
        self.out.push(op::GLOBAL);
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        self.put();
    }

    /// A tuple of `len` items written by `items`.
    pub fn tuple(&mut self, len: usize, items: impl FnOnce(&mut Self)) {
        match len {
            0 => {
                // The empty tuple is a singleton: never memoized.
                self.out.push(op::EMPTY_TUPLE);
                return;
            }
            1..=3 => items(self),
            _ => {
                self.out.push(op::MARK);
                items(self);
            }
        }
        self.out.push(match len {
            1 => op::TUPLE1,
            2 => op::TUPLE2,
            3 => op::TUPLE3,
            _ => op::TUPLE,
        });
        self.put();
    }

    pub fn int_tuple(&mut self, values: &[i64]) {
        self.tuple(values.len(), |p| values.iter().for_each(|v| p.int(*v)));
    }

    /// A dict from strings to booleans (one SETITEM per pair, or MARK and
    /// SETITEMS for several, as the pickler batches them).
    pub fn str_bool_dict(&mut self, pairs: &[(&str, bool)]) {
        self.out.push(op::EMPTY_DICT);
        self.put();
        match pairs {
            [] => {}
            [(k, v)] => {
                self.str(k);
                self.bool(*v);
                self.out.push(op::SETITEM);
            }
            _ => {
                // CPython batches up to 1000 items per SETITEMS.
                for batch in pairs.chunks(1000) {
                    self.out.push(op::MARK);
                    for (k, v) in batch {
                        self.str(k);
                        self.bool(*v);
                    }
                    self.out.push(op::SETITEMS);
                }
            }
        }
    }

    /// `callable(*args)`: the callable, then the args tuple, then REDUCE.
    pub fn reduce(&mut self, callable: impl FnOnce(&mut Self), args_len: usize, args: impl FnOnce(&mut Self)) {
        callable(self);
        self.tuple(args_len, args);
        self.out.push(op::REDUCE);
        self.put();
    }

    /// An object saved by reference: the id object, then BINPERSID.
    pub fn persistent_id(&mut self, id: impl FnOnce(&mut Self)) {
        id(self);
        self.out.push(op::BINPERSID);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_use_the_smallest_opcode() {
        let enc = |v: i64| {
            let mut p = Pickler::new();
            p.int(v);
            p.finish()[2..].to_vec()
        };
        assert_eq!(enc(0), [op::BININT1, 0, op::STOP]);
        assert_eq!(enc(255), [op::BININT1, 255, op::STOP]);
        assert_eq!(enc(256), [op::BININT2, 0, 1, op::STOP]);
        assert_eq!(enc(65536), [op::BININT, 0, 0, 1, 0, op::STOP]);
        assert_eq!(enc(-1), [op::BININT, 0xff, 0xff, 0xff, 0xff, op::STOP]);
        assert_eq!(enc(1 << 31), [op::LONG1, 5, 0, 0, 0, 0x80, 0, op::STOP]);
        assert_eq!(enc(1 << 32), [op::LONG1, 5, 0, 0, 0, 0, 1, op::STOP]);
        assert_eq!(enc(-(1 << 31) - 1), [op::LONG1, 5, 0xff, 0xff, 0xff, 0x7f, 0xff, op::STOP]);
        assert_eq!(enc(i64::MAX)[..2], [op::LONG1, 8]);
    }

    #[test]
    fn memo_switches_to_long_binput_after_255() {
        let mut p = Pickler::new();
        for _ in 0..257 {
            p.str("");
        }
        let out = p.finish();
        // Each short put is 2 bytes after a 5-byte string; the 257th is long.
        let tail = &out[out.len() - 6..];
        assert_eq!(tail, [op::LONG_BINPUT, 0, 1, 0, 0, op::STOP]);
    }
}
