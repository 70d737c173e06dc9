# Fork safety: the pthread_atfork handlers the library installs itself on
# first use. Call them only around a fork made without fork(3) (a raw
# clone), which runs no atfork handlers.

"""Takes the library's process-wide locks before a raw fork."""
atfork_prepare() = ccall((:ss_atfork_prepare, libstorage_sharing()), Cvoid, ())

"""Releases them in the parent after a raw fork."""
atfork_parent() = ccall((:ss_atfork_parent, libstorage_sharing()), Cvoid, ())

"""Releases them in the child after a raw fork."""
atfork_child() = ccall((:ss_atfork_child, libstorage_sharing()), Cvoid, ())
