# The library's log messages (its warnings and the manager daemon's notes)
# go to stderr unless a callback is set.

"""
    set_log_callback(cb::Ptr{Cvoid}, user_data::Ptr{Cvoid}=C_NULL)

Sends the library's log messages to `cb`, a C function pointer made with
`@cfunction(f, Cvoid, (Cint, Cstring, Ptr{Cvoid}))` (level `SS_LOG_WARNING` = 1
or `SS_LOG_INFO` = 2, the text, `user_data`); `C_NULL` restores stderr. `cb`
may be called from any thread of the library, and what it uses must stay
alive while it is set.
"""
set_log_callback(cb::Ptr{Cvoid}, user_data::Ptr{Cvoid}=C_NULL) =
    ccall((:ss_log_set_callback, libstorage_sharing()), Cvoid, (Ptr{Cvoid}, Ptr{Cvoid}), cb, user_data)
