//! The `ls`, `gc` and `store` subcommands of the `ssctl` tool.

pub mod gc;
pub mod ls;
pub mod segments;
pub mod store;
