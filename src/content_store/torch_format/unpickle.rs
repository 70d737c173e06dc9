//! A restricted unpickler: it knows only the opcodes and globals that
//! content-store files use (torch dtypes, `torch.Size`, and for storage
//! files `torch.storage.UntypedStorage` in a persistent id) and builds
//! plain values from them. It never calls anything: REDUCE is accepted
//! only as `torch.Size(tuple_of_ints)`, which it evaluates itself. Every
//! other opcode or global is an error naming it. Sizes are bounded: the
//! pickle's length, string lengths, stack, marks, memo and nesting depth.

use std::rc::Rc;

use super::pickle::op;
use crate::content_store::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};

/// Longest pickle accepted (a tensor entry's is about 120 bytes).
pub const MAX_PICKLE_LEN: usize = 64 * 1024;
/// Longest string (hashes are 40 to 64 characters).
const MAX_STR_LEN: usize = 4096;
const MAX_STACK: usize = 1024;
const MAX_MARKS: usize = 8;
const MAX_MEMO: usize = 1024;
/// Deepest nesting of containers (an entry is a tuple of tuples: 2).
const MAX_DEPTH: usize = 4;
/// Longest GLOBAL module or attribute name.
const MAX_GLOBAL_LEN: usize = 64;

/// The globals a content-store file may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Global {
    /// `torch.<dtype>`, e.g. `torch.float32`.
    Dtype(Dtype),
    /// `torch.Size`, only ever called on a tuple of ints.
    TorchSize,
    /// `torch.storage.UntypedStorage`, only inside a persistent id.
    UntypedStorage,
}

/// A storage referenced by a persistent id: `('storage', UntypedStorage,
/// key, location, nbytes)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageRef {
    pub key: String,
    pub location: String,
    pub nbytes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Bool(bool),
    Str(Rc<str>),
    Tuple(Rc<Seq>),
    /// Owned, not shared: only the dict on the stack is ever mutated, and
    /// a memoized dict may not be fetched again (see BINGET).
    Dict(Dict),
    Global(Global),
    /// The result of `torch.Size((ints...))`.
    Size(Rc<[i64]>),
    Storage(Rc<StorageRef>),
}

/// A tuple's items and its nesting depth, kept so that checking the depth
/// of a new container never walks what is inside it (shared items could
/// make that walk exponential).
#[derive(Clone, Debug, PartialEq)]
pub struct Seq {
    pub items: Vec<Value>,
    depth: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Dict {
    pub pairs: Vec<(Value, Value)>,
    depth: usize,
}

fn seq(items: Vec<Value>) -> Value {
    let depth = 1 + items.iter().map(Value::depth).max().unwrap_or(0);
    Value::Tuple(Rc::new(Seq { items, depth }))
}

impl Value {
    /// How deeply containers nest in this value (O(1)).
    fn depth(&self) -> usize {
        match self {
            Value::Tuple(t) => t.depth,
            Value::Dict(d) => d.depth,
            Value::Size(_) => 1,
            _ => 0,
        }
    }

    /// The items of a tuple, if this is one.
    pub fn as_tuple(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(t) => Some(&t.items),
            _ => None,
        }
    }

    /// A short description for error messages.
    pub fn describe(&self) -> String {
        match self {
            Value::Int(v) => format!("the int {v}"),
            Value::Bool(b) => format!("the bool {b}"),
            Value::Str(s) => format!("the string {:?}", truncate(s)),
            Value::Tuple(t) => format!("a tuple of {} items", t.items.len()),
            Value::Dict(d) => format!("a dict of {} items", d.pairs.len()),
            Value::Global(g) => global_name(*g),
            Value::Size(s) => format!("torch.Size of {} dims", s.len()),
            Value::Storage(_) => "a storage reference".to_string(),
        }
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(48).collect()
}

pub fn global_name(g: Global) -> String {
    match g {
        Global::Dtype(d) => format!("torch.{}", d.torch_name()),
        Global::TorchSize => "torch.Size".to_string(),
        Global::UntypedStorage => "torch.storage.UntypedStorage".to_string(),
    }
}

/// What a pickle may contain beyond plain values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allow {
    /// A tensor entry: no persistent ids.
    TensorEntry,
    /// A storage file: one persistent id naming an UntypedStorage.
    StorageFile,
}

fn bad(at: usize, what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Corrupt, format!("pickle byte {at}: {what}"))
}

enum Slot {
    Value(Value),
    Mark,
}

