//! The `ls` and `gc` subcommands of the `ssctl` tool.

pub mod gc;
pub mod ls;
pub mod segments;
