module gpusched.local/bench/gorand

go 1.22