/// A memo entry. A dict's is only a note that it was put: fetching it
/// again would need the shared, mutable dict of Python's memo, and no
/// content-store file does it.
#[derive(Clone)]
enum Memo {
    Empty,
    Dict,
    Value(Value),
}

struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    stack: Vec<Slot>,
    marks: usize,
    memo: Vec<Memo>,
    allow: Allow,
}

/// Runs the restricted unpickler over `input` and returns the one value
/// it leaves.
pub fn unpickle(input: &[u8], allow: Allow) -> Result<Value> {
    if input.len() > MAX_PICKLE_LEN {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("pickle of {} bytes is longer than the {MAX_PICKLE_LEN} a content-store file needs", input.len()),
        ));
    }
    let mut m = Machine { input, pos: 0, stack: Vec::new(), marks: 0, memo: Vec::new(), allow };
    m.run()
}

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let at = self.pos;
        let bytes = at
            .checked_add(n)
            .and_then(|end| self.input.get(at..end))
            .ok_or_else(|| bad(at, format!("{what} of {n} bytes runs past the end of the pickle")))?;
        self.pos += n;
        Ok(bytes)
    }

    fn byte(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }

    fn line(&mut self, at: usize, what: &str) -> Result<&'a str> {
        let rest = &self.input[self.pos..];
        let window = &rest[..rest.len().min(MAX_GLOBAL_LEN + 1)];
        let n = window
            .iter()
            .position(|b| *b == b'\n')
            .ok_or_else(|| bad(at, format!("GLOBAL {what} is not a line of at most {MAX_GLOBAL_LEN} bytes")))?;
        let text = std::str::from_utf8(&rest[..n])
            .ok()
            .filter(|s| s.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| bad(at, format!("GLOBAL {what} is not printable ASCII")))?;
        self.pos += n + 1;
        Ok(text)
    }

    fn push(&mut self, at: usize, v: Value) -> Result<()> {
        if self.stack.len() >= MAX_STACK {
            return Err(bad(at, format!("stack deeper than {MAX_STACK} items")));
        }
        if v.depth() > MAX_DEPTH {
            return Err(bad(at, format!("containers nested deeper than {MAX_DEPTH}")));
        }
        self.stack.push(Slot::Value(v));
        Ok(())
    }

    fn pop(&mut self, at: usize, opname: &str) -> Result<Value> {
        match self.stack.pop() {
            Some(Slot::Value(v)) => Ok(v),
            Some(Slot::Mark) => Err(bad(at, format!("{opname} found a MARK where it needs a value"))),
            None => Err(bad(at, format!("{opname} on an empty stack"))),
        }
    }

    /// The values above the topmost mark, which is removed.
    fn pop_to_mark(&mut self, at: usize, opname: &str) -> Result<Vec<Value>> {
        let mark = self.stack.iter().rposition(|s| matches!(s, Slot::Mark)).ok_or_else(|| bad(at, format!("{opname} without a MARK")))?;
        let items = self
            .stack
            .drain(mark + 1..)
            .map(|s| match s {
                Slot::Value(v) => v,
                Slot::Mark => unreachable!("the topmost mark is at {mark}"),
            })
            .collect();
        self.stack.pop();
        self.marks -= 1;
        Ok(items)
    }

    fn memo_put(&mut self, at: usize, index: u32) -> Result<()> {
        let index = index as usize;
        if index >= MAX_MEMO {
            return Err(bad(at, format!("memo index {index} is past the {MAX_MEMO} a content-store file needs")));
        }
        let v = match self.stack.last() {
            Some(Slot::Value(Value::Dict(_))) => Memo::Dict,
            Some(Slot::Value(v)) => Memo::Value(v.clone()),
            _ => return Err(bad(at, "PUT with no value on the stack")),
        };
        if self.memo.len() <= index {
            self.memo.resize(index + 1, Memo::Empty);
        }
        self.memo[index] = v;
        Ok(())
    }

    fn memo_get(&mut self, at: usize, index: u32) -> Result<()> {
        let v = match self.memo.get(index as usize) {
            Some(Memo::Dict) => return Err(bad(at, format!("GET of memo {index}, a dict, which no content-store file does"))),
            Some(Memo::Value(v)) => v.clone(),
            _ => return Err(bad(at, format!("GET of memo {index}, which was never PUT"))),
        };
        self.push(at, v)
    }

    fn tuple_of(&mut self, at: usize, n: usize, opname: &str) -> Result<()> {
        if self.stack.len() < n {
            return Err(bad(at, format!("{opname} needs {n} values")));
        }
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.pop(at, opname)?);
        }
        items.reverse();
        self.push(at, seq(items))
    }

    fn set_items(&mut self, at: usize, pairs: Vec<Value>, opname: &str) -> Result<()> {
        if pairs.len() % 2 != 0 {
            return Err(bad(at, format!("{opname} with an odd number of items")));
        }
        let dict = match self.stack.last_mut() {
            Some(Slot::Value(Value::Dict(d))) => d,
            Some(Slot::Value(v)) => return Err(bad(at, format!("{opname} on {}, not a dict", v.describe()))),
            _ => return Err(bad(at, format!("{opname} without a dict"))),
        };
        let mut it = pairs.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            if matches!(k, Value::Dict(_)) || matches!(v, Value::Dict(_)) {
                return Err(bad(at, "a dict inside a dict, which no content-store file has"));
            }
            dict.depth = dict.depth.max(1 + k.depth().max(v.depth()));
            if dict.depth > MAX_DEPTH {
                return Err(bad(at, format!("containers nested deeper than {MAX_DEPTH}")));
            }
            dict.pairs.push((k, v));
        }
        Ok(())
    }

    fn global(&mut self, at: usize) -> Result<Value> {
        let module = self.line(at, "module")?;
        let name = self.line(at, "name")?;
        let g = match (module, name) {
            ("torch", "Size") => Global::TorchSize,
            ("torch.storage", "UntypedStorage") if self.allow == Allow::StorageFile => Global::UntypedStorage,
            ("torch", dtype) => match Dtype::from_torch_name(dtype) {
                Ok(d) => Global::Dtype(d),
                Err(_) => return Err(bad(at, format!("GLOBAL torch.{dtype} is not a dtype this store supports"))),
            },
            _ => {
                return Err(bad(
                    at,
                    format!("GLOBAL {module}.{name} is refused: a content-store file names only torch dtypes and torch.Size"),
                ))
            }
        };
        Ok(Value::Global(g))
    }

    fn reduce(&mut self, at: usize) -> Result<Value> {
        let args = self.pop(at, "REDUCE")?;
        let callable = self.pop(at, "REDUCE")?;
        if callable != Value::Global(Global::TorchSize) {
            return Err(bad(at, format!("REDUCE calls {}; only torch.Size may be called", callable.describe())));
        }
        let dims = match &args {
            Value::Tuple(a) if a.items.len() == 1 => match &a.items[0] {
                Value::Tuple(d) => &d.items,
                other => return Err(bad(at, format!("torch.Size called on {}, not a tuple", other.describe()))),
            },
            other => return Err(bad(at, format!("torch.Size called with {} as its arguments", other.describe()))),
        };
        let ints = dims
            .iter()
            .map(|d| match d {
                Value::Int(v) => Ok(*v),
                other => Err(bad(at, format!("torch.Size given {}, not an int", other.describe()))),
            })
            .collect::<Result<Vec<i64>>>()?;
        Ok(Value::Size(ints.into()))
    }

    fn persistent_load(&mut self, at: usize) -> Result<Value> {
        if self.allow != Allow::StorageFile {
            return Err(bad(at, "BINPERSID (a storage reference) in a tensor entry, which holds none"));
        }
        let pid = self.pop(at, "BINPERSID")?;
        let parts = match &pid {
            Value::Tuple(p) => p.items.clone(),
            other => return Err(bad(at, format!("persistent id is {}, not a tuple", other.describe()))),
        };
        match &parts[..] {
            [Value::Str(kind), Value::Global(Global::UntypedStorage), Value::Str(key), Value::Str(location), Value::Int(n)]
                if &**kind == "storage" && *n >= 0 =>
            {
                Ok(Value::Storage(Rc::new(StorageRef { key: key.to_string(), location: location.to_string(), nbytes: *n as u64 })))
            }
            _ => Err(bad(at, "persistent id is not ('storage', torch.storage.UntypedStorage, key, location, nbytes)")),
        }
    }

    fn run(&mut self) -> Result<Value> {
        loop {
            let at = self.pos;
            let code = self.byte("opcode")?;
            match code {
                op::PROTO => {
                    if at != 0 {
                        return Err(bad(at, "PROTO after the start of the pickle"));
                    }
                    let v = self.byte("protocol")?;
                    if !(2..=5).contains(&v) {
                        return Err(bad(at, format!("pickle protocol {v}; torch.save writes 2")));
                    }
                }
                op::STOP => {
                    if self.pos != self.input.len() {
                        return Err(bad(at, format!("{} bytes after STOP", self.input.len() - self.pos)));
                    }
                    if self.marks != 0 || self.stack.len() != 1 {
                        return Err(bad(at, format!("STOP with {} items and {} marks on the stack", self.stack.len(), self.marks)));
                    }
                    return self.pop(at, "STOP");
                }
                op::MARK => {
                    if self.marks >= MAX_MARKS {
                        return Err(bad(at, format!("more than {MAX_MARKS} open MARKs")));
                    }
                    if self.stack.len() >= MAX_STACK {
                        return Err(bad(at, format!("stack deeper than {MAX_STACK} items")));
                    }
                    self.marks += 1;
                    self.stack.push(Slot::Mark);
                }
                op::BINPUT => {
                    let i = self.byte("BINPUT index")? as u32;
                    self.memo_put(at, i)?;
                }
                op::LONG_BINPUT => {
                    let i = self.u32("LONG_BINPUT index")?;
                    self.memo_put(at, i)?;
                }
                op::BINGET => {
                    let i = self.byte("BINGET index")? as u32;
                    self.memo_get(at, i)?;
                }
                op::LONG_BINGET => {
                    let i = self.u32("LONG_BINGET index")?;
                    self.memo_get(at, i)?;
                }
                op::BININT1 => {
                    let v = self.byte("BININT1")? as i64;
                    self.push(at, Value::Int(v))?;
                }
                op::BININT2 => {
                    let v = u16::from_le_bytes(self.take(2, "BININT2")?.try_into().unwrap()) as i64;
                    self.push(at, Value::Int(v))?;
                }
                op::BININT => {
                    let v = i32::from_le_bytes(self.take(4, "BININT")?.try_into().unwrap()) as i64;
                    self.push(at, Value::Int(v))?;
                }
                op::LONG1 => {
                    let n = self.byte("LONG1 length")? as usize;
                    if n > 8 {
                        return Err(bad(at, format!("LONG1 of {n} bytes does not fit in 64 bits")));
                    }
                    let bytes = self.take(n, "LONG1")?;
                    let mut buf = if bytes.last().is_some_and(|b| b & 0x80 != 0) { [0xff; 8] } else { [0; 8] };
                    buf[..n].copy_from_slice(bytes);
                    self.push(at, Value::Int(i64::from_le_bytes(buf)))?;
                }
                op::NEWTRUE => self.push(at, Value::Bool(true))?,
                op::NEWFALSE => self.push(at, Value::Bool(false))?,
                op::BINUNICODE => {
                    let n = self.u32("BINUNICODE length")? as usize;
                    if n > MAX_STR_LEN {
                        return Err(bad(at, format!("string of {n} bytes; the longest a content-store file needs is {MAX_STR_LEN}")));
                    }
                    let bytes = self.take(n, "BINUNICODE")?;
                    let s = std::str::from_utf8(bytes).map_err(|_| bad(at, "string is not UTF-8"))?;
                    self.push(at, Value::Str(s.into()))?;
                }
                op::EMPTY_TUPLE => self.push(at, seq(Vec::new()))?,
                op::TUPLE1 => self.tuple_of(at, 1, "TUPLE1")?,
                op::TUPLE2 => self.tuple_of(at, 2, "TUPLE2")?,
                op::TUPLE3 => self.tuple_of(at, 3, "TUPLE3")?,
                op::TUPLE => {
                    let items = self.pop_to_mark(at, "TUPLE")?;
                    self.push(at, seq(items))?;
                }
                op::EMPTY_DICT => self.push(at, Value::Dict(Dict { pairs: Vec::new(), depth: 1 }))?,
                op::SETITEM => {
                    let v = self.pop(at, "SETITEM")?;
                    let k = self.pop(at, "SETITEM")?;
                    self.set_items(at, vec![k, v], "SETITEM")?;
                }
                op::SETITEMS => {
                    let items = self.pop_to_mark(at, "SETITEMS")?;
                    self.set_items(at, items, "SETITEMS")?;
                }
                op::GLOBAL => {
                    let g = self.global(at)?;
                    self.push(at, g)?;
                }
                op::REDUCE => {
                    let v = self.reduce(at)?;
                    self.push(at, v)?;
                }
                op::BINPERSID => {
                    let v = self.persistent_load(at)?;
                    self.push(at, v)?;
                }
                other => {
                    return Err(bad(at, format!("opcode {} (0x{other:02x}) is not allowed in a content-store file", opcode_name(other))))
                }
            }
        }
    }
}

/// The name `pickletools` gives an opcode, for error messages.
fn opcode_name(code: u8) -> &'static str {
    match code {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "(unknown)",
    }
}
