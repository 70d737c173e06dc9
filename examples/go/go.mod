module app

go 1.19

require storage-sharing.local/bindings/go v0.0.0

replace storage-sharing.local/bindings/go => ../../bindings/go
