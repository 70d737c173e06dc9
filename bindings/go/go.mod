module storagesharing

go 1.19
