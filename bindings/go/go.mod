module storage-sharing.local/bindings/go

go 1.19
