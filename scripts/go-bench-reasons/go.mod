module gpushared/go-bench-reasons

go 1.19
